"""The pure pieces of `stoker bench`: the steady-state window, rates and main-process CPU per
batch over it, W7's epoch sizes and dataset, the environment it records, and the W7 targets."""

from __future__ import annotations

import pytest

from stoker._tools import bench as bench


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
            bench.asdict(r) | {"median": r.median, "gbps": r.gbps(), "main_us_per_batch": r.main_us_per_batch}
            for r in rows
        ],
        "w3_scaling": [],
        "targets": list(found.values()),
        "machine": bench.environment() | {"memcpy_gbps": 10.0},
    }
    text = bench.table(report)
    assert "main µs/batch" in text and "W7 b256" in text and "W7 b64" in text
    assert "environment (as found" in text
