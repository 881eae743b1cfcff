"""Statistics in-process: a worker's timing on each Done, array bytes, the recorder."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from stoker._core import fetch, stats, worker
from stoker._core.protocol import Done, Failed, Stop, Task
from stoker._core.stats import LoaderStats, Recorder, array_bytes
from stoker._core.worker import WorkerConfig, run_worker


class Clock:
    """The worker's clock, advanced only by what the test says took time: the timings it
    reports are then exact, whatever else the machine is doing."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    fake = Clock()
    monkeypatch.setattr(fetch, "clock", fake)
    monkeypatch.setattr(worker, "clock", fake)
    monkeypatch.setattr(stats, "clock", fake)
    yield fake


class Slow:
    """Fetching takes 2 ms per sample; collating takes 3 ms per batch (of `clock`'s time)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            raise KeyError(i)
        self.clock.advance(0.002)
        return np.zeros(5, np.float32)

    def __len__(self) -> int:
        return 100


def config(timed: bool, clock: Clock) -> WorkerConfig:
    def slow_collate(samples: list) -> list:
        clock.advance(0.003)
        return list(samples)

    return WorkerConfig(
        worker_id=0,
        num_workers=1,
        base_seed=1,
        dataset=Slow(clock),
        dataset_kind="map",
        auto_collation=True,
        collate_fn=slow_collate,
        drop_last=False,
        worker_init_fn=None,
        thread=True,
        timed=timed,
    )


def serve(timed: bool, tasks: list[Task], clock: Clock, send_s: float = 0.0) -> list:
    inbox: list = [*tasks, Stop()]
    out: list = []

    def send(reply: object) -> None:
        clock.advance(send_s)
        out.append(reply)

    run_worker(config(timed, clock), lambda timeout: inbox.pop(0), send)
    return out


def test_timed_worker_reports_samples_bytes_fetch_collate_and_busy(clock: Clock) -> None:
    (done,) = serve(True, [Task(0, [1, 2, 3])], clock)
    samples, nbytes, fetch_s, collate_s, busy_s = done.work
    assert (samples, nbytes) == (3, 3 * 5 * 4)
    assert fetch_s == pytest.approx(0.006)
    assert collate_s == pytest.approx(0.003)
    assert busy_s == pytest.approx(fetch_s + collate_s)


def test_busy_carries_the_previous_send_and_failed_tasks(clock: Clock) -> None:
    replies = serve(True, [Task(0, [1]), Task(1, [-1]), Task(2, [2])], clock, send_s=0.01)
    first, failed, last = replies
    assert isinstance(failed, Failed)
    # the first reply's busy time is its own fetch and collate; the third's also holds the two
    # sends before it (the failed task's fetch raised at once: it took no time)
    assert first.work[4] == pytest.approx(first.work[2] + first.work[3]) == pytest.approx(0.005)
    assert last.work[4] == pytest.approx(0.02 + last.work[2] + last.work[3]) == pytest.approx(0.025)


def test_untimed_worker_sends_no_work(clock: Clock) -> None:
    (done,) = serve(False, [Task(0, [1])], clock)
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


def test_recorder_totals_and_snapshot(clock: Clock) -> None:
    recorder = Recorder(epoch=3, num_workers=2, prefetch_factor=2, thread_pool=False, pids=[11, 12])
    clock.advance(1.0)
    recorder.received(0, (4, 100, 0.1, 0.02, 0.15))
    recorder.received(1, (4, 100, 0.2, 0.03, 0.25))
    recorder.delivered((4, 100, 0.1, 0.02, 0.15))
    recorder.wait_s = 0.25
    recorder.restarts[1] = 1
    recorder.stop()
    snapshot = recorder.snapshot(ready=1)
    assert (snapshot.epoch, snapshot.batches, snapshot.samples, snapshot.bytes, snapshot.ready) == (3, 1, 4, 100, 1)
    assert snapshot.elapsed_s == pytest.approx(1.0)
    assert snapshot.readiness == pytest.approx(0.75)
    assert [(w.pid, w.batches, w.busy_s, w.restarts) for w in snapshot.workers] == [(11, 1, 0.15, 0), (12, 1, 0.25, 1)]
    assert snapshot.workers_busy == pytest.approx(0.2)
    clock.advance(5.0)
    assert recorder.snapshot(0).elapsed_s == snapshot.elapsed_s  # stopped: the clock no longer runs
    line = str(snapshot)
    assert line.startswith("epoch 3: 1 batches, 4 samples") and "1 restarts" in line


def test_leave_next_stops_the_clock_after_the_last_call_returns(clock: Clock) -> None:
    recorder = Recorder(0, 0, None, False, [1])
    clock.advance(0.5)
    entered = clock()
    recorder.ending = True
    clock.advance(0.01)
    recorder.leave_next(entered)
    assert recorder.stopped == clock()
    assert recorder.wait_s == pytest.approx(0.01) and recorder.stopped - recorder.start == pytest.approx(0.51)


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
