"""`stoker doctor` end to end: the real command in a subprocess, on the examples, on a
CPU-heavy and a cheap dataset, on datasets with traps, and on broken targets.

Each run is its own session (process group): after it exits, the group must be empty, so
no worker process outlived the doctor."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stoker import Subset
from stoker._doctor.measure import Row, loop_rate, row_readiness, steady_rate
from stoker._doctor.sweep import choose, worker_counts
from stoker._doctor.target import Config
from stoker._doctor.traps import python_containers

REPO = Path(__file__).resolve().parents[2]
HARD_TIMEOUT_S = 60

DATASETS = textwrap.dedent(
    """
    import numpy as np
    import stoker

    class Heavy(stoker.Dataset):
        # ~1-2 ms of numpy work per sample
        def __init__(self):
            self.x = np.random.default_rng(0).random(40_000)

        def __len__(self):
            return 4096

        def __getitem__(self, i):
            for _ in range(3):
                y = np.sort(self.x)
            return np.full(4, y[i % 100], np.float32)

    class Cheap(stoker.Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            return np.full(2, i, np.int32)

    class Trapped(stoker.Dataset):
        def __init__(self):
            self.paths = [f"images/{i:06d}.jpg" for i in range(20_000)]  # Python strings

        def __len__(self):
            return len(self.paths)

        def __getitem__(self, i):
            return np.full(2, np.random.rand(), np.float32)  # numpy's global RNG

    def heavy():
        return Heavy()

    def cheap():
        return stoker.DataLoader(Cheap(), batch_size=32, num_workers=2)

    def trapped():
        return stoker.DataLoader(Trapped(), batch_size=32, shuffle=True, num_workers=1)

    class Stream(stoker.IterableDataset):
        def __iter__(self):
            for i in range(20_000):
                yield np.full(4, i, np.float32)

    def stream():
        return Stream()

    def torch_loader():
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        data = TensorDataset(torch.arange(8000, dtype=torch.float32).reshape(2000, 4), torch.arange(2000))
        return DataLoader(data, batch_size=16, shuffle=True, num_workers=1)

    def boom():
        raise RuntimeError("boom")

    def number():
        return 42
    """
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("doctor")
    (path / "doctor_targets.py").write_text(DATASETS)
    return path


def doctor(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run `python -m stoker doctor ARGS` in its own session; check that nothing of its
    process group is left once it has exited. Returns the result and its wall time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "stoker", "doctor", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.communicate()
        raise
    wall = time.perf_counter() - start
    deadline = time.monotonic() + 30
    while True:  # a worker would be in the doctor's process group, its session
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            os.killpg(process.pid, 9)
            pytest.fail(f"processes of the doctor's group outlived it: {args}")
        time.sleep(0.05)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), wall


def read_json(path: Path) -> dict:
    report = json.loads(path.read_text())
    assert report["rows"], "no configuration measured"
    assert report["recommendation"]["samples_per_s"] > 0
    assert report["headroom"]["free_loader_samples_per_s"] > 0
    assert 0 < report["headroom"]["ratio"] <= 1
    return report


def best_and_recommended(report: dict) -> tuple[float, float]:
    best = max(r["samples_per_s"] or 0 for r in report["rows"])
    return best, report["recommendation"]["samples_per_s"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", ["image_pipeline", "text_pipeline"])
def test_examples(example: str, tmp_path: Path) -> None:
    seconds = 8
    out_json, out_png = tmp_path / "doctor.json", tmp_path / "doctor.png"
    result, wall = doctor(
        REPO,
        f"examples/{example}.py:make_loader",
        "--seconds",
        str(seconds),
        "--step-ms",
        "20",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("recommend: num_workers=") for line in lines), result.stdout
    assert any(line.startswith("headroom: ") for line in lines), result.stdout
    assert any(line.startswith("readiness measured: ") for line in lines), result.stdout
    assert "doctor: " in result.stderr  # progress while measuring
    report = read_json(out_json)
    assert report["profile"]["fetch_median_ms"] > 0 and report["profile"]["batch_bytes"] > 0
    assert report["readiness"]["measured"] is not None
    assert report["current"]["num_workers"] >= 1  # make_loader's own setting, measured as a row
    assert any(r["current"] for r in report["rows"])
    processes = [r for r in report["rows"] if r["kind"] == "processes" and r["samples_per_s"]]
    assert processes and all(r["uss_first_mb"] is not None and r["pss_end_mb"] is not None for r in processes)
    if importlib.util.find_spec("matplotlib") is not None:
        assert out_png.stat().st_size > 0
    else:  # the chart is optional (stoker[bench]); the CLI says why there is none
        assert not out_png.exists() and "matplotlib is not installed: no chart" in result.stdout
    # it planned its sweep in the budget asked for; how long the run took on this machine (its
    # load included) is a figure, not a pass mark
    assert report["budget_s"] == seconds
    print(f"\n{example}: {wall:.1f} s for a {seconds} s budget")


@pytest.mark.timeout(60)
def test_cpu_heavy_recommendation_is_near_the_best(workdir: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "heavy.json"
    result, _ = doctor(workdir, "doctor_targets:heavy", "--seconds", "8", "--json", str(out_json))
    assert result.returncode == 0, result.stderr
    report = read_json(out_json)
    assert report["source"] == "dataset" and report["batch_size"] == 32  # --batch-size's default
    best, recommended = best_and_recommended(report)
    assert recommended >= 0.9 * best, result.stdout


@pytest.mark.timeout(130)
def test_cheap_dataset_needs_fewer_workers_than_cpus(workdir: Path, tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    # The doctor measures throughput: on a 2-core machine shared with other work one noisy
    # window can make a GIL-bound thread row read 1.4x the inline one (seen about once in 20
    # runs, and twice in a row in a full `make test`). Up to three independent measurements
    # are taken before the test decides it failed (a test that depends on timing, for issue 47).
    for attempt in range(3):
        out_json = tmp_path / f"cheap{attempt}.json"
        result, _ = doctor(workdir, "doctor_targets:cheap", "--seconds", "8", "--json", str(out_json))
        assert result.returncode == 0, result.stderr
        report = read_json(out_json)
        best, recommended = best_and_recommended(report)
        assert recommended >= 0.9 * best, result.stdout  # consistent with its own table, every time
        if report["recommendation"]["num_workers"] < cpus:
            break
    assert report["recommendation"]["num_workers"] < cpus, result.stdout


@pytest.mark.timeout(60)
def test_traps_python_objects_and_global_rng(workdir: Path) -> None:
    result, _ = doctor(workdir, "doctor_targets:trapped", "--seconds", "4")
    assert result.returncode == 0, result.stderr
    traps = [line for line in result.stdout.splitlines() if line.startswith("trap: ")]
    objects = [t for t in traps if "dataset.paths" in t]
    assert objects and "20,000" in objects[0] and "numpy arrays" in objects[0], traps
    assert "stoker.SharedList(" in objects[0], traps
    rng = [t for t in traps if "global RNG" in t]
    assert rng and "numpy.random" in rng[0] and "seed_each_batch=True" in rng[0], traps


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "spec, expected",
    [
        ("doctor_targets_nope:heavy", "cannot import doctor_targets_nope: No module named 'doctor_targets_nope'"),
        ("doctor_targets:nope", "doctor_targets:nope: module doctor_targets has no attribute 'nope'"),
        ("doctor_targets:boom", "doctor_targets:boom raised RuntimeError: boom"),
        ("doctor_targets:number", "doctor_targets:number returned int (42)"),
    ],
)
def test_broken_targets_exit_2_with_one_line(workdir: Path, spec: str, expected: str) -> None:
    result, _ = doctor(workdir, spec, "--seconds", "5")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("stoker doctor: ") and expected in lines[0], lines[0]


@pytest.mark.timeout(60)
def test_iterable_dataset_varies_workers_only(workdir: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "stream.json"
    result, _ = doctor(workdir, "doctor_targets:stream", "--seconds", "4", "--json", str(out_json))
    assert result.returncode == 0, result.stderr
    report = read_json(out_json)
    assert {r["kind"] for r in report["rows"]} <= {"main", "processes"}
    assert "iterable dataset" in result.stdout


@pytest.mark.timeout(60)
def test_torch_loader_is_measured_with_stoker_torch(workdir: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out_json = tmp_path / "torch.json"
    result, _ = doctor(workdir, "doctor_targets:torch_loader", "--seconds", "4", "--json", str(out_json))
    assert result.returncode == 0, result.stderr
    report = read_json(out_json)
    assert report["source"] == "torch.utils.data.DataLoader"
    assert report["measured_with"] == "stoker.torch.DataLoader"
    assert report["current"] == {"num_workers": 1, "thread_pool": False, "prefetch_factor": 2}
    assert report["shuffle"] and report["batch_size"] == 16


@pytest.mark.timeout(60)
def test_the_command_in_this_process(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The `stoker` command's entry point called in the test's own process (the runs above
    start it as users do, in a subprocess): the report, its JSON and its chart, and a bad
    argument refused with one line."""
    from stoker import _cli as cli

    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    out_json, out_png = tmp_path / "stream.json", tmp_path / "stream.png"
    code = cli.main(
        ["doctor", "doctor_targets:stream", "--seconds", "4", "--json", str(out_json), "--plot", str(out_png)]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert any(line.startswith("recommend: num_workers=") for line in printed.out.splitlines()), printed.out
    assert f"wrote {out_json}" in printed.out
    report = read_json(out_json)
    assert {r["kind"] for r in report["rows"]} <= {"main", "processes"}
    if "matplotlib is not installed" not in printed.out:
        assert out_png.stat().st_size > 0
    assert cli.main(["doctor", "doctor_targets:stream", "--seconds", "0"]) == 2
    assert "--seconds, --batch-size and --step-ms take positive numbers" in capsys.readouterr().err


# ------------------------------------------------------------ the pure parts, in process
def row(workers: int, threads: bool, prefetch: int | None, rate: float) -> Row:
    return Row(Config(workers, threads, prefetch), samples_per_s=rate, rates=[rate])


def test_choose_prefers_the_cheaper_row_within_3_percent() -> None:
    rows = [row(0, False, None, 900), row(2, False, 2, 1000), row(2, True, 2, 980), row(2, False, 4, 1010)]
    assert choose(rows).config == Config(2, True, 2)  # threads, 3 % below the fastest
    rows[2] = row(2, True, 2, 970)
    assert choose(rows).config == Config(2, False, 2)  # 980 >= 0.97 x 1010
    assert choose([row(0, False, None, 990), row(1, False, 2, 1000)]).config == Config(0)
    assert choose([]) is None


def test_with_a_model_step_zero_workers_counts_its_loading_serially() -> None:
    rows = [row(0, False, None, 1000), row(1, False, 2, 990)]
    # 32 samples take 32 ms to load in the loop's own thread, beside a 50 ms step
    assert loop_rate(rows[0], 50, 32) == pytest.approx(32 / 0.082)
    assert choose(rows, step_ms=50, batch_size=32).config == Config(1)
    assert row_readiness(rows[0], 50, 32) == pytest.approx(50 / 82)
    assert row_readiness(rows[1], 50, 32) == 1.0


def test_steady_rate_skips_the_start_up_burst() -> None:
    arrivals = [1.0, 1.001, 1.1, 1.2, 1.3]  # two workers' first batches arrive together
    assert steady_rate(arrivals, [10] * 5, skip=1) == pytest.approx(30 / 0.299)
    assert steady_rate([1.0], [10], skip=0) is None


def test_worker_counts_sample_large_machines() -> None:
    assert worker_counts(2) == [0, 1, 2]
    assert worker_counts(48) == [0, 1, 2, 4, 8, 16, 32, 48]


def test_python_containers_are_found_through_wrappers() -> None:
    class Records:
        def __init__(self) -> None:
            self.items = [(f"{i}.jpg", i) for i in range(5000)]  # 15,000 objects
            self.small = list(range(100))

        def __getitem__(self, i: int) -> tuple[str, int]:
            return self.items[i]

        def __len__(self) -> int:
            return len(self.items)

    found = python_containers(Subset(Records(), range(10)))
    assert [(c.path, c.type) for c in found] == [("dataset.dataset.items", "list")]
    assert found[0].objects == 15_000
