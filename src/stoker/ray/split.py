"""`stoker.ray.streaming_split`: one epoch's batches shared by `n` iterables through Ray's
streaming_split (load balancing, not resumable)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .._base.checks import check_int
from .._data.collate import default_collate
from .blocks import _BatchRows
from .epoch import _batch_tasks, _Units, base_seed_of, rank_batches, read_task_count
from .errors import _describe_type, _explained
from .read import _cluster_cpus, _put_dataset, _ray_dataset


class StreamingSplit:
    """One of `streaming_split`'s iterables of batches; not resumable.

    `streaming_split` makes them; iterate each in its own rank or thread, all at once.
    Iterating raises `ReadError` when the dataset or the collate_fn raised in a read task,
    and `ShippingError` when the dataset could not be rebuilt on the cluster.

    Args:
        iterator: The Ray `DataIterator` of this split.
        keep: The dataset's Ray object reference, kept alive while the split is.
    """

    def __init__(self, iterator: Any, keep: Any) -> None:
        self._iterator = iterator
        self._keep = keep  # the dataset's object ref, alive while a split is

    def __iter__(self) -> Iterator[Any]:
        blocks = iter(self._iterator.iter_batches(batch_size=None, batch_format="pyarrow"))
        rows = _BatchRows()
        while True:
            try:
                table = next(blocks)
            except StopIteration:
                yield from (batch for _, batch in rows.finish())
                return
            except Exception as exc:
                explained = _explained(exc)
                if explained is None:
                    raise
                raise explained from exc
            yield from (batch for _, batch in rows.feed(table))

    def state_dict(self) -> dict[str, Any]:
        """Always raises ValueError: which batches a split got depends on timing.

        Raises:
            ValueError: always; use `stoker.ray.DataLoader` for exact resume.
        """
        raise ValueError(
            "a stoker.ray.streaming_split split is not resumable: Ray hands each batch to whichever "
            "split asks first, so which batches a split got depends on timing; use "
            "stoker.ray.DataLoader (each rank reads its own shard) for exact resume"
        )


def streaming_split(
    dataset: Any,
    n: int,
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    read_tasks: int | None = None,
) -> list[StreamingSplit]:
    """`n` iterables that share one epoch's batches through Ray's `streaming_split`: each batch
    goes to whichever split asks for it next, so a slow rank takes fewer (load balancing).

    Every batch of the epoch (all samples in `DistributedSampler(num_replicas=1, shuffle=shuffle,
    seed=seed)` order after set_epoch(epoch), batched) reaches exactly one split, none is
    dropped. The trade: which batches a rank gets depends on timing, so runs are not
    reproducible batch-for-batch and a split cannot be resumed (`state_dict()` raises). The
    splits must be iterated concurrently (one per rank, or per thread), as Ray requires.
    Starts Ray (`ray.init()`) if it is not running.

    Args:
        dataset: The map-style dataset (with `__len__`); it must pickle, and its class
            must be importable on the Ray workers.
        n: The number of splits (one per consumer).
        batch_size: The number of samples in a batch.
        shuffle: Shuffle the epoch's samples from `seed + epoch`. Defaults to False.
        seed: The shuffling seed, and the base of the per-sample seeds (`base_seed_of`).
            Defaults to 0.
        epoch: The epoch whose order and per-sample seeds to use. Defaults to 0.
        drop_last: Drop the epoch's short final batch. Defaults to False.
        collate_fn: Makes a batch of a list of samples, in the read task; None means
            `stoker.default_collate`. Defaults to None.
        read_tasks: The number of Ray read tasks; None chooses one for every 40 batches
            and at least one per cluster CPU. Defaults to None.

    Returns:
        `n` `StreamingSplit` iterables.

    Raises:
        TypeError: when `n`, `batch_size` or `read_tasks` is not an int (None is accepted
            for `read_tasks`).
        ValueError: when `n`, `batch_size` or `read_tasks` is below 1.
        ShippingError: when the dataset cannot be pickled to send it to the cluster.
    """
    check_int("n", n, low=1)
    check_int("batch_size", batch_size, low=1)
    batches = rank_batches(
        len(dataset),
        batch_size,
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        rank=0,
        world_size=1,
        drop_last=drop_last,
    )
    ref = _put_dataset(dataset)
    units = list(enumerate(batches))
    tasks = _batch_tasks(units, read_task_count(len(units), _cluster_cpus(), read_tasks))
    collate = default_collate if collate_fn is None else collate_fn
    work = _Units(ref, _describe_type(dataset), tasks, base_seed_of(seed), epoch, collate, False)
    splits = _ray_dataset(work).streaming_split(n, equal=False)
    return [StreamingSplit(s, ref) for s in splits]
