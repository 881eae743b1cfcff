"""The shared-memory arena in one process: a worker-side writer and the main-side arena
talking over a real socketpair, with real memfd slots."""

from __future__ import annotations

import gc
import multiprocessing
import os
import warnings
from collections import namedtuple

import numpy as np
import pytest

from stoker._arena import ARENA_LIMIT_ENV, Arena, ArenaTransport
from stoker._protocol import Done, Exhausted

Point = namedtuple("Point", "x y")


@pytest.fixture
def link():
    main_end, worker_end = multiprocessing.Pipe(duplex=True)
    transport = ArenaTransport()
    arena = Arena(1)
    assigned: dict[int, int | None] = {}
    task = [0]

    def roundtrip(batch, collate_into=True):
        task_id = task[0]
        task[0] += 1
        slot = arena.assign(0)
        assigned[task_id] = slot
        writer = transport.writer()
        with writer.collating_into(slot):
            pass
        transport.send(worker_end, Done(task_id, batch))
        return arena.receive(0, main_end, assigned).payload

    yield roundtrip, arena, transport
    main_end.close()
    worker_end.close()


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
    assert len(arena.pools[0].maps) == 1


def test_slot_is_reused_only_after_the_batch_is_dropped(link):
    roundtrip, arena, _ = link
    first = roundtrip(np.full(100_000, 1.0))
    second = roundtrip(np.full(100_000, 2.0))  # first is still held: a second slot
    assert len(arena.pools[0].maps) == 2
    assert (first == 1.0).all() and (second == 2.0).all()
    del first
    gc.collect()
    third = roundtrip(np.full(100_000, 3.0))
    assert len(arena.pools[0].maps) == 2  # reused the released slot
    assert (second == 2.0).all() and (third == 3.0).all()


def test_kept_batches_are_never_overwritten(link):
    roundtrip, _, _ = link
    kept = [roundtrip(np.full((64, 64), float(i))) for i in range(20)]
    for i, batch in enumerate(kept):
        assert (batch == float(i)).all()


def test_growing_batch_moves_to_a_bigger_slot_and_retires_the_small_one(link):
    roundtrip, arena, transport = link
    small = roundtrip(np.ones(1000))
    del small
    gc.collect()
    big = roundtrip(np.ones(1_000_000))
    assert (big == 1).all()
    assert len(arena.pools[0].maps) == 1
    assert len(transport.writer().slots) == 1
    assert next(iter(arena.pools[0].sizes.values())) >= big.nbytes


def test_torch_tensors_come_back_as_tensors_sharing_the_slot(link):
    torch = pytest.importorskip("torch")
    roundtrip, _, _ = link
    out = roundtrip({"x": torch.arange(12).reshape(3, 4), "b": torch.tensor([1.0], dtype=torch.bfloat16)})
    assert isinstance(out["x"], torch.Tensor) and out["x"].dtype == torch.int64
    assert torch.equal(out["x"], torch.arange(12).reshape(3, 4))
    assert out["b"].dtype == torch.bfloat16  # no numpy dtype: travels pickled, still right


def test_arena_limit_falls_back_to_pickling_with_one_warning(link, monkeypatch):
    monkeypatch.setenv(ARENA_LIMIT_ENV, "1000")
    main_end, worker_end = multiprocessing.Pipe(duplex=True)
    transport = ArenaTransport(limit=1000)
    arena = Arena(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for task_id in range(3):
            transport.send(worker_end, Done(task_id, np.arange(10_000)))
            out = arena.receive(0, main_end, {}).payload
            np.testing.assert_array_equal(out, np.arange(10_000))
    messages = [str(w.message) for w in caught if ARENA_LIMIT_ENV in str(w.message)]
    assert len(messages) == 1
    main_end.close()
    worker_end.close()


def test_non_batch_replies_release_their_slot(link):
    roundtrip, arena, transport = link
    held = roundtrip(np.ones(100))
    del held
    gc.collect()
    main_end, worker_end = multiprocessing.Pipe(duplex=True)
    slot = arena.assign(0)
    assert slot is not None
    assigned = {99: slot}
    transport.send(worker_end, Exhausted(99))
    assert isinstance(arena.receive(0, main_end, assigned), Exhausted)
    assert arena.assign(0) == slot  # back on the free list
    main_end.close()
    worker_end.close()


def test_no_file_descriptor_is_kept_per_slot_or_batch(link):
    roundtrip, arena, _ = link
    before = len(os.listdir("/proc/self/fd"))
    kept = [roundtrip(np.ones(10_000)) for _ in range(30)]
    assert len(arena.pools[0].maps) >= 30
    assert len(os.listdir("/proc/self/fd")) == before
    del kept
