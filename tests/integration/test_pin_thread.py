"""pin_memory=True with workers: batches are pinned on the pin thread, in order, errors
surface at their batch, and the thread stops with the iterator. There is no accelerator
here, so the pin step is a test double standing in for `pin_batch`."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import stoker
from stoker._core import iterator as _iterator


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


def test_no_accelerator_keeps_torchs_warning_and_starts_no_thread() -> None:
    pytest.importorskip("torch")
    loader = stoker.DataLoader(Range(), batch_size=2, num_workers=2, pin_memory=True)
    with pytest.warns(UserWarning, match="no accelerator is found"):
        it = iter(loader)
    assert not pin_threads()
    assert [int(b[0, 0]) for b in it] == list(range(0, 40, 2))
