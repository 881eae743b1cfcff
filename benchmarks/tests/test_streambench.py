"""The streaming benchmark's harness (benchmarks/stoker_bench/streambench.py) at a tiny size:
64 samples, the stoker and webdataset rows, through the proxy without delay or cap."""

import io
import json
import math

import numpy as np
import pytest

from stoker_bench import streambench


def test_decode_gives_224_rgb_uint8_from_a_jpeg():
    Image = pytest.importorskip("PIL.Image")
    buffer = io.BytesIO()
    Image.fromarray(np.full((375, 500, 3), 200, np.uint8)).save(buffer, "JPEG")
    pixels, label = streambench.decode_pair(buffer.getvalue(), b"7")
    assert pixels.shape == (224, 224, 3) and pixels.dtype == np.uint8
    assert abs(int(pixels.mean()) - 200) <= 2
    assert label == 7
    assert streambench.io_pair(memoryview(b"abc"), "3") == (b"abc", 3)


def test_ratios_take_the_best_other_library_per_column():
    rows = [
        {"library": "stoker", "mode": "io", "epoch1_samples_per_s": 300.0, "requests": 10},
        {"library": "a", "mode": "io", "epoch1_samples_per_s": 100.0, "requests": 40},
        {"library": "b", "mode": "io", "epoch1_samples_per_s": 200.0, "requests": 20},
        {"library": "c", "mode": "io", "error": "broken"},
    ]
    io_ratios = streambench.ratios(rows)["io"]
    assert io_ratios["epoch1_samples_per_s"] == {"ratio": 1.5, "best": "b"}
    assert io_ratios["requests"] == {"ratio": 0.5, "best": "b"}
    assert io_ratios["cpu_ms_per_sample"] == {"ratio": None, "best": None}


@pytest.mark.timeout(90)
def test_a_tiny_run_gives_a_well_formed_row_per_library_and_mode():
    for module in ("moto", "webdataset", "s3fs", "torch", "psutil", "PIL", "skimage"):
        pytest.importorskip(module)
    try:
        import stoker.shards  # noqa: F401
    except ImportError as error:
        pytest.skip(f"the stoker rows cannot run yet: stoker.shards does not import ({error})")
    report = streambench.run(
        samples=64,
        libraries=("stoker", "webdataset"),
        first_byte_s=0.0,
        bandwidth=None,
        row_timeout_s=60,
    )
    json.dumps(report)  # what the script writes to build/streaming.json
    rows = {(row["library"], row["mode"]): row for row in report["rows"]}
    assert sorted(rows) == [("stoker", "decode"), ("stoker", "io"), ("webdataset", "decode"), ("webdataset", "io")]
    for (library, mode), row in rows.items():
        assert "error" not in row, f"{library} {mode}: {row['error']}"
        assert row["note"] == "", f"{library} {mode}: {row['note']}"
        for key, _, _ in streambench.COLUMNS:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] >= 0, (
                library,
                mode,
                key,
            )
        assert row["epoch1_samples_per_s"] > 0 and row["requests"] > 0
        epochs = row["raw"]["epochs"]
        assert [e["samples"] for e in epochs] == [64, 64]
        if mode == "io":  # every sample's JPEG bytes reached a batch, in each epoch
            assert [e["payload_bytes"] for e in epochs] == [report["jpeg_bytes"]] * 2
        else:
            assert [e["payload_bytes"] for e in epochs] == [64 * 224 * 224 * 3] * 2
    # stoker keeps its shards in its cache, so epoch 2 downloads nothing; webdataset streams
    # each epoch anew
    for mode in ("io", "decode"):
        stoker_epochs = rows["stoker", mode]["raw"]["epochs"]
        assert stoker_epochs[0]["bytes"] > 0 and stoker_epochs[1]["bytes"] == 0
        assert rows["stoker", mode]["peak_cache_mb"] > 0
        assert rows["webdataset", mode]["downloaded_over_dataset"] > 1.5
    assert set(report["ratios"]) == {"io", "decode"}
    text = streambench.table(report)
    assert text.count("\n| stoker") == 2 and text.count("\n| webdataset") == 2
    assert "first byte 0.0 s, bandwidth none" in text


@pytest.mark.timeout(120)
def test_the_cache_sweep_counts_one_download_a_shard_with_a_cap_of_two_windows():
    pytest.importorskip("torch")
    from stoker_bench import cachesweep

    # shards of about 19 samples: the batches in flight (2 workers x prefetch 2 x 4 samples)
    # are fewer than a window's samples, as the guide's promise requires. With shards of 5
    # samples they span two windows, and a starved worker's batch keeps a third in use.
    report = cachesweep.sweep(
        shards=6,
        shard_mb=0.4,
        window_shards=2,
        caps=(2.0,),
        settings=(("file", 1),),
        epochs=1,
        batch=4,
        sample_ms=0,
    )
    (row,) = report["rows"]
    assert "error" not in row, row
    assert row["shards"] == 6 and row["downloads"] == [6] and row["per_shard_per_epoch"] == [1.0]
    assert "| file | 1 x 2 | 2 | 1.00 |" in cachesweep.table(report)
