"""Exact resume, in-process (num_workers=0 and thread workers): every sampler, batch size,
last_batch and interruption point gives the uninterrupted run; states are small, plain and
checked."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stoker
from stoker.testing import assert_resumes_identically


class Numbers(stoker.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i])


SAMPLERS = ["sequential", "random", "random-replacement", "random-num-samples", "subset", "weighted", "distributed"]


def make_sampler(kind: str, n: int, generator):
    if kind == "sequential":
        return None, False
    if kind == "random":
        return None, True
    if kind == "random-replacement":
        return stoker.RandomSampler(range(n), replacement=True, num_samples=n + 3, generator=generator), None
    if kind == "random-num-samples":
        return stoker.RandomSampler(range(n), num_samples=2 * n + 1, generator=generator), None
    if kind == "subset":
        return stoker.SubsetRandomSampler(list(range(0, n, 2)), generator=generator), None
    if kind == "weighted":
        return stoker.WeightedRandomSampler(np.linspace(1, 2, n), num_samples=n, generator=generator), None
    sampler = stoker.DistributedSampler(range(n), num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(4)
    return sampler, None


def factory(kind: str, n: int, batch_size, last_batch: str, seed, threads: bool):
    def make_loader(num_workers: int = 0):
        generator = None if seed is None else seed
        sampler, shuffle = make_sampler(kind, n, generator)
        kwargs = {"num_workers": num_workers}
        if threads and num_workers:
            kwargs["thread_pool"] = True
        if batch_size is not None and last_batch != "keep":
            kwargs["last_batch"] = last_batch
        return stoker.DataLoader(
            Numbers(n),
            batch_size=batch_size,
            sampler=sampler,
            shuffle=shuffle,
            generator=generator if sampler is None else None,
            **kwargs,
        )

    return make_loader


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(SAMPLERS),
    n=st.integers(5, 23),
    batch_size=st.sampled_from([None, 1, 3, 4]),
    last_batch=st.sampled_from(["keep", "discard", "rollover"]),
    seeded=st.booleans(),
    workers=st.sampled_from([[0], [0, 2]]),
)
def test_every_interruption_point_resumes_exactly(kind, n, batch_size, last_batch, seeded, workers) -> None:
    np.random.seed(11)  # the global RNG a generator-less sampler draws from: the same start
    make = factory(kind, n, batch_size, last_batch, 5 if seeded else None, threads=True)
    if not seeded:
        # each run starts from the same global RNG state; the helper's runs follow each other
        state = np.random.get_state()

        def make_loader(num_workers: int = 0):
            np.random.set_state(state)
            return make(num_workers)
    else:
        make_loader = make
    assert_resumes_identically(make_loader, worker_counts=workers, epochs=2)


def test_state_is_plain_json_and_small_for_ten_million_samples() -> None:
    loader = stoker.DataLoader(Numbers(10_000_000), batch_size=64, shuffle=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    text = json.dumps(state)
    assert json.loads(text) == state
    assert len(text) < 10_000, len(text)
    assert state["version"] == 2 and state["position"] == 1


def test_torch_generator_state_is_under_ten_kilobytes() -> None:
    torch = pytest.importorskip("torch")
    import stoker.torch as st_torch

    loader = st_torch.DataLoader(
        Numbers(10_000_000), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    it = iter(loader)
    next(it)
    assert len(json.dumps(loader.state_dict())) < 10_000


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"n": 30}, "dataset_length"),
        ({"batch_size": 5}, "batch_size"),
        ({"shuffle": False}, "sampler"),
        ({"last_batch": "discard"}, "drop_last"),
    ],
)
def test_a_state_from_another_configuration_is_refused_and_changes_nothing(change, named) -> None:
    base = {"n": 20, "batch_size": 4, "shuffle": True, "last_batch": "keep"}
    saved_loader = stoker.DataLoader(Numbers(base["n"]), batch_size=4, shuffle=True, generator=1)
    it = iter(saved_loader)
    next(it)
    state = saved_loader.state_dict()
    config = dict(base, **change)

    def make():
        return stoker.DataLoader(
            Numbers(config["n"]),
            batch_size=config["batch_size"],
            shuffle=config["shuffle"],
            last_batch=config["last_batch"],
            generator=1,
        )

    fresh = [b.tolist() for b in make()]
    other = make()
    with pytest.raises(ValueError, match=named):
        other.load_state_dict(state)
    assert other.state_dict()["position"] == 0  # nothing was applied
    assert [b.tolist() for b in other] == fresh  # it iterates as if no load had been tried


def test_unknown_version_and_garbage_are_refused() -> None:
    loader = stoker.DataLoader(Numbers(10), batch_size=2)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="version 99"):
        loader.load_state_dict(dict(state, version=99))
    with pytest.raises(ValueError, match="state_dict"):
        loader.load_state_dict({"epoch": 1})


def test_a_state_saved_with_another_generator_is_refused() -> None:
    loader = stoker.DataLoader(Numbers(20), batch_size=4, shuffle=True, generator=1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    state["base_seed"] += 1
    other = stoker.DataLoader(Numbers(20), batch_size=4, shuffle=True, generator=1)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="another generator"):
        iter(other)


def test_a_stream_without_state_is_replayed_to_where_it_was() -> None:
    class Stream(stoker.IterableDataset):
        def __iter__(self):
            return iter(range(7))

    loader = stoker.DataLoader(Stream(), batch_size=2)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(2)]
    state = loader.state_dict()
    assert state["replicas"]["records"] == [
        {"dataset": None, "iterator": None, "replay": 4, "drawn": 4, "ended": False}
    ]
    again = stoker.DataLoader(Stream(), batch_size=2)
    with pytest.warns(UserWarning, match=r"replaying the 4 item\(s\) its replicas had drawn"):
        again.load_state_dict(state)
    assert head + [b.tolist() for b in again] == [[0, 1], [2, 3], [4, 5], [6]]


# torchdata-style ordering of load and iter
def run_rest(loader) -> list[list[int]]:
    return [b.ravel().tolist() for b in loader]


def test_load_before_iter_and_iter_before_load() -> None:
    make = lambda: stoker.DataLoader(Numbers(20), batch_size=3, shuffle=True, generator=9)  # noqa: E731
    reference = run_rest(make())
    first = make()
    it = iter(first)
    head = [next(it).ravel().tolist() for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    # load, then iter: continues
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.state_dict()["position"] == 3  # the loaded point, before iterating
    assert head + run_rest(resumed) == reference
    # iter, then load, then iter again: the iterator made before the load is its own run;
    # the next iter() continues from the state
    late = make()
    early = iter(late)
    next(early)
    late.load_state_dict(state)
    assert head + run_rest(late) == reference


def test_the_position_survives_the_iterator_being_dropped() -> None:
    """Saving after breaking out of the loop must not silently restart the epoch."""
    make = lambda: stoker.DataLoader(Numbers(20), batch_size=3, shuffle=True, generator=2)  # noqa: E731
    reference = run_rest(make())
    loader = make()
    head = []
    for batch in loader:
        head.append(batch.ravel().tolist())
        if len(head) == 4:
            break
    import gc

    gc.collect()
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert head + run_rest(resumed) == reference


def test_unordered_delivery_resumes_without_losing_or_repeating() -> None:
    make = lambda num_workers=2: stoker.DataLoader(  # noqa: E731
        Numbers(40),
        batch_size=2,
        shuffle=True,
        generator=4,
        num_workers=num_workers,
        thread_pool=True,
        in_order=False,
    )
    everything = sorted(i for b in make() for i in b.ravel().tolist())
    loader = make()
    it = iter(loader)
    head = [i for _ in range(7) for i in next(it).ravel().tolist()]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = [i for b in resumed for i in b.ravel().tolist()]
    assert sorted(head + rest) == everything


def test_user_sampler_without_state_is_replayed_with_one_warning() -> None:
    class Evens(stoker.Sampler[int]):
        def __iter__(self):
            return iter(range(0, 20, 2))

        def __len__(self) -> int:
            return 10

    make = lambda: stoker.DataLoader(Numbers(20), batch_size=2, sampler=Evens())  # noqa: E731
    loader = make()
    it = iter(loader)
    head = [next(it).ravel().tolist() for _ in range(2)]
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    with pytest.warns(UserWarning, match="replaying its iterator"):
        rest = run_rest(resumed)
    assert head + rest == run_rest(make())


# ------------------------------------------------------------ elastic resume
def rank_loader(world: int, rank: int, n: int = 50, drop_last: bool = False):
    sampler = stoker.DistributedSampler(Numbers(n), num_replicas=world, rank=rank, seed=7, drop_last=drop_last)
    sampler.set_epoch(3)
    return stoker.DataLoader(Numbers(n), batch_size=2, sampler=sampler), sampler


@pytest.mark.parametrize(("old_world", "new_world", "steps"), [(4, 3, 3), (2, 5, 4), (3, 3, 2), (4, 2, 0)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_elastic_resume_gives_the_new_world_exactly_what_no_old_rank_took(
    old_world, new_world, steps, drop_last
) -> None:
    n = 50
    consumed: list[int] = []
    states = []
    for rank in range(old_world):  # every rank saves at the same step, as DDP loops do
        loader, _ = rank_loader(old_world, rank, n, drop_last)
        it = iter(loader)
        for _ in range(steps):
            consumed += next(it).ravel().tolist()
        states.append(json.loads(json.dumps(loader.state_dict())))
    rest: list[int] = []
    for rank in range(new_world):
        loader, sampler = rank_loader(new_world, rank, n, drop_last)
        loader.load_state_dict(states[0])  # every new rank loads rank 0's state
        mine = [i for batch in loader for i in batch.ravel().tolist()]
        rest += mine
        # the epoch after is the new world's ordinary one
        sampler.set_epoch(4)
        fresh, fresh_sampler = rank_loader(new_world, rank, n, drop_last)
        fresh_sampler.set_epoch(4)
        assert [b.tolist() for b in loader] == [b.tolist() for b in fresh]
    taken = set(consumed)
    if old_world == new_world:
        # another rank's state on the same world: each rank goes on as its uninterrupted run,
        # whose padded tail repeats samples from the epoch's start (see test_distributed_resume_tail)
        assert len(taken & set(rest)) < new_world
    else:
        assert not taken & set(rest), "a sample consumed before the resume came again"
    expected = set(range(n))
    if drop_last:  # the old world's dropped tail, and the new world's, are not read this epoch
        assert taken | set(rest) <= expected
        assert len(expected - (taken | set(rest))) < old_world + new_world
    else:
        assert taken | set(rest) == expected, "a sample was lost"
    # repeats only from padding to equal shards (fewer than a world's size)
    assert len(rest) - len(set(rest)) < new_world


def test_elastic_resume_refuses_rollover_and_changes_nothing() -> None:
    loader = stoker.DataLoader(
        Numbers(20),
        batch_size=3,
        last_batch="rollover",
        sampler=stoker.DistributedSampler(Numbers(20), num_replicas=2, rank=0),
    )
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    other = stoker.DataLoader(
        Numbers(20),
        batch_size=3,
        last_batch="rollover",
        sampler=stoker.DistributedSampler(Numbers(20), num_replicas=3, rank=0),
    )
    with pytest.raises(ValueError, match="rollover"):
        other.load_state_dict(state)
    assert other.batch_sampler.sampler._elastic is None


class Cursor(stoker.Sampler[int]):
    """A user's sampler that keeps its own position (torchdata's convention): after
    load_state_dict, the next iteration continues from there. Counts its own steps."""

    def __init__(self, n: int) -> None:
        self.n, self.position, self.steps = n, 0, 0

    def __iter__(self):
        while self.position < self.n:
            self.position += 1
            self.steps += 1
            yield (self.position * 7) % self.n
        self.position = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_user_sampler_with_state_is_restored_at_its_position_not_replayed(num_workers) -> None:
    def make_loader(num_workers: int = num_workers):
        return stoker.DataLoader(
            Numbers(30), batch_size=4, sampler=Cursor(30), num_workers=num_workers, thread_pool=True
        )

    assert_resumes_identically(make_loader, epochs=2)
    loader = make_loader()
    it = iter(loader)
    for _ in range(6):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = make_loader()
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "replaying" warning: nothing is replayed
        warnings.simplefilter("error", RuntimeWarning)  # stoker's categories: not the others'
        rest = run_rest(resumed)
    assert len(rest) == 8 - 6
    assert resumed.sampler.steps == 30 - 6 * 4  # it drew only what was left


def test_a_closed_or_dropped_iterator_keeps_its_position_but_not_its_batches() -> None:
    import gc
    import weakref

    def make() -> stoker.DataLoader:
        return stoker.DataLoader(Numbers(40), batch_size=2, shuffle=True, generator=3, num_workers=2, thread_pool=True)

    reference = run_rest(make())
    loader = make()
    it = iter(loader)
    head = [next(it).ravel().tolist() for _ in range(5)]
    probe = weakref.ref(loader._latest.scheduler)
    it.close()
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["position"] == 5
    del it
    gc.collect()
    assert probe() is None, "the stopped iterator's scheduler (and its undelivered batches) must be released"
    resumed = make()
    resumed.load_state_dict(state)
    assert head + run_rest(resumed) == reference
