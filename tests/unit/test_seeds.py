"""Per-sample seeds (`stoker.sample_seed` / `stoker.sample_rng`) and `seed_each_batch`, in-process."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest

import stoker
from stoker import Dataset, IterableDataset, StackDataset, Subset
from stoker._core import worker as worker_module
from stoker._core.fetch import IterableFetcher, MapFetcher, fetches_batches
from stoker._core.protocol import Done, Stop, Task
from stoker._core.seeding import (
    BATCH,
    GLOBAL,
    ITEM,
    SAMPLE,
    FetchScope,
    current_scope,
    enter,
    leave,
    seed_batch_globals,
    seed_sequence,
)
from stoker._core.worker import WorkerConfig, run_worker


def seed_of(tag: int, base: int, epoch: int, key: object) -> int:
    return int(seed_sequence(tag, base, epoch, key).generate_state(1, np.uint64)[0])


def identity(batch):
    return batch


def optional_torch() -> Any:
    """torch, or None where it is not installed (the global RNGs are then Python's and
    numpy's: stoker seeds torch's only when torch is there)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


@pytest.fixture
def global_rngs():
    """Put the test process's global RNGs back as they were."""
    torch = optional_torch()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state() if torch else None
    yield
    random.setstate(states[0])
    np.random.set_state(states[1])
    if torch:
        torch.set_rng_state(states[2])


# ---------------------------------------------------------------- derivation


def test_same_inputs_give_the_same_seed_and_each_input_matters() -> None:
    reference = seed_of(SAMPLE, 7, 2, 5)
    assert seed_of(SAMPLE, 7, 2, 5) == reference
    assert 0 <= reference < 2**64
    others = {
        "index": seed_of(SAMPLE, 7, 2, 6),
        "epoch": seed_of(SAMPLE, 7, 3, 5),
        "base seed": seed_of(SAMPLE, 8, 2, 5),
        "tag": seed_of(BATCH, 7, 2, 5),
    }
    for what, seed in others.items():
        assert seed != reference, f"changing the {what} left the seed unchanged"


def test_keys_are_encoded_without_collisions() -> None:
    keys = [0, 1, -1, 5, 2**32, 2**32 + 5, -(2**32) - 5, 2**64, "a", "0", b"a", (), (0,), (0, 0), ((0,),), (5, 1)]
    seeds = [seed_of(ITEM, 3, 0, key) for key in keys]
    assert len(set(seeds)) == len(keys)
    # words carried over from one field to the next must not meet: base 2**32+5 spans two words
    fields = [(2**32 + 5, 0, 7), (5, 1, 7), (5, 2**32, 7), (5, 0, 2**32 + 7)]
    assert len({seed_of(SAMPLE, *f) for f in fields}) == len(fields)
    # numpy integers and bools index as the ints they are
    assert seed_of(SAMPLE, 3, 0, np.int64(5)) == seed_of(SAMPLE, 3, 0, 5)


def test_an_index_that_is_not_an_int_str_bytes_or_tuple_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="float"):
        seed_of(SAMPLE, 0, 0, 1.5)


def test_outside_a_fetch_both_raise_saying_where_they_may_be_called() -> None:
    assert current_scope() is None
    for function in (stoker.sample_seed, stoker.sample_rng):
        with pytest.raises(RuntimeError, match=rf"stoker\.{function.__name__}\(\) can only be called") as caught:
            function()
        assert "__getitem__" in str(caught.value) and "num_workers=0" in str(caught.value)


def test_sample_rng_continues_one_stream_within_a_sample_and_restarts_for_the_next() -> None:
    scope = FetchScope(11, 1, SAMPLE, 4)
    previous = enter(scope)
    try:
        first = stoker.sample_rng()
        assert stoker.sample_rng() is first
        drawn = [first.random(), stoker.sample_rng().random()]
        fresh = np.random.Generator(np.random.PCG64(seed_sequence(SAMPLE, 11, 1, 4)))
        assert drawn == [fresh.random(), fresh.random()]
        assert stoker.sample_seed() == stoker.sample_seed() == seed_of(SAMPLE, 11, 1, 4)
        scope.at(SAMPLE, 5)
        assert stoker.sample_rng() is not first
        assert stoker.sample_seed() == seed_of(SAMPLE, 11, 1, 5)
    finally:
        leave(previous)
    assert current_scope() is None


def test_the_scope_is_per_thread() -> None:
    barrier = threading.Barrier(2)
    seen: dict[int, list[int]] = {}

    def fetch(key: int) -> None:
        previous = enter(FetchScope(0, 0, SAMPLE, key))
        try:
            barrier.wait(5)  # both threads are inside their fetch now
            seen[key] = [stoker.sample_seed()]
            barrier.wait(5)
            seen[key].append(stoker.sample_seed())
        finally:
            leave(previous)

    threads = [threading.Thread(target=fetch, args=(key,)) for key in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == {key: [seed_of(SAMPLE, 0, 0, key)] * 2 for key in (1, 2)}
    assert current_scope() is None


# ---------------------------------------------------------------- the fetchers


class Recorder(Dataset):
    """Records the seed each sample sees; raises at index 13."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        if i == 13:
            raise KeyError(13)
        self.seen.append((i, stoker.sample_seed()))
        return i


class Batched(Dataset):
    """Fetches a whole batch with __getitems__; records the seeds seen there."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        return i

    def __getitems__(self, indices: list[int]) -> list[int]:
        self.seen.append(stoker.sample_seed())
        self.seen.append(stoker.sample_seed())
        return list(indices)


def test_map_fetcher_gives_each_index_its_seed_and_clears_the_scope() -> None:
    data = Recorder()
    fetcher = MapFetcher(data, True, identity, base_seed=42)
    assert fetcher.fetch([3, 4, 3], epoch=2, batch=9) == [3, 4, 3]
    assert data.seen == [(i, seed_of(SAMPLE, 42, 2, i)) for i in (3, 4, 3)]
    assert current_scope() is None


def test_the_scope_is_cleared_when_getitem_raises() -> None:
    fetcher = MapFetcher(Recorder(), True, identity, base_seed=42)
    with pytest.raises(KeyError):
        fetcher.fetch([12, 13], epoch=0, batch=0)
    assert current_scope() is None
    unbatched = MapFetcher(Recorder(), False, identity, base_seed=42)
    with pytest.raises(KeyError):
        unbatched.fetch(13)
    assert current_scope() is None


def test_a_nested_fetch_gives_the_outer_scope_back() -> None:
    inner = MapFetcher(Recorder(), True, identity, base_seed=1)

    class Outer(Dataset):
        def __getitem__(self, i: int) -> tuple[int, int]:
            before = stoker.sample_seed()
            inner.fetch([0])
            return before, stoker.sample_seed()

    before, after = MapFetcher(Outer(), True, identity, base_seed=2).fetch([6])[0]
    assert before == after == seed_of(SAMPLE, 2, 0, 6)


def test_without_auto_collation_the_sample_has_its_index_seed_and_the_collate_fn_the_batch_seed() -> None:
    def convert(sample: int) -> tuple[int, int]:
        return sample, stoker.sample_seed()

    data = Recorder()
    assert MapFetcher(data, False, convert, base_seed=5).fetch(7, epoch=1, batch=3) == (7, seed_of(BATCH, 5, 1, 3))
    assert data.seen == [(7, seed_of(SAMPLE, 5, 1, 7))]


def test_getitems_and_the_collate_fn_share_the_batch_stream() -> None:
    data = Batched()
    collated: list[int] = []

    def collate(batch: list[int]) -> list[int]:
        collated.append(stoker.sample_seed())
        return batch

    MapFetcher(data, True, collate, base_seed=5).fetch([1, 2], epoch=1, batch=4)
    MapFetcher(data, True, collate, base_seed=5).fetch([1, 2], epoch=1, batch=5)
    assert data.seen == [seed_of(BATCH, 5, 1, 4)] * 2 + [seed_of(BATCH, 5, 1, 5)] * 2
    assert collated == [seed_of(BATCH, 5, 1, 4), seed_of(BATCH, 5, 1, 5)]


def test_subset_and_stack_of_per_sample_datasets_are_fetched_per_sample() -> None:
    tud = pytest.importorskip("torch.utils.data")

    plain, batched = Recorder(), Batched()
    assert not fetches_batches(plain) and fetches_batches(batched)
    assert not fetches_batches(Subset(plain, [1, 2]))
    assert not fetches_batches(Subset(Subset(plain, [1, 2]), [0]))
    assert not fetches_batches(tud.Subset(plain, [1, 2]))
    assert not fetches_batches(StackDataset(plain, Subset(plain, list(range(20)))))
    assert not fetches_batches(StackDataset(a=plain, b=plain))
    assert fetches_batches(Subset(batched, [1, 2]))
    assert fetches_batches(StackDataset(plain, batched))
    assert fetches_batches(StackDataset(a=plain, b=Subset(batched, list(range(20)))))
    assert fetches_batches(tud.Subset(Subset(batched, [0]), [0]))

    class OwnGetitems(Subset):
        def __getitems__(self, indices: list[int]) -> list[int]:
            return [self[i] for i in indices]

    assert fetches_batches(OwnGetitems(plain, [1]))

    data = Recorder()
    subset = Subset(data, [10, 11, 12])
    assert MapFetcher(subset, True, identity, base_seed=3).fetch([2, 0]) == [12, 10]
    # the seed follows the index the sampler gave (the Subset's), one per sample
    assert data.seen == [(12, seed_of(SAMPLE, 3, 0, 2)), (10, seed_of(SAMPLE, 3, 0, 0))]


def test_a_subset_of_a_batch_dataset_still_fetches_the_batch_at_once() -> None:
    data = Batched()
    assert MapFetcher(Subset(data, [10, 11, 12]), True, identity, base_seed=3).fetch([2, 0], batch=1) == [12, 10]
    assert data.seen == [seed_of(BATCH, 3, 0, 1)] * 2


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.at_iter: list[int] = []

    def __iter__(self):
        self.at_iter.append(stoker.sample_seed())
        return self._items()

    def _items(self):
        for i in range(self.n):
            yield i, stoker.sample_seed()


def test_iterable_items_are_keyed_by_worker_and_items_drawn_and_restart_each_epoch() -> None:
    data = Stream(5)
    fetcher = IterableFetcher(data, True, identity, False, base_seed=9, worker_id=2)
    # each batch comes with its replica's record (how far the stream got): the batch is .batch
    first = fetcher.fetch(2, epoch=0, batch=0).batch + fetcher.fetch(2, epoch=0, batch=3).batch
    assert first == [(i, seed_of(ITEM, 9, 0, (2, i))) for i in range(4)]
    assert data.at_iter == [seed_of(ITEM, 9, 0, (2,))]
    assert current_scope() is None
    fetcher.reset()
    again = fetcher.fetch(3, epoch=1, batch=0).batch
    assert again == [(i, seed_of(ITEM, 9, 1, (2, i))) for i in range(3)]
    unbatched = IterableFetcher(Stream(2), False, identity, False, base_seed=9, worker_id=0)
    made = [unbatched.fetch(None, 0, b).batch for b in range(2)]
    assert made == [(i, seed_of(ITEM, 9, 0, (0, i))) for i in range(2)]


# ---------------------------------------------------------------- seed_each_batch in the worker loop


class GlobalDraws(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[float, float, float]:
        torch = optional_torch()
        return random.random(), float(np.random.rand()), float(torch.rand(())) if torch else 0.0


def worker_draws(worker_id: int, seed_each_batch: bool) -> list:
    config = WorkerConfig(
        worker_id=worker_id,
        num_workers=3,
        base_seed=100,
        dataset=GlobalDraws(),
        dataset_kind="map",
        auto_collation=True,
        collate_fn=identity,
        drop_last=False,
        worker_init_fn=None,
        thread=False,  # seeds this process's globals, as a worker process does
        seed_each_batch=seed_each_batch,
    )
    inbox = [Task(0, [0, 1], epoch=1, batch=0), Task(1, [2, 3], epoch=1, batch=1), Stop()]
    out: list = []
    run_worker(config, lambda timeout: inbox.pop(0), out.append)
    assert all(isinstance(reply, Done) for reply in out)
    return [reply.payload for reply in out]


def test_seed_each_batch_makes_a_process_workers_batches_independent_of_its_id(global_rngs, monkeypatch) -> None:
    # run_worker(thread=False) sets the process's worker info: give it back afterwards
    monkeypatch.setattr(worker_module, "_process_info", None)
    first, other = worker_draws(0, True), worker_draws(2, True)
    assert first == other
    assert first[0] != first[1]  # each batch has its own seed
    assert worker_draws(0, False) != worker_draws(2, False)  # by default the worker's seed decides


def test_seed_batch_globals_seeds_random_numpy_and_torch_from_base_epoch_and_batch(global_rngs) -> None:
    torch = optional_torch()

    def draws(base: int, epoch: int, batch: int) -> tuple[float, ...]:
        seed_batch_globals(base, epoch, batch)
        drawn = random.random(), float(np.random.rand())
        return (*drawn, float(torch.rand(()))) if torch else drawn

    reference = draws(1, 2, 3)
    assert draws(1, 2, 3) == reference
    for changed in (draws(0, 2, 3), draws(1, 0, 3), draws(1, 2, 0)):
        assert all(a != b for a, b in zip(changed, reference))
    assert GLOBAL not in (SAMPLE, BATCH, ITEM)


# ---------------------------------------------------------------- num_workers=0


class Raises(GlobalDraws):
    def __getitem__(self, i: int):
        super().__getitem__(i)  # moves every global RNG first
        raise ValueError("bad sample")


def states() -> tuple:
    torch = optional_torch()
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist() if torch else None


@pytest.mark.parametrize("dataset", [GlobalDraws, Raises])
def test_num_workers_0_gives_the_caller_its_rng_states_back(dataset, global_rngs) -> None:
    random.seed(1)
    np.random.seed(2)
    torch = optional_torch()
    if torch:
        torch.manual_seed(3)
    before = states()
    loader = stoker.DataLoader(dataset(), batch_size=2, generator=0, seed_each_batch=True)
    if dataset is Raises:
        with pytest.raises(ValueError, match="bad sample"):
            next(iter(loader))
    else:
        assert len(list(loader)) == 4
    assert states() == before
    # and the fetch did move them: the restore is what kept them
    if dataset is GlobalDraws:
        list(stoker.DataLoader(dataset(), batch_size=2, generator=0))
        assert states() != before


def test_num_workers_0_batches_equal_a_process_workers(global_rngs) -> None:
    loader = stoker.DataLoader(GlobalDraws(), batch_size=2, generator=0, seed_each_batch=True, collate_fn=identity)
    inline = list(loader)
    # the same loader's next iterator draws a new base seed, and its batches still derive from
    # the run's first one (the run seed): compare with the worker loop's
    iterator = iter(loader)
    base, epoch = iterator._run_seed, 1
    assert base != iterator._base_seed
    expected = []
    for batch in range(4):
        seed_batch_globals(base, epoch, batch)
        expected.append([GlobalDraws()[i] for i in (2 * batch, 2 * batch + 1)])
    assert list(iterator) == expected
    assert inline != expected  # another epoch


def test_exports() -> None:
    st = pytest.importorskip("stoker.torch", exc_type=ImportError)

    for module in (stoker, st):
        assert {"sample_seed", "sample_rng"} <= set(module.__all__)
        assert module.sample_seed is stoker.sample_seed and module.sample_rng is stoker.sample_rng
