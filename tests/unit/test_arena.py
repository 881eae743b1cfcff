"""The shared-memory arena in one process: a worker-side writer and the main-side arena
talking over real socketpairs, with real memfd slots."""

from __future__ import annotations

import gc
import multiprocessing
import os
import warnings
import weakref
from collections import namedtuple
from typing import Any

import numpy as np
import pytest

from stoker._core import arena as arena_module
from stoker._core.arena import ARENA_LIMIT_ENV, Arena, ArenaLink, SlotOrder
from stoker._core.protocol import Done, Exhausted, Task
from stoker._data.collate import default_collate

Point = namedtuple("Point", "x y")


class Link:
    """One engine's arena link and one worker's writer over real socketpairs."""

    def __init__(self, arena: Arena | None = None) -> None:
        self.arena = arena if arena is not None else Arena()
        self.tasks_main, self.tasks_worker = multiprocessing.Pipe(duplex=True)
        self.results_main, self.results_worker = multiprocessing.Pipe(duplex=True)
        self.link = ArenaLink(self.arena, 1)
        self.writer = self.link.worker_side()
        self.next_id = 0
        self.orders: list[SlotOrder] = []

    def roundtrip(self, batch, collate=None):
        task_id = self.next_id
        self.next_id += 1
        self.link.send_request(0, self.tasks_main, Task(task_id, [task_id]))
        task = self.writer.recv_request(self.tasks_worker)
        self.orders.append(task.slot)
        with self.writer.around_fetch(task):
            if collate is not None:
                batch = collate(batch)
        self.writer.send_reply(self.results_worker, Done(task_id, batch))
        return self.link.recv_reply(0, self.results_main).payload

    def close(self) -> None:
        self.link.close()
        for conn in (self.tasks_main, self.tasks_worker, self.results_main, self.results_worker):
            conn.close()


@pytest.fixture(autouse=True)
def _arenas_close(monkeypatch: pytest.MonkeyPatch):
    """Each arena a test makes closes its slots' descriptors when the test ends, as it would
    once collected: the test's fixture values (which hold it) live until after the leak check."""
    made: list[weakref.ref[Arena]] = []  # weak: a test may watch an arena's own finalizer
    init = Arena.__init__

    def recording_init(self: Arena, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(Arena, "__init__", recording_init)
    yield
    for ref in made:
        arena = ref()
        if arena is not None:
            arena_module._close_fds(arena.slots)


@pytest.fixture
def link():
    made = Link()
    yield made.roundtrip, made.arena, made
    made.close()


def test_structure_values_and_types_survive(link):
    roundtrip, _, _ = link
    batch = {
        "image": np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
        "label": np.array([1, 2]),
        "name": ["a", "b"],
        "pair": Point(np.float32([1.5, 2.5]), "meta"),
        "empty": np.zeros((0, 3)),
        "strided": np.arange(20.0)[::2],
        "scalar": 7,
    }
    out = roundtrip(batch)
    assert out.keys() == batch.keys()
    np.testing.assert_array_equal(out["image"], batch["image"])
    assert out["image"].dtype == np.uint8 and out["label"].dtype == batch["label"].dtype
    assert isinstance(out["pair"], Point) and out["pair"].y == "meta"
    np.testing.assert_array_equal(out["strided"], batch["strided"])
    assert out["empty"].shape == (0, 3) and out["name"] == ["a", "b"] and out["scalar"] == 7
    assert out["image"].flags.writeable


def test_views_are_zero_copy_onto_one_slot(link):
    roundtrip, arena, _ = link
    out = roundtrip({"a": np.ones(1000), "b": np.zeros(10, np.int32)})
    owner_a, owner_b = out["a"].base, out["b"].base
    assert owner_a is owner_b  # both leaves are views of the slot's owner array
    assert len(arena.slots.maps) == 1


def test_slot_is_reused_only_after_the_batch_is_dropped(link):
    roundtrip, arena, _ = link
    first = roundtrip(np.full(100_000, 1.0))
    second = roundtrip(np.full(100_000, 2.0))  # first is still held: a second slot
    assert len(arena.slots.maps) == 2
    assert (first == 1.0).all() and (second == 2.0).all()
    del first
    gc.collect()
    third = roundtrip(np.full(100_000, 3.0))
    assert len(arena.slots.maps) == 2  # reused the released slot
    assert (second == 2.0).all() and (third == 3.0).all()


def test_kept_batches_are_never_overwritten(link):
    roundtrip, _, _ = link
    kept = [roundtrip(np.full((64, 64), float(i))) for i in range(20)]
    for i, batch in enumerate(kept):
        assert (batch == float(i)).all()


def test_growing_batch_moves_to_a_bigger_slot_and_retires_the_small_one(link):
    roundtrip, arena, made = link
    small = roundtrip(np.ones(1000))
    del small
    gc.collect()
    big = roundtrip(np.ones(1_000_000))
    assert (big == 1).all()
    assert len(arena.slots.maps) == 1
    assert len(made.writer.slots) == 1
    assert len(arena.slots.fds) == 1  # the retired slot's descriptor is closed
    assert next(iter(arena.slots.sizes.values())) >= big.nbytes


def test_torch_tensors_come_back_as_tensors_sharing_the_slot(link):
    torch = pytest.importorskip("torch")
    roundtrip, _, _ = link
    out = roundtrip({"x": torch.arange(12).reshape(3, 4), "b": torch.tensor([1.0], dtype=torch.bfloat16)})
    assert isinstance(out["x"], torch.Tensor) and out["x"].dtype == torch.int64
    assert torch.equal(out["x"], torch.arange(12).reshape(3, 4))
    assert out["b"].dtype == torch.bfloat16  # no numpy dtype: travels pickled, still right


def test_arena_limit_falls_back_to_pickling_with_one_warning(monkeypatch):
    monkeypatch.setenv(ARENA_LIMIT_ENV, "1000")
    made = Link(Arena(limit=1000))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            np.testing.assert_array_equal(made.roundtrip(np.arange(10_000)), np.arange(10_000))
    messages = [str(w.message) for w in caught if ARENA_LIMIT_ENV in str(w.message)]
    assert len(messages) == 1
    assert made.arena.slots.maps == {}
    made.close()


def test_non_batch_replies_release_their_slot(link):
    roundtrip, arena, made = link
    held = roundtrip(np.ones(100))
    del held
    gc.collect()
    made.link.send_request(0, made.tasks_main, Task(99, [99]))
    task = made.writer.recv_request(made.tasks_worker)
    slot = task.slot.use
    assert slot is not None
    with made.writer.around_fetch(task):
        pass
    made.writer.send_reply(made.results_worker, Exhausted(99))
    assert isinstance(made.link.recv_reply(0, made.results_main), Exhausted)
    assert arena.order(0, {slot}).use == slot  # back on the free list


def test_descriptors_kept_are_bounded_whatever_the_slots_and_batches(monkeypatch):
    monkeypatch.setattr("stoker._core.arena.fd_budget", lambda: 4)
    before = len(os.listdir("/proc/self/fd"))
    made = Link()  # four socket descriptors
    kept = [made.roundtrip(np.ones(10_000)) for _ in range(30)]
    assert len(made.arena.slots.maps) >= 30
    assert len(made.arena.slots.fds) == 4
    assert len(os.listdir("/proc/self/fd")) == before + 4 + 4
    del kept
    made.close()
    arena = made.arena
    del made
    del arena
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before  # the arena's finalizer closed them


def test_the_next_workers_reuse_the_slots_of_the_last_ones(link):
    """Non-persistent workers are new processes each epoch: they are handed the slots."""
    roundtrip, arena, first = link
    batch = roundtrip({"x": np.full((64, 64), 1.0)}, collate=None)
    slot_ids = set(arena.slots.maps)
    del batch
    gc.collect()
    first.close()
    second = Link(arena)  # a new engine: its worker maps nothing yet
    out = second.roundtrip([{"x": np.full(64, 2.0)}] * 64, collate=default_collate)
    order = second.orders[-1]
    assert order.use in slot_ids and order.attach  # the descriptor came with the task
    assert set(arena.slots.maps) == slot_ids  # no new slot, no new mapping in main
    assert (out["x"] == 2.0).all() and out["x"].shape == (64, 64)
    again = second.roundtrip([{"x": np.full(64, 3.0)}] * 64, collate=default_collate)
    assert not second.orders[-1].attach  # mapped once per process
    assert (again["x"] == 3.0).all() and (out["x"] == 2.0).all()
    second.close()


def test_a_worker_without_a_free_slot_makes_one_up_front_from_the_last_size(link):
    roundtrip, arena, made = link
    samples = [{"x": np.full(1000, 7.0)}] * 16
    held = [roundtrip(samples, collate=default_collate) for _ in range(3)]
    assert made.orders[0].size_hint == 0  # nothing seen yet: made at the batch's first array
    assert all(o.use is None and o.size_hint >= 16 * 1000 * 8 for o in made.orders[1:])
    assert all((h["x"] == 7.0).all() for h in held)
    assert len(arena.slots.maps) == 3


def test_slots_of_tasks_that_never_answered_are_free_after_close():
    made = Link()
    made.roundtrip(np.ones(1000))
    gc.collect()
    made.link.send_request(0, made.tasks_main, Task(50, [50]))  # the worker dies on it
    given = made.writer.recv_request(made.tasks_worker).slot.use
    assert given is not None and made.arena.order(0, {given}).use is None
    made.close()
    assert made.arena.order(0, {given}).use == given


def test_the_first_batch_is_collated_straight_into_a_slot_made_for_it(link):
    """No size is known before the first batch: the slot is made at the batch's first array,
    so the batch is written once, where it crosses, not collated aside and copied."""
    roundtrip, arena, made = link
    seen = []

    def collate(samples):
        out = default_collate(samples)
        writer = made.writer
        seen.append(writer.current is not None and writer.current.holds(out["x"]) is not None)
        return out

    out = roundtrip([{"x": np.full(1000, 5.0), "y": 1}] * 16, collate=collate)
    assert made.orders[0].use is None and made.orders[0].size_hint == 0
    assert seen == [True]
    assert (out["x"] == 5.0).all() and out["x"].shape == (16, 1000) and list(out["y"]) == [1] * 16
    assert len(arena.slots.maps) == 1


def test_a_slot_given_with_a_task_is_mapped_when_the_task_is_served():
    """A worker reads its next tasks ahead: the slots that come with them are mapped (their
    page tables filled) only when each task is served, so the task at hand waits for none."""
    made = Link()
    batch = made.roundtrip({"x": np.full((64, 64), 1.0)})
    slot_ids = set(made.arena.slots.maps)
    del batch
    gc.collect()
    arena = made.arena
    made.close()
    second = Link(arena)
    second.link.send_request(0, second.tasks_main, Task(0, [0]))
    task = second.writer.recv_request(second.tasks_worker)
    assert task.slot.attach and task.slot.use in slot_ids
    assert task.slot.use not in second.writer.slots and task.slot.use in second.writer.pending
    with second.writer.around_fetch(task):
        assert task.slot.use in second.writer.slots and not second.writer.pending
        out = default_collate([{"x": np.full(64, 2.0)}] * 64)
    second.writer.send_reply(second.results_worker, Done(0, out))
    got = second.link.recv_reply(0, second.results_main).payload
    assert (got["x"] == 2.0).all()
    second.close()
