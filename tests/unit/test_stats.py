"""Statistics in-process: a worker's timing on each Done, array bytes, the recorder."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from stoker._core.protocol import Done, Failed, Stop, Task
from stoker._core.stats import LoaderStats, Recorder, array_bytes
from stoker._core.worker import WorkerConfig, run_worker


class Slow:
    """Fetching sleeps 2 ms per sample; collating sleeps 3 ms per batch."""

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            raise KeyError(i)
        time.sleep(0.002)
        return np.zeros(5, np.float32)

    def __len__(self) -> int:
        return 100


def slow_collate(samples: list) -> list:
    time.sleep(0.003)
    return list(samples)


def config(timed: bool) -> WorkerConfig:
    return WorkerConfig(
        worker_id=0, num_workers=1, base_seed=1, dataset=Slow(), dataset_kind="map",
        auto_collation=True, collate_fn=slow_collate, drop_last=False, worker_init_fn=None,
        thread=True, timed=timed,
    )


def serve(timed: bool, tasks: list[Task], send_s: float = 0.0) -> list:
    inbox: list = [*tasks, Stop()]
    out: list = []

    def send(reply: object) -> None:
        time.sleep(send_s)
        out.append(reply)

    run_worker(config(timed), lambda timeout: inbox.pop(0), send)
    return out


def test_timed_worker_reports_samples_bytes_fetch_collate_and_busy() -> None:
    (done,) = serve(True, [Task(0, [1, 2, 3])])
    samples, nbytes, fetch_s, collate_s, busy_s = done.work
    assert (samples, nbytes) == (3, 3 * 5 * 4)
    assert 0.006 <= fetch_s < 1.0
    assert 0.003 <= collate_s < 1.0
    assert fetch_s + collate_s <= busy_s


def test_busy_carries_the_previous_send_and_failed_tasks() -> None:
    replies = serve(True, [Task(0, [1]), Task(1, [-1]), Task(2, [2])], send_s=0.01)
    first, failed, last = replies
    assert isinstance(failed, Failed)
    # the third reply's busy time holds the two sends before it and the failed task's fetch
    assert last.work[4] >= 0.02 + last.work[2] + last.work[3]
    assert first.work[4] < 0.01 + first.work[2] + first.work[3]


def test_untimed_worker_sends_no_work() -> None:
    (done,) = serve(False, [Task(0, [1])])
    assert isinstance(done, Done) and done.work is None


def test_array_bytes_walks_containers() -> None:
    torch = pytest.importorskip("torch")
    batch = {
        "a": np.zeros((2, 3), np.float64),
        "b": [np.zeros(4, np.uint8), (torch.zeros(5, dtype=torch.int32), "text", 7)],
        "c": None,
    }
    assert array_bytes(batch) == 48 + 4 + 20
    assert array_bytes(np.zeros(3)[::2]) == 16  # a view counts its own elements
    assert array_bytes("x" * 100) == 0 and array_bytes(b"123") == 0


def test_recorder_totals_and_snapshot() -> None:
    recorder = Recorder(epoch=3, num_workers=2, prefetch_factor=2, thread_pool=False, pids=[11, 12])
    recorder.start -= 1.0  # began a second ago
    recorder.received(0, (4, 100, 0.1, 0.02, 0.15))
    recorder.received(1, (4, 100, 0.2, 0.03, 0.25))
    recorder.delivered((4, 100, 0.1, 0.02, 0.15))
    recorder.wait_s = 0.25
    recorder.restarts[1] = 1
    recorder.stop()
    stats = recorder.snapshot(ready=1)
    assert (stats.epoch, stats.batches, stats.samples, stats.bytes, stats.ready) == (3, 1, 4, 100, 1)
    assert stats.elapsed_s == pytest.approx(1.0, abs=0.05)
    assert stats.readiness == pytest.approx(1 - 0.25 / stats.elapsed_s)
    assert [(w.pid, w.batches, w.busy_s, w.restarts) for w in stats.workers] == [(11, 1, 0.15, 0), (12, 1, 0.25, 1)]
    assert stats.workers_busy == pytest.approx(0.2 / stats.elapsed_s)
    assert recorder.snapshot(0).elapsed_s == stats.elapsed_s  # stopped: the clock no longer runs
    line = str(stats)
    assert line.startswith("epoch 3: 1 batches, 4 samples") and "1 restarts" in line


def test_leave_next_stops_the_clock_after_the_last_call_returns() -> None:
    recorder = Recorder(0, 0, None, False, [1])
    entered = time.perf_counter()
    recorder.ending = True
    time.sleep(0.01)
    recorder.leave_next(entered)
    assert recorder.stopped is not None
    assert recorder.wait_s >= 0.01 and recorder.stopped - recorder.start >= recorder.wait_s


def test_loader_stats_is_frozen_and_its_dict_is_plain() -> None:
    stats = Recorder(0, 1, 2, True, [None]).snapshot(0)
    assert isinstance(stats, LoaderStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.batches = 3  # type: ignore[misc]
    plain = stats.as_dict()
    assert plain["workers"] == [
        {"worker": 0, "pid": None, "batches": 0, "busy_s": 0.0, "fetch_s": 0.0, "collate_s": 0.0, "restarts": 0}
    ]
    assert plain["samples_per_s"] == 0.0
