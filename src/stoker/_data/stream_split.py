"""`shard_for`: which part of a stream one (rank, worker) reads, so that an IterableDataset
split over ranks x workers reads every item once."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count`: every `count`-th item, starting at item `index`.

    Args:
        index: This shard's number, 0 <= index < count.
        count: The number of shards.
    """

    index: int
    count: int

    def indices(self, length: int) -> range:
        """This shard's positions among `length` items.

        Args:
            length: The number of items in all.

        Returns:
            `range(index, length, count)`.
        """
        return range(self.index, length, self.count)

    def take(self, items: Iterable[T]) -> Iterator[T]:
        """This shard's items of a stream (it reads and skips the others).

        Args:
            items: The whole stream, as every shard sees it.

        Returns:
            An iterator over items index, index + count, index + 2 * count, ...
        """
        return itertools.islice(items, self.index, None, self.count)


def shard_for(info: Any = None) -> Shard:
    """The shard of the current (rank, worker) among all ranks' workers.

    `info` is what `get_worker_info()` returned (None in the main process, num_workers=0,
    counts as the one worker of its rank). Rank `r` of `world_size`, worker `w` of `n` gets
    shard `r * n + w` of `world_size * n`: ranks take contiguous blocks of shard numbers, and
    together all shards cover every item exactly once.

        def __iter__(self):
            return stoker.shard_for(stoker.get_worker_info()).take(read_records(self.path))

    Args:
        info: What `get_worker_info()` returned in this worker; None (the main process)
            counts as the one worker of its rank, whose rank and world size are then
            torch.distributed's when it is initialised, else the `RANK` and `WORLD_SIZE`
            environment variables, else 0 and 1. Defaults to None.

    Returns:
        The `Shard` this (rank, worker) reads.

    Raises:
        ValueError: when `info` is None and `RANK` or `WORLD_SIZE` is set to something
            that is not an integer.
    """
    if info is None:
        from .distributed import ranks

        rank, world_size, _ = ranks()
        worker, workers = 0, 1
    else:
        rank, world_size = info.rank, info.world_size
        worker, workers = info.id, info.num_workers
    return Shard(rank * workers + worker, world_size * workers)
