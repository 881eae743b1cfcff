"""`ShardedSampler`: the global order of a sharded dataset's epoch, a function of (seed, epoch)
alone, that reads each shard in one stretch.

The shards are shuffled; consecutive runs of `window_shards` of them form windows; the samples
of a window are shuffled together. An epoch is its windows one after another, so at any moment
the readers need the shards of one window (and the prefetcher those of the next), and each
shard is downloaded once per epoch per machine when the cache holds a couple of windows.

Ranks split that global order as `DistributedSampler` splits its own (rank r takes positions
r, r + world, ...; padding or dropping the tail), so every rank reads from the same window at
the same time and the machine's cache serves all of them; and since the order does not depend
on the world size, a state saved on one world size resumes exactly on another (see
`DistributedSampler.resume_elastic`).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import numpy as np

from .._base.checks import check_int
from .._base.hooks import HasShards, follows
from .._data.distributed import RankShareSampler


class ShardedSampler(RankShareSampler):
    """One rank's share of a sharded dataset's shard-aware global order.

    The order of an epoch depends only on `seed`, the epoch (`set_epoch`), `window_shards`
    and the dataset's shards: not on the number of workers or of ranks. With `shuffle=False`
    it is the dataset's own order. Everything else (padding, `drop_last`, `set_epoch`, an
    elastic resume on another world size) is `DistributedSampler`'s. Made while torch is
    imported, it is also a `torch.utils.data.DistributedSampler`, so that Lightning, Fabric and
    (with `stoker.torch` imported) accelerate keep it as each rank's share instead of sharding
    it again.

    Args:
        dataset: A `ShardedDataset` (anything with a `shard_starts` array: the first sample
            number of each shard, and the total as its last entry).
        num_replicas: The number of ranks. None means torch.distributed's world size when it
            is initialised, else the `WORLD_SIZE` environment variable, else 1. Defaults to
            None.
        rank: This rank. None means torch.distributed's rank, else `RANK`, else 0. Defaults
            to None.
        shuffle: Shuffle shards and samples each epoch. Defaults to True.
        seed: The shuffling seed; every rank must pass the same. Defaults to 0.
        drop_last: Drop the tail that does not divide evenly by `num_replicas`; when False,
            samples from the start of the epoch's order pad it. Defaults to False.
        window_shards: How many shards are shuffled together (int >= 1): larger mixes
            samples from more shards, and needs a cache that holds about two windows.
            Defaults to 4.

    Raises:
        ValueError: when `window_shards` is below 1, or as `DistributedSampler`.
        TypeError: when `dataset` has no `shard_starts`, or `window_shards` is not an int.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int | None = 0,
        drop_last: bool = False,
        window_shards: int = 4,
    ) -> None:
        if not follows(dataset, HasShards):
            raise TypeError(
                f"ShardedSampler needs a ShardedDataset (with shard_starts), but got {type(dataset).__name__}"
            )
        check_int("window_shards", window_shards, low=1)
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self.window_shards = window_shards
        self._starts = np.asarray(dataset.shard_starts, dtype=np.int64)  # type: ignore[attr-defined]

    def _order(self) -> list[int]:
        return global_order(self._starts, self.seed, self.epoch, self.window_shards, self.shuffle).tolist()

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state: what fixes the order of the current epoch.

        Returns:
            A dict with `epoch`, `seed` and `window_shards`.
        """
        return {"epoch": self.epoch, "seed": self.seed, "window_shards": self.window_shards}

    def stoker_describe(self) -> dict[str, Any]:
        """What a loader state saved with this sampler must agree on, beyond what every
        `DistributedSampler` records (seed, shuffle, drop_last): `window_shards`, when the
        order is shuffled (unshuffled, it changes nothing)."""
        return {"window_shards": self.window_shards} if self.shuffle else {}


def global_order(starts: np.ndarray, seed: int, epoch: int, window_shards: int, shuffle: bool = True) -> np.ndarray:
    """The whole epoch's order of sample numbers (int64), before any rank takes its share.

    Args:
        starts: Each shard's first sample number, then the total (len = shards + 1).
        seed: The shuffling seed.
        epoch: The epoch.
        window_shards: How many shards are shuffled together.
        shuffle: False gives `arange(total)`. Defaults to True.

    Returns:
        A permutation of `arange(total)`.
    """
    total = int(starts[-1])
    if not shuffle:
        return np.arange(total, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed) & (2**63 - 1), int(epoch)])))
    shards = rng.permutation(len(starts) - 1)
    counts = starts[1:] - starts[:-1]
    out = np.empty(total, dtype=np.int64)
    at = 0
    for first in range(0, len(shards), window_shards):
        window = shards[first : first + window_shards]
        pieces = [np.arange(starts[s], starts[s] + counts[s], dtype=np.int64) for s in window]
        block = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
        out[at : at + len(block)] = block[rng.permutation(len(block))]
        at += len(block)
    return out
