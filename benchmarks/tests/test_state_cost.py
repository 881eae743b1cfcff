"""benchmarks/state_cost.py at a tiny size: every table and figure is there, torchdata's side
measures, stoker's side measures without errors, and a failing measurement is a cell of the
table rather than the end of the run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchdata.stateful_dataloader")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "state_cost.py"
WORKERS = (0, 2)  # 8 workers run the same code as 2, at several times the cost on 2 cores
MIB = 1 << 20


def _module() -> Any:
    if "state_cost_bench" in sys.modules:
        return sys.modules["state_cost_bench"]
    spec = importlib.util.spec_from_file_location("state_cost_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """The script's --quick run in a fresh process (a hard timeout: loaders with workers run
    there), its stdout and the JSON it wrote."""
    out = tmp_path_factory.mktemp("state_cost") / "state_cost.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--workers", ",".join(map(str, WORKERS)), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def _cells(report: dict[str, Any], loader: str) -> list[dict[str, Any]]:
    return [row[loader] for part in ("state_dict", "epoch", "replay") for row in report[part]]


@pytest.mark.timeout(300)
def test_quick_run_prints_every_table_and_torchdata_measures(quick_run: tuple[str, dict[str, Any]]) -> None:
    printed, report = quick_run
    module = _module()
    assert f"os.cpu_count() = {os.cpu_count()}" in printed
    assert "OMP_NUM_THREADS=" in printed and "workers forked" in printed
    for title in ("state_dict() mid-epoch", "items/s over an epoch", "resuming a stateless stream"):
        assert title in printed
    assert report["quick"] is True and report["workers"] == list(WORKERS) and report["wall_s"] > 0

    cases = [(r["case"], r["workers"]) for r in report["state_dict"]]
    assert cases == [(c, w) for c in module.CASES for w in WORKERS]
    for row in report["state_dict"]:
        figures = row["torchdata"]
        assert "error" not in figures, row
        assert figures["median_us"] > 0 and figures["calls"] == module.QUICK.calls
        # each worker's replica state is in the loader's state: a 1 MB state once per worker
        if row["case"] == "iter, 1 MB state":
            assert figures["bytes"] >= MIB * max(row["workers"], 1)
        else:
            assert 0 < figures["bytes"] < MIB

    assert [(r["case"], r["workers"], r["snapshot_every_n_steps"]) for r in report["epoch"]] == [
        (c, w, s) for c in module.CASES for w in WORKERS for s in (1, 8)
    ]
    assert all(r["torchdata"]["items_per_s"] > 0 for r in report["epoch"]), report["epoch"]

    assert [(r["workers"], r["position"]) for r in report["replay"]] == [
        (w, p) for w in WORKERS for p in module.QUICK.replay_positions
    ]
    for row in report["replay"]:
        figures = row["torchdata"]
        assert figures["ms"] > 0 and figures["exact"] is True, row
        assert ("us_per_item" in figures) == (row["position"] > 0)


@pytest.mark.timeout(300)
def test_stoker_side_measures_without_errors(quick_run: tuple[str, dict[str, Any]]) -> None:
    printed, report = quick_run
    assert "stoker.torch.StatefulDataLoader" in report["loaders"], report["loaders"]
    errors = [cell["error"] for cell in _cells(report, "stoker") if "error" in cell]
    assert not errors, sorted(set(errors))
    assert "errors:" not in printed
    for row in report["state_dict"]:
        figures = row["stoker"]
        assert figures["median_us"] > 0
        if row["case"] == "iter, 1 MB state":  # the array itself is kept, not converted
            assert figures["bytes"] >= MIB * max(row["workers"], 1)
        assert row["stoker"]["bytes"] > 0
    assert all(r["stoker"]["items_per_s"] > 0 for r in report["epoch"])
    # a stateless stream replayed to where it was: the resumed first batch is the next one
    assert all(r["stoker"]["exact"] is True for r in report["replay"]), report["replay"]
    assert "wrong batch" not in printed


def test_a_failing_measurement_is_a_cell_with_its_type_and_first_line(capsys: pytest.CaptureFixture[str]) -> None:
    module = _module()

    def fails() -> dict[str, Any]:
        raise RuntimeError("first line\nsecond line")

    def works(x: int) -> dict[str, Any]:
        return {"median_us": float(x), "bytes": 2 * x}

    failed = module.measured(fails)
    assert failed == {"error": "RuntimeError: first line"}
    assert module.measured(works, 21) == {"median_us": 21.0, "bytes": 42}

    good = {"median_us": 10.0, "p90_us": 12.0, "calls": 1, "bytes": 100}
    report = {
        "loaders": "stoker and torchdata",
        "machine": module.machine(),
        "sizes": module.asdict(module.QUICK),
        "workers": [0],
        "state_dict": [{"case": c, "workers": 0, "stoker": failed, "torchdata": good} for c in module.CASES],
        "epoch": [
            {"case": c, "workers": 0, "snapshot_every_n_steps": s, "stoker": failed, "torchdata": {"items_per_s": 5.0}}
            for c in module.CASES
            for s in (1, 8)
        ],
        "replay": [
            {"workers": 0, "position": 0, "stoker": failed, "torchdata": {"ms": 1.0, "exact": True}},
            {"workers": 0, "position": 10, "stoker": failed, "torchdata": {"ms": 3.0, "exact": False}},
        ],
    }
    module.print_report(report)
    printed = capsys.readouterr().out
    assert "RuntimeError [1]" in printed and "[1] RuntimeError: first line" in printed
    assert "second line" not in printed and "[2]" not in printed  # one note for the same error
    assert "3.0 (wrong batch)" in printed
    assert f"os.cpu_count() = {os.cpu_count()}" in printed
