"""`stoker.ray.streaming_split`: one epoch's batches shared by `n` iterables through Ray's
streaming_split (load balancing, not resumable)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .._data.collate import default_collate
from .blocks import _BatchRows
from .errors import _describe_type, _explained
from .loader import _check_int
from .plan import _batch_tasks, _Units, base_seed_of, rank_batches, read_task_count
from .read import _cluster_cpus, _put_dataset, _ray_dataset


class StreamingSplit:
    """One of `streaming_split`'s iterables of batches; not resumable."""

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
        """Always raises ValueError: which batches a split got depends on timing."""
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
    splits must be iterated concurrently (one per rank, or per thread), as Ray requires."""
    _check_int(n, "n", 1)
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
    plan = _Units(ref, _describe_type(dataset), tasks, base_seed_of(seed), epoch, collate, False)
    splits = _ray_dataset(plan).streaming_split(n, equal=False)
    return [StreamingSplit(s, ref) for s in splits]
