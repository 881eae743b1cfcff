"""The doctor's probe in this process: dataset[i] timed over a spread of indices, a few batches
collated (`profile_fetch`, `Profile`), the headroom of a free loader (`replay_rate`), and how a
consumer walks a batch (`touch`, `batch_len`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._core import seeding
from .._core.stats import array_bytes
from .errors import MeasureError
from .target import Target, _first_line

PROFILE_SAMPLES = 256  # at most this many dataset[i] calls in the main-process profile
REPLAY_BATCHES = 8  # cached batches the headroom replay cycles through


def touch(batch: Any) -> int:
    """Walk a batch as a consumer does before using it: read every leaf's shape. Returns
    the number of leaves."""
    if isinstance(batch, dict):
        return sum(touch(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(touch(v) for v in batch)
    getattr(batch, "shape", None)
    return 1


def batch_len(batch: Any, default: int) -> int:
    """Samples in a batch: the leading dimension of its first array leaf, else `default`."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else default
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and batch:
        if all(not hasattr(v, "shape") and not isinstance(v, (list, tuple, dict)) for v in batch):
            return len(batch)
        return batch_len(batch[0], default)
    return default


# ------------------------------------------------------------------------- profile
@dataclass
class Profile:
    """Per-sample fetch time in this process, collate time and bytes per batch."""

    samples: int
    fetch_median_ms: float
    fetch_p90_ms: float
    fetch_p10_ms: float
    fetch_max_ms: float
    collate_ms: float | None
    batch_bytes: int | None
    batch_size: int
    batches: list[Any] = field(default_factory=list, repr=False)  # for the headroom replay

    @property
    def spread(self) -> float:
        return self.fetch_p90_ms / self.fetch_median_ms if self.fetch_median_ms > 0 else 1.0

    def one_process_rate(self) -> float | None:
        """Samples/s one process could make alone (fetch + collate), by these figures."""
        per_batch_ms = self.fetch_median_ms * self.batch_size + (self.collate_ms or 0.0)
        return self.batch_size * 1000 / per_batch_ms if per_batch_ms > 0 else None


def _spread_indices(n: int, count: int) -> list[int]:
    """Up to `count` indices spread over range(n), in a shuffled order (a fixed seed)."""
    if n <= 0:
        return []
    picked = np.unique(np.linspace(0, n - 1, min(n, count)).astype(np.int64))
    return [int(i) for i in np.random.default_rng(0).permutation(picked)]


def _fetch_items(target: Target, time_s: float, count: int) -> tuple[list[Any], list[float]]:
    """Fetch up to `count` samples in this process, as a loader's fetcher would (inside a
    fetch scope, so stoker.sample_rng() works); stops after `time_s` (at least one)."""
    samples: list[Any] = []
    times: list[float] = []
    end = time.perf_counter() + time_s
    scope = seeding.FetchScope(base_seed=0, epoch=0, tag=seeding.SAMPLE)
    previous = seeding.enter(scope)
    try:
        if target.iterable:
            scope.at(seeding.ITEM, (0,))
            stream = iter(target.dataset)
            for k in range(count):
                scope.at(seeding.ITEM, (0, k))
                start = time.perf_counter()
                try:
                    item = next(stream)
                except StopIteration:
                    break
                except Exception as exc:
                    what = f"{type(exc).__name__}: {_first_line(exc)}"
                    raise MeasureError(f"item {k} of iter(dataset) raised {what}") from exc
                times.append(time.perf_counter() - start)
                samples.append(item)
                if time.perf_counter() > end:
                    break
        else:
            for i in _spread_indices(len(target.dataset), count):
                scope.at(seeding.SAMPLE, i)
                start = time.perf_counter()
                try:
                    item = target.dataset[i]
                except Exception as exc:
                    raise MeasureError(f"dataset[{i}] raised {type(exc).__name__}: {_first_line(exc)}") from exc
                times.append(time.perf_counter() - start)
                samples.append(item)
                if time.perf_counter() > end:
                    break
    finally:
        seeding.leave(previous)
    return samples, times


def profile_fetch(target: Target, collate_fn: Callable[[Any], Any], time_s: float) -> Profile:
    """Time dataset[i] on a spread of indices, then collate a few batches from those samples
    (reused cyclically when fewer than a batch were fetched in time)."""
    samples, times = _fetch_items(target, time_s * 0.7, PROFILE_SAMPLES)
    if not samples:
        raise RuntimeError("the dataset gave no sample")
    ms = np.array(times) * 1000
    size = target.batch_size or 1
    if target.batch_sampler is not None:  # a user's batch sampler: its first batch's size
        size = len(next(iter(target.batch_sampler), [None]))
    batches: list[Any] = []
    collate_times: list[float] = []
    end = time.perf_counter() + max(time_s * 0.3, 0.05)
    scope = seeding.FetchScope(base_seed=0, epoch=0, tag=seeding.BATCH)
    previous = seeding.enter(scope)
    try:
        for b in range(REPLAY_BATCHES):
            group = [samples[(b * size + j) % len(samples)] for j in range(size)]
            scope.at(seeding.BATCH, b)
            start = time.perf_counter()
            batches.append(collate_fn(group))
            collate_times.append(time.perf_counter() - start)
            if time.perf_counter() > end:
                break
    finally:
        seeding.leave(previous)
    return Profile(
        samples=len(samples),
        fetch_median_ms=float(np.median(ms)),
        fetch_p90_ms=float(np.percentile(ms, 90)),
        fetch_p10_ms=float(np.percentile(ms, 10)),
        fetch_max_ms=float(ms.max()),
        collate_ms=float(np.median(collate_times)) * 1000 if collate_times else None,
        batch_bytes=array_bytes(batches[0]) if batches else None,
        batch_size=size,
        batches=batches,
    )


def replay_rate(batches: Sequence[Any], batch_size: int, time_s: float) -> float | None:
    """Samples/s of a free loader: cached batches handed to a consumer that touches each
    (the loop's own cost), for about `time_s`."""
    if not batches:
        return None
    count = 0
    start = time.perf_counter()
    end = start + time_s
    while True:
        for batch in batches:
            touch(batch)
        count += len(batches)
        now = time.perf_counter()
        if now >= end:
            return count * batch_size / (now - start)
