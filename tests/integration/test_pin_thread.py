"""pin_memory=True with workers: batches are pinned on the pin thread, in order, errors
surface at their batch, and the thread stops with the iterator; the workers fork before it
starts (also when "auto" moves an epoch to workers); Ctrl-C while `next()` waits on the pin
thread loses no batch. There is no accelerator here, so the pin step is a test double
standing in for `pin_batch`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import stoker
from stoker._core import auto
from stoker._core import iterator as _iterator

SRC = Path(__file__).resolve().parents[2] / "src"


class Range(stoker.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(2, i)


class RecordingPin:
    """Marks each batch as pinned and records the thread that did it."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.threads: set[int] = set()
        self.fail_at = fail_at

    def __call__(self, batch: np.ndarray) -> tuple[str, np.ndarray]:
        self.threads.add(threading.get_ident())
        if self.fail_at is not None and int(batch[0, 0]) == self.fail_at:
            raise MemoryError("planted pin failure")
        return ("pinned", batch)


@pytest.fixture
def pin_double(monkeypatch):
    double = RecordingPin()
    monkeypatch.setattr(_iterator, "pin_function", lambda device, stacklevel: double)
    monkeypatch.setattr(_iterator, "device_setup", lambda: None)
    return double


def pin_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stoker-pin")]


def test_batches_are_pinned_off_the_consumer_thread_in_order(pin_double, start_method) -> None:
    loader = stoker.DataLoader(
        Range(), batch_size=2, num_workers=2, pin_memory=True, multiprocessing_context=start_method
    )
    got = list(loader)
    assert [tag for tag, _ in got] == ["pinned"] * 20
    assert [int(b[0, 0]) for _, b in got] == list(range(0, 40, 2))
    assert pin_double.threads and threading.get_ident() not in pin_double.threads
    assert not pin_threads(), "the pin thread must stop with the exhausted iterator"


def test_a_pin_error_surfaces_at_its_batch_and_later_batches_still_come(pin_double) -> None:
    pin_double.fail_at = 10  # batch 5
    it = iter(stoker.DataLoader(Range(), batch_size=2, num_workers=2, pin_memory=True))
    before = [int(next(it)[1][0, 0]) for _ in range(5)]
    assert before == [0, 2, 4, 6, 8]
    with pytest.raises(MemoryError, match="planted pin failure"):
        next(it)
    assert int(next(it)[1][0, 0]) == 12  # a failed pin, like a failed sample, ends nothing
    it.close()
    assert not pin_threads()


def test_dropping_the_iterator_half_way_stops_the_pin_thread(pin_double) -> None:
    it = iter(stoker.DataLoader(Range(), batch_size=1, num_workers=2, pin_memory=True, prefetch_factor=4))
    next(it)
    assert pin_threads()
    del it
    import gc

    gc.collect()
    for thread in pin_threads():
        thread.join(2)
    assert not pin_threads()


def test_persistent_workers_abandoned_epoch_leaves_nothing_pinned_behind(pin_double) -> None:
    # a sampler with set_epoch: no next-epoch prefetch, so nothing is pending after an epoch
    sampler = stoker.DistributedSampler(Range(), num_replicas=1, rank=0, shuffle=False)
    loader = stoker.DataLoader(
        Range(), batch_size=2, num_workers=2, pin_memory=True, persistent_workers=True, sampler=sampler
    )
    first = iter(loader)
    next(first)
    second = [int(b[0, 0]) for _, b in iter(loader)]  # the first epoch is abandoned half-way
    assert second == list(range(0, 40, 2))
    assert first._pinner is not None and first._pinner.pending == 0
    first.close()


@pytest.mark.parametrize("pin_memory", [True, "born"])
def test_no_accelerator_keeps_torchs_warning_and_starts_no_thread(pin_memory) -> None:
    torch = pytest.importorskip("torch")
    if torch.accelerator.is_available():
        pytest.skip("a machine without an accelerator")
    loader = stoker.DataLoader(Range(), batch_size=2, num_workers=2, pin_memory=pin_memory)
    with pytest.warns(UserWarning, match="no accelerator is found"):
        it = iter(loader)
    assert not pin_threads()
    assert [int(b[0, 0]) for b in it] == list(range(0, 40, 2))


# ------------------------------------------------------------------ what starts when
_threads_at_fork: list[list[str]] | None = None  # set while a test records


def _record_fork() -> None:
    if _threads_at_fork is not None:
        _threads_at_fork.append([t.name for t in threading.enumerate()])


os.register_at_fork(before=_record_fork)  # cannot be unregistered: it records only when asked


@pytest.fixture
def forks():
    """The names of the threads alive in this process at each fork made while the test runs."""
    global _threads_at_fork
    _threads_at_fork = []
    try:
        yield _threads_at_fork
    finally:
        _threads_at_fork = None


def loaders_threads(names: list[str]) -> list[str]:
    """stoker's threads among `names`, less the relay's: a process whose obstore made a request
    (an earlier test's) serves its forked children from a thread of its own (`_shards.relay`);
    it belongs to the process, not to a loader, holds no lock while it waits in accept(), and a
    forked child closes its copy of the socket."""
    return [name for name in names if name.startswith("stoker") and not name.startswith("stoker-relay")]


def test_workers_fork_before_the_pin_thread_starts(pin_double, forks) -> None:
    loader = stoker.DataLoader(Range(), batch_size=2, num_workers=2, pin_memory=True, multiprocessing_context="fork")
    it = iter(loader)
    assert len(forks) == 2  # the two workers
    assert not [name for names in forks for name in loaders_threads(names)]
    assert pin_threads()  # and it runs from then on
    assert [int(b[0, 0]) for _, b in it] == list(range(0, 40, 2))


def test_auto_moves_the_epoch_to_workers_forked_before_the_pin_thread(pin_double, forks, monkeypatch) -> None:
    monkeypatch.setattr(auto.Head, "done", lambda self: len(self.times) >= 2)
    monkeypatch.setattr(auto.Head, "decide", lambda self: auto.Choice(2, 2, "num_workers=2 (the test's)"))
    loader = stoker.DataLoader(
        Range(), batch_size=2, num_workers="auto", pin_memory=True, multiprocessing_context="fork"
    )
    got = list(loader)
    assert all(isinstance(b, tuple) and b[0] == "pinned" for b in got)  # also the batch at the move
    assert [int(b[0, 0]) for _, b in got] == list(range(0, 40, 2)) and loader.num_workers == 2
    assert len(forks) == 2  # the workers "auto" chose, forked after the inline head
    assert not [name for names in forks for name in loaders_threads(names)]


# ----------------------------------------------------------------------------- Ctrl-C
CTRL_C = """
import signal

# Python's Ctrl-C, whatever this child inherited: a shell's background job starts its children
# with SIGINT ignored, and then _thread.interrupt_main() does nothing
signal.signal(signal.SIGINT, signal.default_int_handler)

import _thread, json, sys, threading, time
import numpy as np
import stoker
from stoker._core import iterator

SLOW = 10  # the first sample of the batch whose pinning Ctrl-C interrupts the wait for
BOUND_S = 60  # a bound on a hang, not on speed
interrupted = []
caught = threading.Event()  # set by the main thread once it has the KeyboardInterrupt

class Range(stoker.Dataset):
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return np.full(2, i)

def main_thread_waits_on_the_pin_thread():
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == "_wait_ready":  # PinThread.wait, under next()
            return True
        frame = frame.f_back
    return False


def slow_pin(batch):
    if int(batch[0, 0]) == SLOW and not interrupted:
        interrupted.append(1)
        deadline = time.monotonic() + BOUND_S
        while not main_thread_waits_on_the_pin_thread():
            assert time.monotonic() < deadline, "next() never waited for the pin thread"
            time.sleep(0.005)
        _thread.interrupt_main()
        # the batch stays unpinned until the interrupted next() has returned to the caller
        assert caught.wait(BOUND_S), "the KeyboardInterrupt never reached the caller"
    return ("pinned", batch)

iterator.pin_function = lambda device, stacklevel: slow_pin
iterator.device_setup = lambda: None

def first(batch):
    tag, array = batch
    assert tag == "pinned"
    return int(array[0, 0])

loader = stoker.DataLoader(Range(), batch_size=2, num_workers=1, pin_memory=True)
it = iter(loader)
got, interrupts = [], 0
while True:
    try:
        batch = next(it)
    except StopIteration:
        break
    except KeyboardInterrupt:
        caught.set()
        interrupts += 1
        if sys.argv[1] == "resume":  # the state saved now resumes at the interrupted batch
            state = loader.state_dict()
            it.close()
            again = stoker.DataLoader(Range(), batch_size=2, num_workers=1, pin_memory=True)
            again.load_state_dict(state)
            got += [first(b) for b in again]
            break
        continue
    got.append(first(batch))
print(json.dumps({"got": got, "interrupts": interrupts}))
"""


@pytest.mark.parametrize("then", ["next", "resume"])
def test_ctrl_c_while_waiting_on_the_pin_thread_keeps_the_batch(then: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CTRL_C), then],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["interrupts"] == 1
    assert result["got"] == list(range(0, 40, 2))  # every batch once, in order
