"""Randomness that does not depend on the workers: `stoker.sample_rng()` / `sample_seed()`
under every worker kind, and `seed_each_batch=True` with process workers and num_workers=0.

Each comparison runs the same loader (same `generator`, hence the same sampler order and
base seed) with num_workers 0, 1 and 3 and compares the batches of two epochs.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

import stoker
from stoker import DataLoader, Dataset, IterableDataset

# 3 workers on a machine that may have 2 cores: the loader warns, as torch's does
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N = 24
BATCH = 4


class Augmented(Dataset):
    """Each sample draws from its own generator: twice from `sample_rng()` (one stream)
    and once through `sample_seed()`."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        rng = stoker.sample_rng()
        noise = rng.random(2)
        more = stoker.sample_rng().random()  # continues the stream: differs from noise[0]
        seeded = np.random.default_rng(stoker.sample_seed()).random()
        return np.array([i, *noise, more, seeded])


class BatchAugmented(Dataset):
    """Fetches whole batches with __getitems__, drawing from the batch's generator."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        raise AssertionError("the loader must use __getitems__")

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        rng = stoker.sample_rng()
        return [np.array([i, rng.random(), rng.random()]) for i in indices]


class GlobalDraws(Dataset):
    """Draws from the global RNGs: Python's, numpy's and torch's."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        torch = optional_torch()
        return np.array([i, random.random(), np.random.rand(), float(torch.rand(())) if torch else 0.0])


def optional_torch() -> Any:
    """torch, or None where it is not installed (stoker then seeds Python's and numpy's
    global RNGs alone)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def import_torch(worker_id: int) -> None:
    """worker_init_fn: torch is imported before the first batch (as it is under fork)."""
    optional_torch()


def engine_kwargs(engine: str, num_workers: int) -> dict:
    if num_workers == 0:
        return {}
    if engine == "threads":
        return {"thread_pool": True}
    return {"multiprocessing_context": engine}


def epochs(dataset: Dataset, num_workers: int, engine: str = "fork", count: int = 2, **kwargs) -> list[list]:
    """The batches of `count` epochs of one loader, as lists."""
    loader = DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        generator=1234,
        num_workers=num_workers,
        **engine_kwargs(engine, num_workers),
        **kwargs,
    )
    return [[batch.tolist() for batch in loader] for _ in range(count)]


def assert_epochs_differ(runs: list[list]) -> None:
    first, second = runs
    assert len(first) == len(second) == N // BATCH
    # the samples' order differs between epochs (shuffle): compare each sample's draws
    draws = [{row[0]: row[1:] for batch in run for row in batch} for run in runs]
    assert set(draws[0]) == set(draws[1]) == set(range(N))
    assert all(draws[0][i] != draws[1][i] for i in range(N))


@pytest.mark.parametrize("engine", ["fork", "spawn", "threads"])
@pytest.mark.parametrize("dataset", [Augmented, BatchAugmented])
def test_sample_rng_batches_are_the_same_whatever_the_workers(engine: str, dataset: type) -> None:
    inline = epochs(dataset(), 0)
    assert_epochs_differ(inline)
    for num_workers in (1, 3):
        assert epochs(dataset(), num_workers, engine) == inline, f"num_workers={num_workers}"


def test_sample_rng_draws_are_per_sample_and_continue_one_stream() -> None:
    (run,) = epochs(Augmented(), 3, count=1)
    rows = [row for batch in run for row in batch]
    assert len({tuple(row[1:]) for row in rows}) == N  # every sample its own draws
    assert all(row[1] != row[3] for row in rows)  # the second sample_rng() call did not restart


def test_persistent_workers_draw_anew_each_epoch() -> None:
    # one base seed for the iterator's whole life: only the epoch number tells epochs apart
    runs = epochs(Augmented(), 2, persistent_workers=True)
    assert_epochs_differ(runs)
    assert epochs(Augmented(), 3, persistent_workers=True) == runs


class Stream(IterableDataset):
    """Each worker's replica yields its share of 0..N-1, drawn from `sample_rng()`."""

    def __iter__(self):
        info = stoker.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, N, workers):
            yield np.array([i, stoker.sample_rng().random()])


@pytest.mark.parametrize("engine", ["fork", "threads"])
def test_iterable_items_draw_by_worker_and_position(engine: str) -> None:
    def run(num_workers: int) -> dict[int, float]:
        loader = DataLoader(
            Stream(), batch_size=BATCH, generator=99, num_workers=num_workers, **engine_kwargs(engine, num_workers)
        )
        return {int(i): x for batch in loader for i, x in batch.tolist()}

    two = run(2)
    assert sorted(two) == list(range(N))
    assert run(2) == two  # reproducible for the same num_workers
    assert len(set(two.values())) == N


@pytest.mark.parametrize("seed_each_batch", [True, False])
def test_seed_each_batch_makes_global_rng_batches_independent_of_the_workers(seed_each_batch: bool) -> None:
    optional_torch()  # so that fork workers have it

    runs = {
        num_workers: epochs(GlobalDraws(), num_workers, seed_each_batch=seed_each_batch, **init)
        for num_workers, init in ((0, {}), (1, {"worker_init_fn": import_torch}), (3, {"worker_init_fn": import_torch}))
    }
    if seed_each_batch:
        assert runs[0] == runs[1] == runs[3]
        assert_epochs_differ(runs[0])
    else:
        # the test means something: without it the draws depend on the worker that made them
        assert runs[1] != runs[3] and runs[0] != runs[3]


def test_seed_each_batch_under_spawn_matches_num_workers_0() -> None:
    inline = epochs(GlobalDraws(), 0, count=1, seed_each_batch=True)
    spawned = epochs(GlobalDraws(), 2, "spawn", count=1, seed_each_batch=True, worker_init_fn=import_torch)
    assert spawned == inline


def test_num_workers_0_with_seed_each_batch_leaves_the_callers_rngs_as_they_were() -> None:
    torch = optional_torch()

    def states() -> tuple:
        return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist() if torch else None

    def draws() -> tuple:
        return random.random(), np.random.rand(), float(torch.rand(())) if torch else None

    def seed() -> None:
        random.seed(5)
        np.random.seed(6)
        if torch:
            torch.manual_seed(7)

    seed()
    before = states()
    loader = DataLoader(GlobalDraws(), batch_size=BATCH, shuffle=True, generator=3, seed_each_batch=True)
    for _ in loader:
        assert states() == before  # the training loop sees its own streams, batch after batch
    assert states() == before
    expected = draws()
    seed()
    assert draws() == expected
