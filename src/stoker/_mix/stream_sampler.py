"""`StreamSampler`: the positions of a stream dataset (`MixedDataset`, `PackedDataset`) epoch
after epoch, split over ranks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from typing import Any

from .._base.hooks import LocatesRows, follows
from .._data.distributed import RankShareSampler


class StreamSampler(RankShareSampler):
    """The positions of a stream dataset (`MixedDataset`, `PackedDataset`) epoch after epoch,
    split over ranks.

    Epoch e (`set_epoch`) gives the positions [e * len(dataset), (e + 1) * len(dataset)) in
    order; rank r takes the r-th, (r + world)-th, ... of them, as `DistributedSampler` splits
    its order (padding the tail with the epoch's first positions, or dropping it). The global
    sequence does not depend on the number of ranks or workers, so a loader's `state_dict()`
    resumes exactly on another world size (the rest of the epoch is what no old rank took),
    and a state saved over another stream (other sources, weights, schedule, seq_len, K, ...)
    is refused with what differs.

    Made while torch is imported, it is also a `torch.utils.data.DistributedSampler`, so that
    Lightning, Fabric and (with `stoker.torch` imported) accelerate keep it as each rank's share
    instead of sharding it again.

    Args:
        dataset: The stream dataset.
        num_replicas: The number of ranks. None means torch.distributed's world size when it
            is initialised, else `WORLD_SIZE`, else 1. Defaults to None.
        rank: This rank. None means torch.distributed's rank, else `RANK`, else 0. Defaults
            to None.
        drop_last: Drop the tail that does not divide evenly by `num_replicas` instead of
            padding it. Defaults to False.

    Raises:
        ValueError: as `DistributedSampler` (num_replicas, rank).
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle=False, seed=0, drop_last=drop_last)

    def _order(self) -> list[int]:
        n = len(self.dataset)
        return list(range(self.epoch * n, (self.epoch + 1) * n))

    def _iter_from(self, skip: int) -> Iterator[int]:
        indices = super()._iter_from(skip)
        dataset: Any = self.dataset
        if not follows(dataset, LocatesRows):
            return indices
        first = next(indices, None)
        if first is None:
            return iter(())
        # drawn in the loader's process before its workers fork: the window table it packs
        # here (every window before `first`, lengths only) is inherited, not packed again
        dataset.locate(first)
        return itertools.chain([first], indices)

    def __iter__(self) -> Iterator[int]:
        return self._iter_from(0)
