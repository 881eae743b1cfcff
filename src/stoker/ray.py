"""stoker on a Ray cluster: a map-style dataset read by Ray Data, batches as stoker gives them.

    driver (this process)                               Ray cluster (any node)
    ---------------------                               ----------------------
    DataLoader.__iter__
      this rank's batches: DistributedSampler
      + BatchSampler, from the saved position
      dataset ──ray.put (once)──────────────────────▶ object store
      _Source(batches) ──read_datasource─────────────▶ read task k: a contiguous run of batches
                                                        ray.get(dataset); for each batch: fetch
                                                        under stoker's per-sample seeding scope,
                                                        collate, pickle ──▶ one Arrow row
      iter_batches(prefetch) ◀── blocks (position, pickled batch) ─┘
      unpickle ──▶ the batch, exactly as the collate_fn made it

Samples cross the cluster pickled inside an Arrow binary column, so they come back as the
very objects the dataset and the collate_fn made (Ray Data would otherwise turn rows into
Arrow columns and change their types). Nothing depends on the state of a Ray worker process:
a read task gets everything it needs (dataset, batches, seeds) as arguments.

`stoker.sample_rng()` / `stoker.sample_seed()` inside a read task give what they give in
stoker's own workers: (base seed, epoch, sample index), the base seed being the one a
`stoker.DataLoader(..., generator=seed)` draws first (see `base_seed_of`).
"""

from __future__ import annotations

import io
import itertools
import math
import pickle
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ._core.fetch import fetches_batches
from ._core.seeding import BATCH, SAMPLE, FetchScope, batch_key, enter, leave
from ._data.collate import default_collate
from ._data.distributed import DistributedSampler
from ._data.rng import RandomSource
from ._data.samplers import BatchSampler
from ._data.torch_collate import _tensor_of

if TYPE_CHECKING:
    import ray.data

__all__ = [
    "DataLoader",
    "ReadError",
    "ShippingError",
    "StreamingSplit",
    "base_seed_of",
    "decode",
    "read_task_count",
    "streaming_split",
    "to_ray_dataset",
]

STATE_VERSION = 1
# How many read tasks: one for every UNITS_PER_TASK batches (to_ray_dataset: groups of
# SAMPLES_PER_FETCH samples), and at least one per CPU of the cluster. Each batch leaves its
# task as a block of its own, so a long task streams its batches; what a task costs is its
# start (~40 ms between one task's last batch and the next task's first, measured). On the
# images workload (3x224x224 uint8, batch 64, an epoch of 80 batches, one node of 2 cores, Ray
# given 2 CPUs), epoch samples/s by task count: 16 tasks 3,837, 8 4,077, 4 4,455, 2 5,013 (one
# `python -m stoker._tools.raybench` run; an earlier sweep, medians of 3: 16 3,154, 8 3,505,
# 4 3,981, 2 4,036). Not fewer than one per CPU: tasks are what Ray spreads over the cluster.
UNITS_PER_TASK = 40
SAMPLES_PER_FETCH = 64  # to_ray_dataset: indices per __getitems__ call (a dataset that has one)
IN_BAND_BYTES = 1 << 16  # a batch's array buffers smaller than this travel inside its pickle
# Keys of a state that may differ from this loader's: an elastic resume (see load_state_dict).
ELASTIC_KEYS = ("world_size", "rank", "total_size")


class ReadError(RuntimeError):
    """The dataset (or the collate_fn) raised inside a Ray read task.

    The message names the sample index (or the batch's indices, for `__getitems__`), the
    original exception's type and message, and the remote traceback; `exc_type` is the name
    of the original exception's type."""

    def __init__(self, message: str, exc_type: str = "") -> None:
        super().__init__(message)
        self.exc_type = exc_type


class ShippingError(RuntimeError):
    """The dataset could not be sent to the Ray cluster (not picklable), or could not be
    rebuilt there (its class or module is not importable on the workers)."""


class _TaskFailure(Exception):
    """Raised in a read task; carries a finished message across Ray's wrappers."""

    def __init__(self, kind: str, message: str, exc_type: str = "") -> None:
        super().__init__(kind, message, exc_type)
        self.kind = kind
        self.message = message
        self.exc_type = exc_type

    def __str__(self) -> str:
        return self.message


# ------------------------------------------------------------------ pure parts


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
    """How many read tasks share `units` batches (or to_ray_dataset's fetch groups):
    `requested` when given, else one for every UNITS_PER_TASK units and at least one per
    cluster CPU; never more than `units`."""
    if requested is not None:
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
            raise ValueError(
                f"read_tasks should be a positive integer or None, but got read_tasks={requested!r}"
            )
        return max(1, min(requested, units))
    by_size = math.ceil(units / UNITS_PER_TASK)
    return max(1, min(max(by_size, int(cluster_cpus)), units))


def base_seed_of(seed: int) -> int:
    """The base seed of `stoker.sample_seed()` / `sample_rng()` for loader seed `seed`: the
    one `stoker.DataLoader(..., generator=seed)` draws for its first iterator when its
    sampler draws nothing from the generator (a DistributedSampler, a SequentialSampler)."""
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
    sampler = _sampler(
        length, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last
    )
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


def config_differences(
    saved: dict[str, Any], current: dict[str, Any], ignore: Sequence[str] = ()
) -> list[str]:
    """'key: saved X, this loader Y' for every key (but those ignored) whose values differ."""
    return [
        f"{key}: saved {saved.get(key)!r}, this loader {current[key]!r}"
        for key in current
        if key not in ignore and saved.get(key) != current[key]
    ]


def _describe_type(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__qualname__} from module {kind.__module__!r}"


_RUNTIME_ENV_HINT = (
    "Every Ray worker must be able to import the dataset's class: install its package on every "
    "node, or ship the code with ray.init(runtime_env={'py_modules': [your_module]}) or "
    "ray.init(runtime_env={'working_dir': '.'}); a class defined in a script's __main__ or in a "
    "test module cannot be imported by the workers unless it is shipped so"
)


# ------------------------------------------------------------------ the read task


def _binary(data: Any) -> Any:
    """A one-row Arrow large_binary array over `data` (bytes-like), not copied."""
    import numpy as np
    import pyarrow as pa

    offsets = pa.py_buffer(np.array([0, memoryview(data).nbytes], np.int64))
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), 1, [None, offsets, pa.py_buffer(data)]
    )


def _block(keys: list[int], payloads: list[bytes]) -> Any:
    """An Arrow table of (key, pickled sample) rows: to_ray_dataset's rows."""
    import pyarrow as pa

    data = pa.chunked_array([_binary(p) for p in payloads], pa.large_binary())
    return pa.table({"key": pa.array(keys, pa.int64()), "data": data})


class _BatchPickler(pickle.Pickler):
    """Pickles a plain CPU torch tensor as the numpy array over its memory, which protocol 5
    sends out of band like any array (torch's own reduction writes the storage's bytes into
    the pickle: 15 ms for a 9.6 MB batch, measured); it comes back a torch tensor."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is None or type(obj) is not torch.Tensor or obj.requires_grad:
            return NotImplemented
        if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_conj() or obj.is_neg():
            return NotImplemented
        try:
            array = obj.numpy()
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, ...)
            return NotImplemented
        return _tensor_of, (array,)  # rebuilt as TensorLeaf's are: torch.from_numpy


def _batch_block(position: int, batch: Any) -> Any:
    """An Arrow table of one batch: the pickle of its structure (protocol 5) with its first
    large array buffer in the first row, each further large buffer in a row of its own.
    Buffers under IN_BAND_BYTES travel inside the pickle. The large buffers are wrapped, not
    copied: the one copy is Ray's, into the object store (an in-band pickle.dumps of a 9.6 MB
    batch took 6.9 ms here, against 0.6 ms for its collate). A batch with one large array
    (images with their labels) is one row, which Ray keeps as one block (see `_ray_dataset`)."""
    import pyarrow as pa

    large: list[pickle.PickleBuffer] = []

    def in_band(buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < IN_BAND_BYTES:
            return True
        large.append(buffer)
        return False

    stream = io.BytesIO()
    _BatchPickler(stream, protocol=5, buffer_callback=in_band).dump(batch)
    header = stream.getvalue()
    parts: list[Any] = [b.raw() for b in large] or [b""]
    return pa.table(
        {
            "key": pa.array([position] * len(parts), pa.int64()),
            "part": pa.array(range(len(parts)), pa.int32()),
            "header": pa.chunked_array(
                [_binary(header)] + [_binary(b"")] * (len(parts) - 1), pa.large_binary()
            ),
            "data": pa.chunked_array([_binary(p) for p in parts], pa.large_binary()),
        }
    )


def _failure(where: str, exc: BaseException) -> _TaskFailure:
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return _TaskFailure(
        "read",
        f"{where} raised {type(exc).__name__}: {exc} (in a Ray read task of stoker.ray)\n\n"
        f"The read task's traceback:\n{text}",
        type(exc).__name__,
    )


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
                raise _failure(
                    f"the dataset's __getitems__ of sample indices [{shown}]", exc
                ) from None
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


def _batch_tasks(
    units: list[tuple[int, list[int]]], tasks: int
) -> list[list[tuple[int, list[int]]]]:
    """`units` cut into `tasks` contiguous runs."""
    return [units[start:stop] for start, stop in contiguous_slices(len(units), tasks)]


def _sample_tasks(indices: list[int], tasks: int) -> list[list[tuple[int, list[int]]]]:
    """`indices` cut into `tasks` contiguous slices, each fetched SAMPLES_PER_FETCH at a time;
    a unit's position is the offset of its first index in `indices`."""
    made = []
    for start, stop in contiguous_slices(len(indices), tasks):
        made.append(
            [
                (k, indices[k : min(k + SAMPLES_PER_FETCH, stop)])
                for k in range(start, stop, SAMPLES_PER_FETCH)
            ]
        )
    return made


def _make_source(plan: _Units) -> Any:
    """A ray.data.Datasource whose read tasks each take a contiguous run of the plan's units."""
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
            for units in plan.tasks:
                # a batch's rows: its structure and its buffers, known once it is made
                rows = sum(len(i) for _, i in units) if plan.per_sample else None
                metadata = BlockMetadata(
                    num_rows=rows, size_bytes=None, input_files=None, exec_stats=None
                )
                read = functools.partial(
                    _read,
                    plan.ref,
                    plan.described,
                    units,
                    plan.base_seed,
                    plan.epoch,
                    plan.collate_fn,
                    plan.per_sample,
                    plan.rank,
                )
                tasks.append(ReadTask(read, metadata))
            return tasks

    return _Source()


def _ray_dataset(plan: _Units, in_order: bool = True) -> ray.data.Dataset:
    import ray.data

    dataset = ray.data.read_datasource(_make_source(plan), override_num_blocks=len(plan.tasks))
    context = dataset.context
    context.execution_options.preserve_order = in_order
    if not plan.per_sample:
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


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def _innermost(exc: BaseException) -> BaseException:
    """The original exception under Ray's wrappers (`cause`, `__cause__`)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc


def _task_failure(exc: BaseException) -> _TaskFailure | None:
    seen = set()
    stack: list[Any] = [exc]
    while stack:
        current = stack.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, _TaskFailure):
            return current
        stack.extend([getattr(current, "cause", None), current.__cause__, current.__context__])
    return None


def _explained(exc: BaseException) -> BaseException | None:
    """stoker's own error for a failure inside a read task, or None when it is not one."""
    failure = _task_failure(exc)
    if failure is None:
        return None
    if failure.kind == "ship":
        return ShippingError(failure.message)
    return ReadError(failure.message, failure.exc_type)


def _cluster_cpus() -> float:
    import ray

    return float(ray.cluster_resources().get("CPU", 1.0))


def _column_values(column: Any) -> Iterator[Any]:
    """The values of a large_binary column as buffers over the block's memory, not copied."""
    import numpy as np

    for chunk in column.chunks:
        # slices of the chunk's data buffer: `chunk[i]` makes a scalar, which took ~3.5 ms for
        # a 9.6 MB value (pyarrow 26, measured)
        _, offsets, data = chunk.buffers()
        bounds = np.frombuffer(offsets, np.int64)[
            chunk.offset : chunk.offset + len(chunk) + 1
        ].tolist()
        for start, stop in itertools.pairwise(bounds):
            yield data.slice(start, stop - start)


def _copied(buffer: Any) -> Any:
    """A writable copy of `buffer`, as a flat uint8 array."""
    import numpy as np

    return np.frombuffer(buffer, np.uint8).copy()


class _BatchRows:
    """Turns blocks of `_batch_block` rows back into batches; a batch whose rows Ray split over
    two blocks is finished with the next block."""

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.position = -1

    def _made(self) -> tuple[int, Any]:
        header, *buffers = self.pending
        self.pending = []
        # each large buffer is copied once, out of the object store, so that the batch is
        # writable and owns its memory; numpy's copy lets go of the GIL (Ray Data's threads in
        # this process go on meanwhile), bytearray's does not
        return self.position, pickle.loads(header, buffers=[_copied(b) for b in buffers])

    def feed(self, table: Any) -> Iterator[tuple[int, Any]]:
        """The batches (position, batch) that `table` completes."""
        keys = table.column("key").to_pylist()
        parts = table.column("part").to_pylist()
        rows = zip(
            keys,
            parts,
            _column_values(table.column("header")),
            _column_values(table.column("data")),
        )
        for key, part, header, data in rows:
            if part == 0:
                if self.pending:
                    yield self._made()
                self.pending, self.position = [header], key
            if data.size:
                self.pending.append(data)

    def finish(self) -> Iterator[tuple[int, Any]]:
        """The last batch, at the end of the stream."""
        if self.pending:
            yield self._made()


def decode(value: Any) -> Any:
    """The sample of a `to_ray_dataset` row (the row itself, or its "data" value)."""
    if isinstance(value, dict):
        value = value["data"]
    return pickle.loads(value)


def to_ray_dataset(
    dataset: Any,
    indices: Sequence[int] | None = None,
    *,
    read_tasks: int | None = None,
    seed: int = 0,
    epoch: int = 0,
) -> ray.data.Dataset:
    """A Ray Dataset of `dataset`'s samples at `indices` (default: all), in that order.

    Each row is {"key": the sample's index, "data": the pickled sample}: `decode(row)` gives
    the sample exactly as the dataset returned it. Read tasks (`read_tasks`, default
    `read_task_count`) each fetch a contiguous slice of `indices`, with the dataset's
    `__getitems__` (64 indices a call) when it has one, else `__getitem__` per index, under
    stoker's per-sample seeding for (`base_seed_of(seed)`, `epoch`, index). Starts Ray
    (`ray.init()`) if it is not running. Raises ShippingError when the dataset cannot be
    pickled; a read task that fails raises Ray's error, whose message is stoker's (naming the
    sample index, or saying that the dataset's class cannot be imported on the workers)."""
    length = len(dataset)
    chosen = list(range(length)) if indices is None else [int(i) for i in indices]
    ref = _put_dataset(dataset)
    if read_tasks is None:
        count = read_task_count(math.ceil(len(chosen) / SAMPLES_PER_FETCH), _cluster_cpus())
    else:  # as asked, up to one task per sample
        count = read_task_count(len(chosen), 1, read_tasks)
    tasks = _sample_tasks(chosen, count)
    plan = _Units(ref, _describe_type(dataset), tasks, base_seed_of(seed), epoch, None, True)
    return _ray_dataset(plan)


# ------------------------------------------------------------------ the loader


def _resolve_seed(seed: int | None, world_size: int) -> tuple[int, bool]:
    """(the seed, whether it was agreed rather than given)."""
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed should be an integer or None, but got seed={seed!r}")
        return seed, False
    from ._data.distributed import agreed_seed

    return int(agreed_seed(world_size)), True


def _check_int(value: Any, name: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} should be an integer >= {low}, but got {name}={value!r}")
    return value


class DataLoader:
    """This rank's batches of a map-style dataset, fetched and collated by Ray Data read tasks.

    Rank `rank` of `world_size` gets exactly the batches that `stoker.DistributedSampler(
    dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
    drop_last=drop_last)` with `set_epoch(epoch)` and `stoker.BatchSampler(sampler,
    batch_size, drop_last)` give it: `drop_last` goes to both, as torch users pass it.
    Batches are collated by `collate_fn` (default `stoker.default_collate`: numpy; use
    `stoker.torch.default_collate` for torch tensors) inside the read tasks.

    `seed=None` asks `stoker._data.distributed.agreed_seed(world_size)` for one seed all ranks
    share (broadcast from rank 0 when torch.distributed is initialised; a fresh one when
    world_size is 1; a ValueError otherwise); a state loaded into such a loader brings its seed. `stoker.sample_rng()` in the dataset draws what it draws under
    `stoker.DataLoader(..., generator=seed, persistent_workers=True)` over the same sampler
    with set_epoch(epoch) = the loader's epoch count.

    `in_order=True` delivers the sampler's order; `in_order=False` lets a batch made early
    overtake one made late within the prefetch window, and such a loader is not exactly
    resumable: its `state_dict()` raises ValueError. `prefetch_batches` is Ray Data's count of
    blocks (batches) fetched ahead; `read_tasks` overrides `read_task_count`.

    `state_dict()` / `load_state_dict()` resume exactly mid-epoch; a state saved under another
    world size (or rank) resumes elastically: the samples no old rank consumed are split over
    the new ranks (`DistributedSampler.resume_elastic`). Starts Ray (`ray.init()`) if it is
    not running.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        shuffle: bool = False,
        seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefetch_batches: int = 2,
        in_order: bool = True,
        read_tasks: int | None = None,
    ) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"stoker.ray.DataLoader takes a map-style dataset (with __len__ and __getitem__), "
                f"got {_describe_type(dataset)}"
            )
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        self.world_size = _check_int(world_size, "world_size", 1)
        rank = _check_int(rank, "rank", 0)
        if rank >= world_size:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {world_size - 1}]"
            )
        self.rank = rank
        self.prefetch_batches = _check_int(prefetch_batches, "prefetch_batches", 0)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("in_order", in_order)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} should be a boolean value, but got {name}={flag!r}")
        if read_tasks is not None:
            read_task_count(1, 1, read_tasks)  # checks the value
        self.dataset = dataset
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.in_order = in_order
        self.read_tasks = read_tasks
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.seed, self._seed_agreed = _resolve_seed(seed, world_size)
        self.epoch = 0
        self._position = 0  # batches of the current epoch delivered (or skipped by a resume)
        self._elastic: tuple[int, int, int] | None = None  # the current epoch's elastic origin
        self._resumed = False  # a loaded state waits for the next iteration
        self._ref: Any = None
        self._lock = threading.Lock()

    # -------------------------------------------------------------- epochs
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration gives (shuffle is seeded with seed + epoch)."""
        epoch = _check_int(epoch, "epoch", 0)
        if epoch != self.epoch:  # a loaded state was for another epoch: it no longer applies
            self._position = 0
            self._elastic = None
            self._resumed = False
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        return list(self._batch_sampler())

    def _rank_sampler(self) -> DistributedSampler:
        """This rank's DistributedSampler (at epoch 0)."""
        return _sampler(
            len(self.dataset),
            shuffle=self.shuffle,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
        )

    def _batch_sampler(self) -> BatchSampler:
        """This rank's batches of the current epoch (the rest of an elastic epoch, when one is
        being resumed), as `rank_batches` gives them."""
        sampler = self._rank_sampler()
        sampler.set_epoch(self.epoch)
        if self._elastic is not None:
            sampler.resume_elastic(*self._elastic)
        return BatchSampler(sampler, self.batch_size, self.drop_last)

    def __len__(self) -> int:
        """This rank's batches in the current epoch (the rest of an elastic epoch, when one is
        being resumed)."""
        return len(self._batch_sampler())

    def __iter__(self) -> Iterator[Any]:
        """The current epoch's batches for this rank: all of them, or, right after
        `load_state_dict`, those the saved run had not delivered."""
        resumed, self._resumed = self._resumed, False
        if not resumed:
            self._position = 0
            self._elastic = None
        batches = self._batches()
        start = self._position
        if start >= len(batches):
            return
        if self._ref is None:
            self._ref = _put_dataset(self.dataset)
        units = list(enumerate(batches))[start:]
        tasks = _batch_tasks(units, read_task_count(len(units), _cluster_cpus(), self.read_tasks))
        plan = _Units(
            self._ref,
            _describe_type(self.dataset),
            tasks,
            base_seed_of(self.seed),
            self.epoch,
            self.collate_fn,
            False,
            self.rank,
        )
        yield from self._deliver(_ray_dataset(plan, self.in_order), start)

    def _deliver(self, dataset: ray.data.Dataset, start: int) -> Iterator[Any]:
        expected = start
        blocks = iter(
            dataset.iter_batches(
                batch_size=None, batch_format="pyarrow", prefetch_batches=self.prefetch_batches
            )
        )
        rows = _BatchRows()
        try:
            while True:
                try:
                    table = next(blocks)
                    made = rows.feed(table)
                except StopIteration:
                    made = rows.finish()
                    table = None
                except Exception as exc:
                    explained = _explained(exc)
                    if explained is None:
                        raise
                    raise explained from exc
                for position, batch in made:
                    if self.in_order and position != expected:
                        raise RuntimeError(
                            f"stoker.ray: expected the batch at position {expected}, Ray Data delivered {position}"
                        )
                    expected += 1
                    self._position += 1
                    yield batch
                if table is None:
                    break
        finally:
            close = getattr(blocks, "close", None)
            if close is not None:
                close()

    # -------------------------------------------------------------- state
    def _config(self) -> dict[str, Any]:
        sampler = self._rank_sampler()
        return {
            "dataset_length": len(self.dataset),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "world_size": self.world_size,
            "rank": self.rank,
            "total_size": sampler.total_size,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch and the batches of it delivered; raises ValueError for
        a loader with in_order=False (its delivery order is not the sampler's)."""
        if not self.in_order:
            raise ValueError(
                "stoker.ray.DataLoader(in_order=False) is not exactly resumable: batches made early "
                "may have overtaken others, so a position does not say which were delivered; use "
                "in_order=True to save states"
            )
        return {
            "version": STATE_VERSION,
            "loader": "stoker.ray.DataLoader",
            "config": self._config(),
            "epoch": self.epoch,
            "position": self._position,
            "elastic": list(self._elastic) if self._elastic is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a `state_dict()`: the next iteration yields exactly the batches that were
        not yet delivered. A state of another world size (or rank) resumes elastically. Raises
        ValueError, applying nothing, for a state of another configuration (naming what
        differs) or of another kind."""
        if not isinstance(state, dict) or state.get("loader") != "stoker.ray.DataLoader":
            raise ValueError(
                "load_state_dict expects a dict made by stoker.ray.DataLoader.state_dict()"
            )
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"this stoker.ray state has version {state.get('version')!r}; this stoker reads version {STATE_VERSION}"
            )
        saved = dict(state["config"])
        config = self._config()
        ignore: list[str] = list(ELASTIC_KEYS)
        seed = self.seed
        if self._seed_agreed:  # no seed was given: the saved run's seed is the one to go on with
            ignore.append("seed")
            seed = saved["seed"]
        differ = config_differences(saved, config, ignore)
        if differ:
            raise ValueError(
                "this stoker.ray.DataLoader state comes from another configuration and was not applied; "
                + "; ".join(differ)
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        saved_elastic: tuple[int, int, int] | None = None
        if state.get("elastic") is not None:
            consumed, replicas, total = state["elastic"]
            saved_elastic = (int(consumed), int(replicas), int(total))
        elastic = saved_elastic
        if saved["world_size"] != self.world_size or saved["rank"] != self.rank:
            if saved_elastic is not None and position > 0:
                raise ValueError(
                    "this stoker.ray.DataLoader state was saved part-way through an epoch that was "
                    "itself resumed from another world size; it can be resumed with the world size "
                    f"and rank it was saved with (world_size={saved['world_size']}, rank={saved['rank']}), "
                    f"not with world_size={self.world_size}, rank={self.rank}"
                )
            if saved_elastic is None:
                elastic = (
                    position * self.batch_size,
                    int(saved["world_size"]),
                    int(saved["total_size"]),
                )
            position = 0
        self.seed = seed
        self.epoch = epoch
        self._elastic = elastic
        self._position = position
        self._resumed = True

    def close(self) -> None:
        """Release the dataset's copy in Ray's object store (the loader can still iterate: it
        is sent again)."""
        self._ref = None


# ------------------------------------------------------------------ streaming_split


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
