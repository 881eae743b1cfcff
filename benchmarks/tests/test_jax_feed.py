"""benchmarks/jax_feed.py at a tiny size: both tables are there with a row per (workers, loader),
every figure is a number or a stated reason (an error's type and note), stoker's side
measures without errors, and a failing measurement is a cell of the table rather than the end
of the run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jax")
pytest.importorskip("grain")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "jax_feed.py"
WORKERS = (0, 2)  # 4 workers run the same code as 2, each Grain worker importing jax again
NUMBER = re.compile(r"^-?[\d,]+(\.\d+)?(x|%)?$")
NOTE = re.compile(r"^\w+ \[(\d+)\]$")


def _module() -> Any:
    if "jax_feed_bench" in sys.modules:
        return sys.modules["jax_feed_bench"]
    spec = importlib.util.spec_from_file_location("jax_feed_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """The script's --quick run in a fresh process (a hard timeout: loaders with workers run
    there), its stdout and the JSON it wrote."""
    out = tmp_path_factory.mktemp("jax_feed") / "jax_feed.json"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # tests/jax_face/conftest.py sets 8 devices in this session; the script's default is 1
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--workers", ",".join(map(str, WORKERS)), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def _table_rows(printed: str, title: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows of the table whose title starts with `title` (columns split on
    two or more spaces)."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    header = re.split(r"\s{2,}", lines[start + 1].strip())
    assert set(lines[start + 2]) == {"-"}
    rows = []
    for line in lines[start + 3 :]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return header, rows


def _check_cells(printed: str, header: list[str], rows: list[list[str]]) -> None:
    notes = re.findall(r"^\[(\d+)\] \w+: ", printed, flags=re.M)
    for row in rows:
        assert len(row) == len(header), (header, row)
        for name, cell in zip(header[2:], row[2:]):
            if name.startswith("stoker / this") and row[1] == "stoker":
                assert cell == "base", row
                continue
            note = NOTE.match(cell)
            assert NUMBER.match(cell) or (note and note.group(1) in notes), (name, cell, row)


@pytest.mark.timeout(600)
def test_quick_run_prints_both_tables_with_a_figure_or_a_reason_in_every_cell(
    quick_run: tuple[str, dict[str, Any]],
) -> None:
    printed, report = quick_run
    module = _module()
    assert f"os.cpu_count() = {os.cpu_count()}" in printed and "OMP_NUM_THREADS=" in printed
    assert "(cpu, 1 device(s))" in printed  # the default backend: one CPU device
    assert report["quick"] is True and report["workers"] == list(WORKERS) and report["wall_s"] > 0
    for workload, title, figures in (("images", "images: ", 5), ("packing", "packing: ", 7)):
        header, rows = _table_rows(printed, title)
        assert header[:2] == ["N", "loader"] and len(header) == 2 + figures + (2 if workload == "images" else 3)
        assert [(r[0], r[1]) for r in rows] == [(str(w), n) for w in WORKERS for n in module.LOADERS]
        _check_cells(printed, header, rows)

    assert [(c["workload"], c["workers"]) for c in report["cells"]] == [
        (k, w) for k in module.WORKLOADS for w in WORKERS
    ]
    for cell in report["cells"]:
        for loader in module.LOADERS:
            figures = cell[loader]
            if "error" in figures:  # a stated reason: the error's type and first line
                assert loader != "stoker" and re.match(r"^\w+", figures["error"]), figures
                continue
            keys = [k for k, _ in module.FIGURES[cell["workload"]]]
            assert all(math.isfinite(figures[k]) and figures[k] > 0 for k in keys), figures
            assert figures["warm_s"] >= figures["first_batch_s"]
            if cell["workload"] == "packing":
                assert 0 < figures["utilisation"] <= 1
    goal = [(g["workload"], g["against"]) for g in report["goal"]]
    assert goal == [(k, g) for k in module.WORKLOADS for g in module.GRAIN]
    assert printed.count(": met") + printed.count(": NOT met") == len(goal)


@pytest.mark.timeout(600)
def test_stoker_side_measures_every_item(quick_run: tuple[str, dict[str, Any]]) -> None:
    _, report = quick_run
    module = _module()
    sizes = module.QUICK
    for cell in report["cells"]:
        figures = cell["stoker"]
        assert "error" not in figures, cell
        if cell["workload"] == "images":  # every batch of the epoch, each timed one counted
            assert figures["items"] == module.image_items(cell["workers"], sizes)
            assert figures["timed_batches"] == sizes.image_window
        else:
            assert figures["items"] % sizes.rows_batch == 0 and figures["items"] > 0


@pytest.mark.timeout(300)
def test_devices_runs_on_a_mesh_of_that_many_cpu_devices(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "jax_feed.json"
    args = ["--quick", "--devices", "8", "--workers", "0", "--workloads", "images", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(cpu, 8 device(s))" in done.stdout
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in done.stdout
    assert "not measured: 2 workers are not among --workers [0]" in done.stdout
    report = json.loads(out.read_text())
    assert report["machine"]["devices"] == 8 and report["workloads"] == ["images"]
    header, rows = _table_rows(done.stdout, "images: ")
    assert [r[1] for r in rows] == list(_module().LOADERS)
    _check_cells(done.stdout, header, rows)
    assert "error" not in report["cells"][0]["stoker"]


def test_the_untimed_batches_cover_what_each_loader_makes_ahead_as_the_docstring_says() -> None:
    module = _module()
    full = module.FULL
    images = [module.untimed("images", n, full.image_batch, True) for n in (0, 2, 4)]
    packing = [module.untimed("packing", n, full.rows_batch, True) for n in (0, 2, 4)]
    doc = " ".join(module.__doc__.split())
    shown = ", ".join(f"{a} + {b}" for a, b in images[:2]) + f" and {images[2][0]} + {images[2][1]} image batches"
    assert shown in doc
    shown = ", ".join(f"{a} + {b}" for a, b in packing[:2]) + f" and {packing[2][0]} + {packing[2][1]} packing"
    assert shown in doc
    for n, (start, end) in zip((0, 2, 4), images):
        # every worker delivered once, and stoker's prefetch (2 per worker, 2 on the devices)
        # and Grain's (500 images a process, 3 batches a worker) are both behind the timed ones
        # and ahead of them at the end; whole rounds of the workers
        stoker, grain = 2 * n + 2, 3 * n + -(-max(1, n) * 500 // full.image_batch)
        assert start >= max(1, n) + max(stoker, grain) and end >= max(2, stoker, grain)
        assert start % max(1, n) == 0 and end % max(1, n) == 0
    assert [module.image_items(n, full) // full.image_batch for n in (0, 2, 4)] == [
        start + full.image_window + end for start, end in images
    ]
    assert [module.untimed("images", n, 16, False) for n in (0, 2, 4)] == [(1, 2), (2, 2), (4, 2)]  # --quick


def test_a_failing_measurement_is_a_cell_with_its_type_and_first_line(capsys: pytest.CaptureFixture[str]) -> None:
    module = _module()
    good = {
        "items_per_s": 100.0,
        "items_per_s_from_first": 90.0,
        "first_batch_s": 0.5,
        "warm_s": 0.6,
        "cpu_ms_per_batch": 2.0,
        "tokens_per_s": 1000.0,
        "utilisation": 0.9,
        "items": 64,
    }
    failed = {"error": "RuntimeError: first line"}
    raw = {}
    for workload in module.WORKLOADS:
        for loader in module.LOADERS:
            raw[f"{workload}|2|{loader}"] = [failed if loader == "grain MapDataset" else good]
    report = module.summarise(raw, list(module.WORKLOADS), [2])
    row = report["cells"][0]
    assert row["grain MapDataset"] == failed
    assert row["stoker / grain MapDataset"]["items_per_s"] is None
    assert row["stoker / grain DataLoader"]["items_per_s"] == 1.0
    report.update(
        machine={
            "os_cpu_count": 2,
            "usable_cpus": 2,
            "python": "3",
            "stoker": "0",
            "jax": "0",
            "grain": "0",
            "backend": "cpu",
            "devices": 1,
            **{v: "unset" for v in module.THREAD_VARIABLES},
        },
        sizes=module.asdict(module.QUICK),
        workers=[0],
        workloads=list(module.WORKLOADS),
    )
    module.print_report(report)
    printed = capsys.readouterr().out
    assert "RuntimeError [1]" in printed and "[1] RuntimeError: first line" in printed
    assert "[2]" not in printed  # one note for the same error
    assert "vs grain MapDataset: items/s n/a" in printed and "NOT met" in printed
    for title in ("images: ", "packing: "):
        header, rows = _table_rows(printed, title)
        _check_cells(printed, header, rows)
