"""`stoker-bench --gpu`: the skip line without a GPU, and its measuring code run on the CPU
with tiny sizes (the only way to run it where no GPU is)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from stoker_bench import gpubench
from stoker_bench.cli import main


def test_gpu_quick_skips_without_a_gpu(tmp_path, capsys) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the skip path does not run here")
    code = main(["--gpu", "--quick", "--out-dir", str(tmp_path)])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("stoker-bench --gpu: skipped: no CUDA GPU")
    assert "torch.cuda.is_available() is False" in lines[0]
    assert not (tmp_path / "gpubench.json").exists()


def test_gpu_refuses_no_torch(capsys) -> None:
    assert main(["--gpu", "--no-torch"]) == 2
    assert "--no-torch" in capsys.readouterr().err


def test_gpu_bad_workers_are_refused(capsys) -> None:
    assert main(["--gpu", "--workers", "x"]) == 2
    assert "--workers takes integers" in capsys.readouterr().err


def test_measuring_code_on_the_cpu(tmp_path) -> None:
    pytest.importorskip("torch")
    plan = gpubench.Plan(
        workers=(0,),
        reps=2,
        batch_size=4,
        warm=1,
        measured=2,
        sources=8,
        head_width=16,
        head_repeats=2,
        pins=(False,),
        device="cpu",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = gpubench.run(plan)
    assert len(report["ceiling"]["images_per_s"]) == 2 and report["ceiling"]["median"] > 0
    rows = {(r["loader"], r["workers"], r["pin_memory"], r["feed"]) for r in report["results"]}
    assert rows == {(loader, 0, False, how) for loader in gpubench.LOADERS for how in gpubench.FEEDS}
    for row in report["results"]:
        assert len(row["images_per_s"]) == len(row["cpu_ms_per_batch"]) == len(row["gb_per_s"]) == 2
        assert row["min"] <= row["median"] <= row["max"] and row["feed_ratio"] > 0
        assert row["median_cpu_ms"] > 0 and row["median_gb_per_s"] > 0
    assert report["copy_rates_gb_per_s"] == {}  # measured on a CUDA device only
    text = gpubench.table(report)
    assert "ceiling" in text and "stoker.torch" in text and "feed" in text
    path = tmp_path / "sub" / "g.json"
    gpubench.save_json(report, str(path))
    assert json.loads(path.read_text())["plan"]["device"] == "cpu"


def test_configurations_cover_the_matrix() -> None:
    configs = gpubench.configurations(gpubench.Plan())
    assert len(configs) == 2 * 2 * 2 * 3
    assert {c[0] for c in configs} == {8, 14}
    assert {c[3] for c in configs} == {"loop", "to_device", "normalize"}


def test_the_gpu_path_benchmark_runs_on_the_cpu() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("PIL")
    plan = gpubench.GpuPathPlan(
        gpu_workers=(1,),
        torch_workers=(1,),
        reps=1,
        quick=True,
        warm=1,
        measured=2,
        decode_batches=2,
        device="cpu",
        head_width=16,
        step_warm=0,
        step_measured=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning about more workers than it suggests
        report = gpubench.gpu_path(plan)
    assert {(r["pipeline"], r["workers"]) for r in report["rows"]} == {("float", 1), ("gpu", 1)}
    assert report["decoder"] == "cpu" and report["decode"]["images_per_s"] > 0
    assert report["feeds"][0]["feed_ratio"] > 0 and report["step"]["head_repeats"] >= 0
    assert "feed ratio" in gpubench.gpu_path_table(report)
    with pytest.raises(ValueError, match="at most 4"):
        gpubench.gpu_path(dataclasses.replace(plan, gpu_workers=(8,)))
