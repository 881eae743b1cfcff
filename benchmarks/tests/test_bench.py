"""The pieces of the benchmark harness (benchmarks/stoker_bench/bench): the steady-state window,
rates and main-process CPU per batch over it, W7's epoch sizes and dataset, the environment it
records, the W7 targets, the stats overhead pairs and the num_workers="auto" rows (and two tiny
runs of them), and the chart."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict

import pytest

from stoker_bench import bench as bench
from stoker_bench.bench import runner


def test_steady_window_leaves_out_the_prefetch_at_each_end() -> None:
    # 0 workers: one batch at a time; a tenth of 100 batches is more than 2 + 1
    assert bench.steady_window(100, 0) == (10, 89)
    # 2 workers, default prefetch 2: 2 * 2 + 1 = 5 > 40 // 10, and the span is a multiple of 2
    assert bench.steady_window(40, 2) == (5, 33)
    # prefetch_factor=4 (W7): 4 * 2 + 1 = 9 at each end
    assert bench.steady_window(40, 2, prefetch=4) == (9, 29)
    # 14 workers, prefetch 4: 57 at each end, span 140 = 10 rounds of 14
    first, last = bench.steady_window(256, 14, prefetch=4)
    assert (first, last) == (57, 197) and (last - first) % 14 == 0


def test_steady_window_is_none_when_the_epoch_is_too_short() -> None:
    assert bench.steady_window(20, 2, prefetch=4) is None  # 9 + 9 left out: 1 batch left
    assert bench.steady_window(8, 0) is None
    # the brief's 8 * workers + 32 batches would leave only 28 at 14 workers (< 4 x 14)
    assert bench.steady_window(8 * 14 + 32, 14, prefetch=4) is None


@pytest.mark.parametrize("workers", [0, 1, 2, 4, 8, 14])
@pytest.mark.parametrize("batch_size", bench.W7_BATCH_SIZES)
def test_w7_epochs_always_have_a_window_of_several_rounds(workers: int, batch_size: int) -> None:
    sizes = bench.Sizes()
    batches = bench.w7_batches(sizes, workers)
    assert batches * batch_size >= 10_240 or batch_size != 256
    first, last = bench.steady_window(batches, workers, bench.W7_PREFETCH)
    assert last - first >= 8 * max(1, workers)


def test_steady_rate_and_us_per_batch_on_synthetic_arrivals() -> None:
    # 40 batches of 10 samples: 1 ms apart for the first 10 (prefetched, "free"), 10 ms after;
    # the main process spends 200 µs of CPU on each batch
    arrivals, cpu, t = [], [], 0.0
    for k in range(40):
        t += 0.001 if k < 10 else 0.010
        arrivals.append(t)
        cpu.append(0.5 + 200e-6 * (k + 1))
    sizes = [10] * 40
    window = bench.steady_window(40, 2, prefetch=4)
    assert window == (9, 29)
    assert bench.window_rate(arrivals, sizes, window) == pytest.approx(1000.0)  # 10 samples / 10 ms
    assert bench.steady_rate(arrivals, sizes, 2, prefetch=4) == pytest.approx(1000.0)
    assert bench.us_per_batch(cpu, window) == pytest.approx(200.0)
    # the default prefetch's smaller margin would take in prefetched batches: a higher rate
    assert bench.steady_rate(arrivals, sizes, 2) > 1000.0


def test_epoch_rate_records_main_process_cpu_per_batch() -> None:
    import numpy as np

    def batches():
        for _ in range(40):
            np.sort(np.random.default_rng(0).random(20_000))  # some CPU in the main process
            yield np.zeros((100, 4))

    timing = bench._epoch_rate(batches, workers=0)
    assert timing.steady is not None and timing.steady > 0
    assert timing.main_us is not None and timing.main_us > 0
    assert timing.whole > 0 and timing.whole_main_us > 0


def test_batch_len_of_dicts_tuples_and_arrays() -> None:
    np = pytest.importorskip("numpy")
    assert bench._batch_len({"id": np.zeros(7), "x": np.zeros((7, 4))}) == 7
    assert bench._batch_len([np.zeros((5, 3)), np.zeros(5)]) == 5
    assert bench._batch_len(np.zeros((9, 2))) == 9


def test_w7_dataset_returns_a_uint8_crop_and_an_int_deterministically() -> None:
    torch = pytest.importorskip("torch")
    sources = bench.w7_sources(3)
    assert sources.shape == (3, 3, 256, 256) and sources.dtype.name == "uint8"
    data = bench.ImageNetCrops(sources, 10)
    assert len(data) == 10
    torch.manual_seed(0)
    first = [data[i] for i in range(10)]
    torch.manual_seed(0)
    again = [data[i] for i in range(10)]
    for (image, label), (image2, label2), i in zip(first, again, range(10)):
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
        assert tuple(image.shape) == (3, 224, 224)
        assert type(label) is int and label == i % 3
        assert torch.equal(image, image2) and label == label2
    # each image is a crop of its source, flipped or not
    for image, label in first:
        source = sources[label]
        found = False
        for candidate in (image.numpy(), image.flip(-1).numpy()):
            corners = source[0, :33, :33] == candidate[0, 0, 0]  # where the crop may start
            found |= any(
                (source[:, top : top + 224, left : left + 224] == candidate).all()
                for top, left in zip(*corners.nonzero())
            )
        assert found
    # a different seed gives different crops
    torch.manual_seed(1)
    assert not all(torch.equal(data[i][0], first[i][0]) for i in range(10))


def test_w7_dataset_pickles() -> None:
    import pickle

    data = bench.ImageNetCrops(bench.w7_sources(2), 5)
    copy = pickle.loads(pickle.dumps(data))
    assert len(copy) == 5 and (copy.sources == data.sources).all()


def test_environment_reports_thread_variables_as_found(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    machine = bench.environment()
    assert machine["OMP_NUM_THREADS"] == "3"
    assert machine["MKL_NUM_THREADS"] == "unset" and machine["OPENBLAS_NUM_THREADS"] == "unset"
    assert machine["os_cpu_count"] >= 1 and machine["cpus"] >= 1
    line = bench.environment_line(machine | {"memcpy_gbps": 1.0})
    assert "OMP_NUM_THREADS=3" in line and "MKL_NUM_THREADS=unset" in line


def _row(loader: str, workers: int, variant: str, rate: float, us: float) -> bench.Result:
    row = bench.Result("W7", loader, workers, variant, values=[rate])
    row.extra["main_us_per_batch"] = [us]
    return row


def test_w7_targets_at_each_worker_count_and_batch_size_cost() -> None:
    rows = []
    for workers in (0, 2, 14):
        rows += [
            _row("stoker.torch", workers, "b256", 1600.0, 300.0),
            _row("torch", workers, "b256", 1000.0, 900.0),
            _row("stoker.torch", workers, "b64", 1500.0, 200.0),
            _row("torch", workers, "b64", 1000.0, 400.0),
        ]
    found = {t["target"]: t for t in bench.targets(rows, ceiling=10.0)}
    assert "W7 b256 w=0" not in found
    assert found["W7 b256 w=2"]["met"] and "1.60x torch (target >= 1x)" in found["W7 b256 w=2"]["shown"]
    assert found["W7 b256 w=14"]["met"] and "(target >= 1.5x)" in found["W7 b256 w=14"]["shown"]
    cost = found["W7 main-process CPU per batch, b256 vs b64 (stoker.torch, w=14)"]
    assert not cost["met"] and cost["value"] == pytest.approx(1.5)
    # the table shows the column and both variants
    report = {
        "results": [
            asdict(r) | {"median": r.median, "gbps": r.gbps(), "main_us_per_batch": r.main_us_per_batch} for r in rows
        ],
        "w3_scaling": [],
        "targets": list(found.values()),
        "machine": bench.environment() | {"memcpy_gbps": 10.0},
    }
    text = bench.table(report)
    assert "main µs/batch" in text and "W7 b256" in text and "W7 b64" in text
    assert "environment (as found" in text


# ------------------------------------------------ stats overhead and num_workers="auto"
def test_pair_overhead_is_the_median_of_the_per_pair_ratios() -> None:
    on = [100.0, 100.0, 100.0, 200.0, 50.0]
    off = [101.0, 103.0, 90.0, 204.0, 51.0]  # off/on - 1: +1 %, +3 %, -10 %, +2 %, +2 %
    assert bench.pair_overhead(on, off) == pytest.approx(0.02)
    # not the ratio of the medians (101 / 100 - 1 = 1 %)
    assert bench.pair_overhead(on, off) != pytest.approx(statistics.median(off) / statistics.median(on) - 1)
    # stats on faster than off: a negative overhead; an even count: the mean of the middle two
    assert bench.pair_overhead([100.0, 100.0], [98.0, 97.0]) == pytest.approx(-0.025)
    with pytest.raises(ValueError):
        bench.pair_overhead([], [])
    with pytest.raises(ValueError):
        bench.pair_overhead([1.0, 2.0], [1.0])


@pytest.mark.parametrize(("pairs", "reps", "per_rep"), [(5, 3, 2), (5, 1, 5), (5, 5, 1), (5, 10, 1), (2, 1, 2)])
def test_pairs_per_rep_gives_at_least_the_pairs_asked_in_every_repetition(pairs: int, reps: int, per_rep: int) -> None:
    assert bench.pairs_per_rep(bench.Sizes(stats_pairs=pairs), reps) == per_rep
    assert bench.Sizes().stats_pairs >= 15 and bench.Sizes.quick().stats_pairs == 2


class _FakeAutoLoader:
    """What the bench reads of a loader made with num_workers="auto" after its epoch."""

    def __init__(self, batches: int) -> None:
        self.batches, self.num_workers = batches, "auto"

    def __iter__(self):
        np = pytest.importorskip("numpy")
        self.num_workers = 2  # chosen at iter()
        for _ in range(self.batches):
            yield np.zeros((10, 4))

    def stats(self):
        from types import SimpleNamespace

        return SimpleNamespace(num_workers=2, prefetch_factor=3, choice="num_workers=2, prefetch_factor=3 (why)")


def test_epoch_rate_of_an_auto_loader_reads_its_choice_after_the_epoch() -> None:
    timing = bench._epoch_rate(lambda: _FakeAutoLoader(40), None, None)
    assert timing.chosen == bench.Chosen(2, 3, "num_workers=2, prefetch_factor=3 (why)")
    assert timing.steady is not None and timing.whole > 0
    # the window follows the choice: 3 * 2 + 1 left out at each end leaves 40 - 14 batches -> 24
    assert bench.steady_window(40, 2, 3) == (7, 31)


def _timed(workload: str, workers, variant: str, steady: list[float], whole: list[float]) -> bench.Result:
    row = bench.Result(workload, "stoker", workers, variant, values=list(steady))
    row.extra["with_startup"] = list(whole)
    row.extra["main_us_per_batch"] = [10.0] * len(steady)
    row.extra["first_batch_s"] = [0.2 if workers == bench.AUTO else 0.01] * len(steady)
    return row


def _synthetic_rows() -> list[bench.Result]:
    rows = []
    pairs = {0: ([100.0, 100.0, 100.0], [101.0, 100.5, 99.0]), 2: ([200.0, 190.0, 210.0], [210.0, 200.0, 212.0])}
    for workers, (on, off) in pairs.items():
        rows.append(_timed("W1", workers, "stats on", on, on))
        rows.append(_timed("W1", workers, "stats off", off, off))
    for workers, rate in ((0, 100.0), (1, 150.0), (2, 180.0)):
        for variant in ("", bench.AUTO_REF):  # the workload's rows, and the epochs next to auto's
            rows.append(_timed("W1", workers, variant, [rate], [rate * 0.9]))
            rows.append(_timed("W3", workers, variant, [rate / 10], [rate / 10]))
    auto = _timed("W1", bench.AUTO, "", [178.0], [153.0])  # 153 / (180 * 0.9) = 0.944
    auto.choices = ["num_workers=2, prefetch_factor=2 (tiny samples)"]
    auto.extra["chosen_workers"] = [2.0]
    auto3 = _timed("W3", bench.AUTO, "", [10.0], [10.0])  # 10 / 18 = 0.56: missed
    auto3.choices = ["num_workers=0 (why not)"]
    auto3.extra["chosen_workers"] = [0.0]
    return [*rows, auto, auto3]


def _report(rows: list[bench.Result]) -> dict:
    return {
        "results": [
            asdict(r) | {"median": r.median, "gbps": r.gbps(), "main_us_per_batch": r.main_us_per_batch} for r in rows
        ],
        "w3_scaling": bench.w3_scaling(rows),
        "stats_overhead": bench.stats_overhead(rows),
        "auto": {"run": True, "note": None, "workloads": bench.auto_vs_best(rows)},
        "targets": bench.targets(rows, ceiling=10.0),
        "machine": bench.environment() | {"memcpy_gbps": 10.0},
    }


def test_stats_overhead_and_auto_figures_and_targets() -> None:
    rows = _synthetic_rows()
    overhead = {e["workers"]: e for e in bench.stats_overhead(rows)}
    assert set(overhead) == {0, 2}
    assert overhead[0]["pairs"] == 3 and overhead[0]["overhead"] == pytest.approx(0.005)
    assert overhead[0]["per_pair"] == pytest.approx([0.01, 0.005, -0.01])
    assert overhead[2]["overhead"] == pytest.approx(0.05)
    assert overhead[2]["on"] == 200.0 and overhead[2]["off"] == 210.0
    # the epochs run next to the auto rows are not W3's scaling rows
    assert [(e["workers"], e["scaling"]) for e in bench.w3_scaling(rows)] == [(1, 1.5), (2, 0.9)]
    auto = {e["workload"]: e for e in bench.auto_vs_best(rows)}
    assert set(auto) == {"W1", "W3"}  # no W2 rows
    assert auto["W1"]["best_workers"] == 2 and auto["W1"]["ratio"] == pytest.approx(153 / 162)
    assert auto["W1"]["steady_ratio"] == pytest.approx(178 / 180) and auto["W1"]["chosen_workers"] == [2]
    assert auto["W1"]["choices"] == ["num_workers=2, prefetch_factor=2 (tiny samples)"]
    assert (auto["W1"]["auto_first_s"], auto["W1"]["best_first_s"]) == (0.2, 0.01)
    found = {t["target"]: t for t in bench.targets(rows, ceiling=10.0)}
    w0, w2 = (found[f"W1 stats overhead w={w} (stoker, stats=True vs stats=False)"] for w in (0, 2))
    assert w0["met"] and w0["value"] == pytest.approx(0.005) and "(target < 2%)" in w0["shown"]
    assert not w2["met"] and "+5.0% (median of 3 pairs" in w2["shown"]
    w1_auto, w3_auto = found["W1 auto vs best hand-picked (stoker)"], found["W3 auto vs best hand-picked (stoker)"]
    assert (
        w1_auto["met"]
        and "0.94x of the best hand-picked epoch next to it (median of 1 blocks)" in w1_auto["shown"]
        and "(target >= 0.85x)" in w1_auto["shown"]
    )
    assert not w3_auto["met"] and w3_auto["value"] == pytest.approx(10 / 18)
    report = _report(rows)
    json.dumps(report)  # JSON-ready
    text = bench.table(report)
    assert "W1 stats overhead (stoker" in text
    assert "main µs/batch on 10.0 off 10.0  overhead +0.5%  (pairs: +1.0% +0.5% -1.0%)" in text
    assert "W1 stats on" in text and "W1 stats off" in text
    assert (
        "auto 153.0/s vs 162.0/s at w=2 (medians): 0.94x (blocks: 0.94; steady state 0.99x); "
        "first batch after 200 ms vs 10 ms"
    ) in text
    assert "1x: num_workers=2, prefetch_factor=2 (tiny samples)" in text
    assert "MET    W1 auto vs best hand-picked" in text and "MISSED W3 auto vs best hand-picked" in text


def test_chart_has_the_stats_overhead_and_auto_panels(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    report = _report(_synthetic_rows())
    path = tmp_path / "sub" / "bench.png"
    assert bench.chart(report, str(path))
    assert path.exists() and path.stat().st_size > 0
    fig = bench.figure(report)
    titles = [ax.get_title() for sub in fig.subfigs for ax in sub.axes]
    assert titles == ["W1", "W3", "W1 stats overhead (pairs, median of 3)", 'num_workers="auto" vs best hand-picked']
    # the auto rows are bars in their workload's panel; the stats pairs are not
    w1 = fig.subfigs[0].axes[0]
    assert [t.get_text() for t in w1.get_xticklabels()] == [f"stoker\nw={w}" for w in (0, 1, 2, "auto")]
    # without the new figures the chart is the samples/s panels alone
    bare = report | {"stats_overhead": [], "auto": {"workloads": []}}
    assert len(bench.figure(bare).subfigs) == 1


def _tiny_plan(workers: list[int], reps: int, pairs: int) -> bench.Plan:
    return bench.Plan(["W1"], workers, reps, bench.Sizes(w1=4096, stats_pairs=pairs), with_torch=False)


def test_run_measures_interleaved_stats_pairs_and_auto(monkeypatch) -> None:
    monkeypatch.setattr(runner, "memcpy_gbps", lambda: 10.0)
    report = bench.run(_tiny_plan([0, 1], reps=2, pairs=2), progress=False)  # a pair per repetition
    json.dumps(report)
    rows = {(r["workload"], r["loader"], r["workers"], r["variant"]): r for r in report["results"]}
    for workers in (0, 1):
        on, off = rows["W1", "stoker", workers, "stats on"], rows["W1", "stoker", workers, "stats off"]
        assert len(on["values"]) == len(off["values"]) == 2
        assert on["extra"]["on_first"] == [1.0, 0.0]  # which goes first alternates, across repetitions too
        assert all(v > 0 for v in on["values"] + off["values"])
    overhead = report["stats_overhead"]
    assert [(e["workers"], e["pairs"]) for e in overhead] == [(0, 2), (1, 2)]
    # tiny epochs on a busy machine: the figure itself is noise here, so check it is the pairs'
    # median ratio of the measured rows (a bound on it failed under load)
    for e in overhead:
        on, off = rows["W1", "stoker", e["workers"], "stats on"], rows["W1", "stoker", e["workers"], "stats off"]
        assert e["per_pair"] == pytest.approx([b / a - 1 for a, b in zip(on["values"], off["values"])])
        assert e["overhead"] == pytest.approx(statistics.median(e["per_pair"]))
        assert e["on"] > 0 and e["off"] > 0
    names = [t["target"] for t in report["targets"]]
    assert "W1 stats overhead w=1 (stoker, stats=True vs stats=False)" in names
    if bench.auto_unsupported() is None:
        auto = rows["W1", "stoker", "auto", ""]
        blocks = 2 * bench.AUTO_BLOCKS  # per repetition
        assert len(auto["values"]) == blocks and len(auto["choices"]) == blocks and all(auto["choices"])
        for workers in (0, 1):  # each block also ran every hand-picked worker count
            assert len(rows["W1", "stoker", workers, bench.AUTO_REF]["values"]) == blocks
        assert all(0 <= w <= (os.cpu_count() or 1) for w in auto["extra"]["chosen_workers"])
        assert report["auto"]["run"] and report["auto"]["note"] is None
        [entry] = report["auto"]["workloads"]
        assert entry["workload"] == "W1" and entry["ratio"] > 0 and entry["best_workers"] in (0, 1)
        assert len(entry["per_block"]) == blocks and entry["ratio"] == statistics.median(entry["per_block"])
        assert "W1 auto vs best hand-picked (stoker)" in names
        assert 'auto (stoker, num_workers="auto"' in bench.table(report)


def test_run_skips_auto_with_a_note_when_the_loader_refuses_it(monkeypatch) -> None:
    monkeypatch.setattr(runner, "memcpy_gbps", lambda: 10.0)
    monkeypatch.setattr(runner, "auto_unsupported", lambda: "TypeError: num_workers should be an int")
    report = bench.run(_tiny_plan([0], reps=1, pairs=1), progress=False)
    assert all(r["workers"] != "auto" for r in report["results"])
    assert not report["auto"]["run"] and report["auto"]["workloads"] == []
    assert 'num_workers="auto" not run: this stoker refuses it (TypeError' in report["auto"]["note"]
    assert report["auto"]["note"] in bench.table(report)


def test_auto_unsupported_says_why_or_nothing() -> None:
    why = bench.auto_unsupported()
    assert why is None or why.startswith(("TypeError", "ValueError"))


# ------------------------------------------------ W8, the arena, W5's start methods and torch-free case
def test_w8_images_are_distinct_memory_and_an_epoch_reads_each_once() -> None:
    np = pytest.importorskip("numpy")
    assert bench.Sizes().w8_images * bench.IMAGE_BYTES >= 1e9  # at least 1 GB of distinct images
    assert bench.Sizes.quick().w8_images * bench.IMAGE_BYTES <= 100e6
    images = bench.w8_images(600)
    assert images.shape == (600, *bench.IMAGE_SHAPE) and images.dtype == np.uint8
    assert images.flags.c_contiguous  # each image its own memory
    assert not (images[0] == images[256]).all() and (images[256] == images[0] + np.uint8(1)).all()
    data = bench.LargeImages(images)
    assert len(data) == 600 and data[599] is not None and (data[5] == images[5]).all()
    longer = bench.LargeImages(images, 1000)
    assert len(longer) == 1000 and (longer[601] == images[1]).all()
    # every image once at the default size and workers; longer only for many workers
    assert bench.w8_samples(bench.Sizes(), 2) == 7000
    assert bench.w8_samples(bench.Sizes(), 14) == 64 * (32 + 16 * 14)


def test_two_thread_memcpy_measures_a_bandwidth() -> None:
    assert bench.memcpy_threads_gbps(2, nbytes=4 << 20, reps=2) > 0
    assert bench.memcpy_threads_gbps(1, nbytes=4 << 20, reps=1) > 0


def test_epoch_rate_reads_the_arena_of_a_process_worker_loader() -> None:
    np = pytest.importorskip("numpy")
    import stoker

    rows = np.zeros((400, 1000), np.uint8)

    def make():
        return stoker.DataLoader(stoker.ArrayDataset(rows), batch_size=10, num_workers=1)

    timing = bench._epoch_rate(make, 1, 2, arena=True)
    use = timing.arena
    assert use is not None and use.batch_bytes == 10 * 1000 and use.window == 2 and use.limit == 4
    assert use.arena_bytes >= use.batch_bytes and use.batches == use.arena_bytes / use.batch_bytes
    # off by default, and a loader without an arena reads 0
    assert bench._epoch_rate(make, 1).arena is None
    assert bench.arena_bytes(object()) == 0


def test_importing_the_bench_does_not_import_torch() -> None:
    import subprocess
    import sys

    import stoker_bench

    code = "import sys, stoker_bench.bench; print('torch' in sys.modules)"
    paths = [stoker_bench.HOME, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))  # the harness need not be installed
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.strip() == "False"


def test_torch_free_first_batch_runs_in_a_fresh_process_without_torch() -> None:
    found = bench.torch_free_first_batch("fork", 1)
    assert found["first_batch_s"] > 0 and found["import_s"] > 0 and found["make_s"] >= 0
    assert found["torch_imported"] is False


def test_w5_and_w8_jobs(monkeypatch) -> None:
    import stoker

    monkeypatch.setattr(runner, "usable_cpus", lambda: 2)
    sizes = bench.Sizes.quick()
    sizes.w5_mb = (1, 2)
    plan = bench.Plan(["W5", "W8"], [0, 2], 1, sizes, with_torch=False)
    jobs = bench._jobs(plan, {"stoker": stoker}, 1, large=bench.w8_images(4))
    keys = {job[:4] for job in jobs}
    methods = bench.w5_methods()
    assert "forkserver" in methods and "spawn" in methods  # Linux
    assert {("W5", "stoker", 2, f"{m} {mb} MB") for m in methods for mb in (1, 2)} <= keys
    assert {("W5", "stoker", 2, f"torch-free {m} 1 MB") for m in methods} <= keys
    assert {("W8", "stoker", w, "") for w in (0, 2)} <= keys
    # no W8 rows without its images
    assert not any(k[0] == "W8" for k in (job[:4] for job in bench._jobs(plan, {"stoker": stoker}, 1)))


def _w5_w8_rows(torch_imported: float = 0.0) -> list[bench.Result]:
    rows = []
    for method in ("fork", "spawn", "forkserver"):
        for mb, ours, theirs in ((10, 0.05, 0.1), (200, 0.1, 1.0)):
            rows.append(bench.Result("W5", "stoker.torch", 2, f"{method} {mb} MB", "s to first batch", [ours]))
            rows.append(bench.Result("W5", "torch", 2, f"{method} {mb} MB", "s to first batch", [theirs]))
        free = bench.Result("W5", "stoker", 2, f"torch-free {method} 10 MB", "s to first batch", [0.2, 0.25, 0.4])
        free.extra = {"torch_imported": [torch_imported, 0.0, 0.0], "import_s": [0.1] * 3, "make_s": [0.01] * 3}
        rows.append(free)
    for loader, rate in (("stoker", 6000.0), ("stoker.torch", 5500.0), ("torch", 1000.0)):
        rows.append(bench.Result("W8", loader, 2, values=[rate], bytes_per_sample=bench.IMAGE_BYTES))
    arena = rows[-3]  # stoker's W8 row
    arena.extra = {
        "arena_bytes": [5.0e6, 6.0e6],
        "arena_batch_bytes": [1.0e6, 1.0e6],
        "arena_batches": [5.0, 6.0],
        "arena_window": [4.0, 4.0],
    }
    w2 = bench.Result("W2", "stoker", 1, values=[5000.0], bytes_per_sample=bench.IMAGE_BYTES)
    w2.extra = {"arena_bytes": [4.0e6], "arena_batch_bytes": [1.0e6], "arena_batches": [4.0], "arena_window": [2.0]}
    return [*rows, w2]


def test_w5_w8_and_arena_targets() -> None:
    rows = _w5_w8_rows()
    found = {t["target"]: t for t in bench.targets(rows, ceiling=1.0, ceiling2=3.0)}
    for method in ("fork", "spawn", "forkserver"):
        t = found[f"W5 {method} 200 MB time to first batch vs torch"]
        assert t["met"] and "0.100x torch's time (target <= 0.25x)" in t["shown"]
        assert f"W5 {method} 10 MB time to first batch vs torch" not in found  # the largest only
    assert "W5 fork 10 MB time to first batch, fresh process without torch (stoker)" not in found  # reference
    spawn = found["W5 spawn 10 MB time to first batch, fresh process without torch (stoker)"]
    assert spawn["met"] and spawn["value"] == 0.25 and "torch not imported (target < 0.3 s)" in spawn["shown"]
    w8 = found["W8 images 1 GB samples/s vs torch"]
    assert w8["met"] and "5.50x torch (target >= 5x)" in w8["shown"]
    one = found["W8 images 1 GB GB/s vs one-core memcpy"]
    assert one["met"] and one["value"] == pytest.approx(5500 * bench.IMAGE_BYTES / 1e9)  # 83 %
    two = found["W8 images 1 GB GB/s vs two-thread memcpy"]
    assert two["met"] is None and "of 3.0 GB/s (for information, no target)" in two["shown"]
    arena = found["W8 arena at steady state w=2 (stoker, reserved bytes / batch bytes)"]
    assert arena["met"] and arena["value"] == 6.0 and "(target <= window 4 + 2 = 6)" in arena["shown"]
    assert "6.0 MB = 6.00 batches of 1.00 MB (repetitions: 5.00 6.00)" in arena["shown"]
    assert found["W2 arena at steady state w=1 (stoker, reserved bytes / batch bytes)"]["met"]
    # no second ceiling: no INFO line
    assert "W8 images 1 GB GB/s vs two-thread memcpy" not in {t["target"] for t in bench.targets(rows, 2.0)}
    # torch imported in one run of the fresh process: flagged, and missed
    flagged = {t["target"]: t for t in bench.targets(_w5_w8_rows(torch_imported=1.0), 2.0)}
    spawn = flagged["W5 forkserver 10 MB time to first batch, fresh process without torch (stoker)"]
    assert not spawn["met"] and "FLAGGED: torch was imported in 1 of 3 runs" in spawn["shown"]


def test_table_and_chart_show_the_new_figures(tmp_path) -> None:
    rows = _w5_w8_rows(torch_imported=1.0)
    report = _report(rows) | {"arena": bench.arena_use(rows), "targets": bench.targets(rows, 10.0, 12.0)}
    report["machine"]["memcpy2_gbps"] = 12.0
    json.dumps(report)
    text = bench.table(report)
    assert "memcpy ceiling (one core): 10.0 GB/s; two threads at once: 12.0 GB/s" in text
    assert "W5 torch-free forkserver 10 MB" in text and "W5 forkserver 200 MB" in text
    assert "FLAGGED: torch imported in 1 of 3 runs" in text
    assert "W8 w=2       6.0 MB = 6.00 x 1.00 MB  (limit 6)" in text
    assert "INFO   W8 images 1 GB GB/s vs two-thread memcpy" in text
    assert "MET    W8 arena at steady state w=2" in text
    pytest.importorskip("matplotlib")
    fig = bench.figure(report)
    titles = [ax.get_title() for sub in fig.subfigs for ax in sub.axes]
    assert "W8" in titles and titles[-1] == "arena at steady state (stoker)"
    assert bench.chart(report, str(tmp_path / "b.png"))
