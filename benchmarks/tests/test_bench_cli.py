"""The benchmark harness's command line (`python benchmarks/run.py`): end to end on a tiny
plan, from a clone, and its argument errors."""

from __future__ import annotations

import json
import os

import pytest

from stoker_bench.cli import main


def test_bench_quick_writes_table_json_and_chart(tmp_path, capsys) -> None:
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    code = main(
        [
            "--quick",
            "--workloads",
            "W1,W4",
            "--workers",
            "0,1",
            "--no-torch",
            "--json",
            str(out_json),
            "--png",
            str(out_png),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "W1" in printed and "W4" in printed and "memcpy ceiling" in printed
    assert "main µs/batch" in printed and "environment (as found" in printed
    report = json.loads(out_json.read_text())
    rows = {(r["workload"], r["loader"], r["workers"]) for r in report["results"]}
    # W1 also runs num_workers="auto" (W4, an IterableDataset, has no auto row)
    assert rows == {(w, "stoker", n) for w in ("W1", "W4") for n in (0, 1)} | {("W1", "stoker", "auto")}
    assert all(r["median"] > 0 for r in report["results"])
    assert all(r["main_us_per_batch"] > 0 for r in report["results"])
    machine = report["machine"]
    assert machine["memcpy_gbps"] > 0 and machine["os_cpu_count"] >= 1
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        assert name in machine
    assert out_png.exists() and out_png.stat().st_size > 0


def test_bench_sets_no_thread_variables(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code = main(["--quick", "--workloads", "W1", "--workers", "0", "--no-torch", "--out-dir", str(tmp_path)])
    assert code == 0
    assert "OMP_NUM_THREADS" not in os.environ
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["machine"]["OMP_NUM_THREADS"] == "unset"
    assert "OMP_NUM_THREADS=unset" in capsys.readouterr().out


def test_bench_w7_quick_through_torch_loaders(tmp_path, capsys) -> None:
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    code = main(["--quick", "--workloads", "W7", "--workers", "1", "--out-dir", str(tmp_path)])
    assert code == 0
    assert torch.get_num_threads() == threads  # the bench leaves torch's threads alone
    printed = capsys.readouterr().out
    assert "W7 b256" in printed and "W7 b64" in printed
    assert "W7 b256 w=1:" in printed and "(target >= 1x)" in printed
    assert "b256 vs b64 (stoker.torch, w=1)" in printed
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {(r["workload"], r["loader"], r["workers"], r["variant"]) for r in report["results"]}
    assert rows == {("W7", loader, 1, v) for loader in ("stoker.torch", "torch") for v in ("b256", "b64")}
    assert all(r["median"] > 0 and r["main_us_per_batch"] > 0 for r in report["results"])
    assert report["machine"]["torch_threads"] == threads


def test_bench_rejects_unknown_workloads_and_workers(capsys) -> None:
    assert main(["--workloads", "W13"]) == 2
    assert "unknown workloads" in capsys.readouterr().err
    assert main(["--workers", "two"]) == 2
    assert "--workers takes integers" in capsys.readouterr().err
    assert main(["--workers", "-1"]) == 2
    assert "--workers takes numbers >= 0" in capsys.readouterr().err


def test_run_py_runs_the_harness_from_a_clone(tmp_path) -> None:
    """benchmarks/run.py in a fresh interpreter that has only stoker on its path (the harness
    not installed), started from another folder."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    done = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "run.py"),
            "--quick",
            "--workloads",
            "W1",
            "--workers",
            "0",
            "--no-torch",
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr
    assert "W1" in done.stdout and (tmp_path / "bench.json").exists()
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "run.py"), "--help"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0 and "--workloads" in done.stdout and "--gpu" in done.stdout
