"""stoker.ray's division of an epoch, pure and without Ray: the batches a rank reads
(`rank_batches`: DistributedSampler + BatchSampler), how many read tasks share them
(`read_task_count`) and how they are cut into contiguous runs (`_Units`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .._base.checks import check_int
from .._data.distributed import DistributedSampler
from .._data.rng import RandomSource
from .._data.samplers import BatchSampler

# How many read tasks: one for every UNITS_PER_TASK batches (to_ray_dataset: groups of
# SAMPLES_PER_FETCH samples), and at least one per CPU of the cluster. Each batch leaves its
# task as a block of its own, so a long task streams its batches; what a task costs is its
# start (~40 ms between one task's last batch and the next task's first, measured). On the
# images workload (3x224x224 uint8, batch 64, an epoch of 80 batches, one node of 2 cores, Ray
# given 2 CPUs), epoch samples/s by task count: 16 tasks 3,837, 8 4,077, 4 4,455, 2 5,013 (one
# `python -m stoker_bench.raybench` run, from the repository's benchmarks/; an earlier sweep,
# medians of 3: 16 3,154, 8 3,505, 4 3,981, 2 4,036). Not fewer than one per CPU: tasks are
# what Ray spreads over the cluster.
UNITS_PER_TASK = 40
SAMPLES_PER_FETCH = 64  # to_ray_dataset: indices per __getitems__ call (a dataset that has one)


def contiguous_slices(count: int, parts: int) -> list[tuple[int, int]]:
    """`parts` runs [start, stop) that cover range(count) in order, their sizes differing by
    at most one; fewer runs when count < parts (no run is empty)."""
    if count <= 0:
        return []
    parts = max(1, min(parts, count))
    base, extra = divmod(count, parts)
    runs, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        runs.append((start, stop))
        start = stop
    return runs


def read_task_count(units: int, cluster_cpus: float, requested: int | None = None) -> int:
    """How many read tasks share `units` batches (or to_ray_dataset's fetch groups).

    Args:
        units: The number of batches (or fetch groups of 64 samples) to share out.
        cluster_cpus: The number of CPUs of the Ray cluster.
        requested: The count the user asked for (`read_tasks`); None chooses one for
            every 40 units (UNITS_PER_TASK) and at least one per cluster CPU.
            Defaults to None.

    Returns:
        The number of read tasks, at least 1 and never more than `units`.

    Raises:
        TypeError: when `requested` is not an int or None.
        ValueError: when `requested` is below 1.
    """
    if requested is not None:
        requested = check_int("read_tasks", requested, low=1, none_ok=True)
        return max(1, min(requested, units))
    by_size = math.ceil(units / UNITS_PER_TASK)
    return max(1, min(max(by_size, int(cluster_cpus)), units))


def base_seed_of(seed: int) -> int:
    """The base seed of `stoker.sample_seed()` / `sample_rng()` for loader seed `seed`.

    It is the one `stoker.DataLoader(..., generator=seed)` draws for its first iterator
    when its sampler draws nothing from the generator (a DistributedSampler, a
    SequentialSampler), so a read task seeds samples as stoker's own workers do.

    Args:
        seed: The loader's int seed.

    Returns:
        The base seed, an int in [0, 2**63).
    """
    return int(RandomSource(int(seed)).seed64())


def rank_batches(
    length: int,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    drop_last: bool,
    elastic: tuple[int, int, int] | None = None,
) -> list[list[int]]:
    """This rank's batches of one epoch: what `DistributedSampler(num_replicas=world_size,
    rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)` after `set_epoch(epoch)` and
    `BatchSampler(sampler, batch_size, drop_last)` give (after `resume_elastic(*elastic)`
    when given: the rest of an epoch another world size had begun)."""
    sampler = _sampler(length, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last)
    sampler.set_epoch(epoch)
    if elastic is not None:
        sampler.resume_elastic(*elastic)
    return list(BatchSampler(sampler, batch_size, drop_last))


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _sampler(
    length: int, *, shuffle: bool, seed: int, rank: int, world_size: int, drop_last: bool
) -> DistributedSampler:
    return DistributedSampler(
        _Sized(length),
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )


class _Units:
    """What a datasource reads: for each read task, its units (position, indices), each unit
    fetched together (a batch; for to_ray_dataset, up to SAMPLES_PER_FETCH samples)."""

    def __init__(
        self,
        ref: Any,
        described: str,
        tasks: list[list[tuple[int, list[int]]]],
        base_seed: int,
        epoch: int,
        collate_fn: Callable[[list[Any]], Any] | None,
        per_sample: bool,
        rank: int = 0,
    ) -> None:
        self.ref = ref
        self.described = described
        self.tasks = tasks
        self.base_seed = base_seed
        self.epoch = epoch
        self.collate_fn = collate_fn
        self.per_sample = per_sample
        self.rank = rank  # mixed into batch-level seeds, as in stoker's own workers


def _batch_tasks(units: list[tuple[int, list[int]]], tasks: int) -> list[list[tuple[int, list[int]]]]:
    """`units` cut into `tasks` contiguous runs."""
    return [units[start:stop] for start, stop in contiguous_slices(len(units), tasks)]


def _sample_tasks(indices: list[int], tasks: int) -> list[list[tuple[int, list[int]]]]:
    """`indices` cut into `tasks` contiguous slices, each fetched SAMPLES_PER_FETCH at a time;
    a unit's position is the offset of its first index in `indices`."""
    made = []
    for start, stop in contiguous_slices(len(indices), tasks):
        made.append([(k, indices[k : min(k + SAMPLES_PER_FETCH, stop)]) for k in range(start, stop, SAMPLES_PER_FETCH)])
    return made
