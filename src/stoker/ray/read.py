"""stoker.ray's read tasks: the dataset shipped once to the object store (`_put_dataset`), a
read task fetching and collating its run of batches under stoker's per-sample seeding
(`_read`), the Ray Data datasource over an epoch's read units (`_ray_dataset`), and `to_ray_dataset`."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .._core.fetch import fetches_batches
from .._core.seeding import BATCH, SAMPLE, FetchScope, batch_key, enter, leave
from .blocks import _batch_block, _block
from .epoch import SAMPLES_PER_FETCH, _sample_tasks, _Units, base_seed_of, read_task_count
from .errors import (
    _RUNTIME_ENV_HINT,
    ShippingError,
    _describe_type,
    _failure,
    _first_line,
    _innermost,
    _TaskFailure,
)

if TYPE_CHECKING:
    import ray.data


def _fetch(
    dataset: Any,
    getitems: Callable[[list[int]], Any] | None,
    indices: list[int],
    position: int,
    base_seed: int,
    epoch: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    rank: int = 0,
) -> Any:
    """One batch as stoker's MapFetcher makes it: each sample under its own seeding scope
    (SAMPLE, index), or the whole batch under (BATCH, position, with the rank) for a user's
    __getitems__; the collate_fn under (BATCH, position, with the rank)."""
    key = batch_key(position, rank)
    scope = FetchScope(base_seed, epoch)
    previous = enter(scope)
    try:
        if getitems is not None:
            scope.at(BATCH, key)
            try:
                samples = list(getitems(indices))
            except Exception as exc:
                shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
                raise _failure(f"the dataset's __getitems__ of sample indices [{shown}]", exc) from None
        else:
            samples = []
            for i in indices:
                scope.at(SAMPLE, i)
                try:
                    samples.append(dataset[i])
                except Exception as exc:
                    raise _failure(f"sample index {i}", exc) from None
        if collate_fn is None:
            return samples
        scope.at(BATCH, key)
        try:
            return collate_fn(samples)
        except Exception as exc:
            raise _failure(f"the collate_fn on the batch at position {position}", exc) from None
    finally:
        leave(previous)


def _get_dataset(ref: Any, described: str) -> Any:
    import ray

    try:
        return ray.get(ref)
    except Exception as exc:
        cause = _innermost(exc)
        raise _TaskFailure(
            "ship",
            f"the dataset ({described}) could not be rebuilt in a Ray worker: "
            f"{type(cause).__name__}: {_first_line(cause)}. {_RUNTIME_ENV_HINT}",
            type(cause).__name__,
        ) from None


def _read(
    ref: Any,
    described: str,
    units: list[tuple[int, list[int]]],
    base_seed: int,
    epoch: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    per_sample: bool,
    rank: int = 0,
) -> Iterator[Any]:
    """A read task: each unit (position, indices) fetched and pickled; one block per unit
    (so that the driver can take each batch as soon as it is made)."""
    dataset = _get_dataset(ref, described)
    getitems = dataset.__getitems__ if fetches_batches(dataset) else None
    for position, indices in units:
        made = _fetch(dataset, getitems, indices, position, base_seed, epoch, collate_fn, rank)
        if per_sample:
            if len(made) != len(indices):
                raise _TaskFailure(
                    "read",
                    f"the dataset's __getitems__ returned {len(made)} samples for {len(indices)} indices",
                )
            yield _block(list(indices), [pickle.dumps(s, protocol=5) for s in made])
        else:
            yield _batch_block(position, made)


def _make_source(work: _Units) -> Any:
    """A ray.data.Datasource whose read tasks each take a contiguous run of the epoch's units."""
    import functools

    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    class _Source(Datasource):
        def get_name(self) -> str:
            return "stoker"

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, *args: Any, **kwargs: Any) -> list[Any]:
            tasks = []
            for units in work.tasks:
                # a batch's rows: its structure and its buffers, known once it is made
                rows = sum(len(i) for _, i in units) if work.per_sample else None
                metadata = BlockMetadata(num_rows=rows, size_bytes=None, input_files=None, exec_stats=None)
                read = functools.partial(
                    _read,
                    work.ref,
                    work.described,
                    units,
                    work.base_seed,
                    work.epoch,
                    work.collate_fn,
                    work.per_sample,
                    work.rank,
                )
                tasks.append(ReadTask(read, metadata))
            return tasks

    return _Source()


def _ray_dataset(work: _Units, in_order: bool = True) -> ray.data.Dataset:
    import ray.data

    dataset = ray.data.read_datasource(_make_source(work), override_num_blocks=len(work.tasks))
    context = dataset.context
    context.execution_options.preserve_order = in_order
    if not work.per_sample:
        # Every table a read task yields (one batch) leaves the task as a block of its own,
        # as soon as it is made. Ray's default (blocks up to 128 MB) merged the batches of a
        # task into one block: the driver waited for whole tasks, one Ray worker did all the
        # work (the others idle), and putting a 5-batch block (48 MB) in the object store took
        # 38 ms against 3.4 ms for each one-batch block (measured here).
        context.target_max_block_size = 1
    return dataset


def _put_dataset(dataset: Any) -> Any:
    import ray

    if not ray.is_initialized():
        ray.init()
    try:
        return ray.put(dataset)
    except Exception as exc:
        cause = _innermost(exc)
        raise ShippingError(
            f"stoker.ray could not pickle the dataset ({_describe_type(dataset)}) to send it to the "
            f"Ray cluster: {type(cause).__name__}: {_first_line(cause)}. A dataset read by Ray must be "
            "picklable: open files, locks, sockets and the like should be opened lazily in the "
            f"workers (in __getitem__), not held by the dataset. {_RUNTIME_ENV_HINT}"
        ) from exc


def _cluster_cpus() -> float:
    import ray

    return float(ray.cluster_resources().get("CPU", 1.0))


def to_ray_dataset(
    dataset: Any,
    indices: Sequence[int] | None = None,
    *,
    read_tasks: int | None = None,
    seed: int = 0,
    epoch: int = 0,
) -> ray.data.Dataset:
    """A Ray Dataset of `dataset`'s samples at `indices`, in that order.

    Each row is {"key": the sample's index, "data": the pickled sample}: `decode(row)` gives
    the sample exactly as the dataset returned it. Each read task fetches a contiguous
    slice of `indices`, with the dataset's `__getitems__` (64 indices a call) when it has
    one, else `__getitem__` per index, under stoker's per-sample seeding for
    (`base_seed_of(seed)`, `epoch`, index). Starts Ray (`ray.init()`) if it is not
    running. A read task that fails raises Ray's error when the rows are read, whose
    message is stoker's (naming the sample index, or saying that the dataset's class
    cannot be imported on the workers).

    Args:
        dataset: The map-style dataset (with `__len__`); it must pickle, and its class
            must be importable on the Ray workers.
        indices: The sample indices to read, in order; None reads them all.
            Defaults to None.
        read_tasks: The number of Ray read tasks (at most one per sample); None chooses
            one for every 40 groups of 64 samples and at least one per cluster CPU
            (`read_task_count`). Defaults to None.
        seed: The loader seed whose `base_seed_of` seeds the samples. Defaults to 0.
        epoch: The epoch of the per-sample seeds. Defaults to 0.

    Returns:
        A lazy `ray.data.Dataset` with one row per index.

    Raises:
        ShippingError: when the dataset cannot be pickled to send it to the cluster.
        ValueError: when `read_tasks` is neither a positive int nor None.
    """
    length = len(dataset)
    chosen = list(range(length)) if indices is None else [int(i) for i in indices]
    ref = _put_dataset(dataset)
    if read_tasks is None:
        count = read_task_count(math.ceil(len(chosen) / SAMPLES_PER_FETCH), _cluster_cpus())
    else:  # as asked, up to one task per sample
        count = read_task_count(len(chosen), 1, read_tasks)
    tasks = _sample_tasks(chosen, count)
    work = _Units(ref, _describe_type(dataset), tasks, base_seed_of(seed), epoch, None, True)
    return _ray_dataset(work)
