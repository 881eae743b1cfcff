"""benchmarks/memory.py in its --quick mode: the report has every figure, and they make sense."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("psutil")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory.py"


@pytest.mark.timeout(90)
def test_quick_run_reports_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("memory_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    out = tmp_path / "memory.json"
    report = module.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    printed = capsys.readouterr().out
    assert "SharedList" in printed and "target" in printed and ("MET" in printed or "MISSED" in printed)

    assert report["quick"] is True and report["objects"] == 2 * report["n"] == 200_000
    build = report["build"]
    assert all(
        build[k] > 0 for k in ("paths_s", "paths_list_mb", "labels_list_mb", "paths_shared_mb", "labels_shared_mb")
    )
    assert build["paths_shared_mb"] < build["paths_list_mb"]
    for name in ("paths", "labels"):
        access = report["access"][name]
        assert access["list_ns"] > 0 and access["shared_ns"] > 0 and access["ratio"] > 0

    runs = report["runs"]
    assert len(runs) == 6 and {r["num_workers"] for r in runs} == {2, 4}
    assert {r["loader"] for r in runs} == {
        "torch DataLoader, lists",
        "stoker.torch DataLoader, lists",
        "stoker DataLoader, SharedList",
    }
    for r in runs:
        assert r["items"] == report["n"] and r["epoch_s"] > 0
        assert len(r["workers"]) == r["num_workers"], r
        for w in r["workers"]:
            for key in ("uss_before_mb", "uss_after_mb", "pss_before_mb", "pss_after_mb"):
                assert w[key] > 0, (key, w)
            assert "uss_growth_mb" in w and "pss_growth_mb" in w
    plain = [r for r in runs if "lists" in r["loader"]]
    assert all(r["uss_growth_total_mb"] > 0 for r in plain)  # the copy-on-write growth shows
    names = {t["name"] for t in report["targets"]}
    assert names == {"uss_growth_2_workers", "uss_growth_4_workers", "item_access"}
    assert all(isinstance(t["met"], bool) for t in report["targets"])
