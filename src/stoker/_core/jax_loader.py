"""stoker.jax's `DataLoader`: stoker's loader (numpy batches, the same samples in the same order)
whose batches come out as `jax.Array`s of the global batch, laid out by a sharding.

Every process draws the same global batches (the sampler is a function of the seed and the
epoch); each loads only the rows of them that its own devices hold (`LoadPlan.take_rows` cuts
every batch of indices before a worker sees it), and the global arrays are assembled from the
processes' parts by JAX (`jax_place.Layout`). So the loader's state is the same in every
process, and resumes on any number of processes, devices or workers.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

from .._base.checks import check_int, fail
from .._data.datasets import Dataset, is_iterable_dataset
from .._data.rng import GeneratorLike
from . import loader as _loader
from .device import DeviceIterator
from .jax_place import JaxCopier, Layout, default_sharding, import_jax
from .plan import LoadPlan

T_co = TypeVar("T_co", covariant=True)

DEFAULT_PREFETCH = 2
STATE_KEY = "jax"  # this face's part of a state: how the rows were split, checked on load


class DataLoader(_loader.DataLoader[T_co]):
    """`stoker.DataLoader` whose batches are `jax.Array`s on a device mesh.

    The same samples, in the same order, collated the same way as `stoker.DataLoader` with the
    same arguments; then every numeric leaf of a batch becomes a `jax.Array` of the global
    batch's shape with `sharding` (leaves of rank 0 replicated; a `NamedSharding`'s spec is
    cut to a leaf's rank, so `P("data")` splits every leaf's first axis). Leaves that are not
    numbers (lists of strings, objects) are passed through unchanged. `batch_size` is the
    global batch.

    In a multi-process JAX program (`jax.distributed.initialize()`), every process draws the
    same global batches and loads only the rows its own devices hold; the arrays are made with
    `jax.make_array_from_process_local_data`. Nothing is loaded twice and nothing is sent
    between processes. An IterableDataset there is read by each process on its own (split it by
    `jax.process_index()`): each process's stream gives its own rows, `batch_size` then counting
    a process's rows, and a state resumes only on the same processes.

    Worker processes start with "forkserver" by default (`multiprocessing_context=None`), never
    forked from a process whose JAX runtime runs threads; they never start JAX's backend (they
    import jax only if the main script does: forkserver imports what the script imports). A
    script that starts workers needs the `if __name__ == "__main__":` guard, as with spawn.

    In a multi-process program give `generator` (the same seed in every process): every process
    draws the global batches, and draws from each process's own global RNG would differ (with
    `shuffle=True` a missing generator is refused; without it, per-sample random draws, through
    `stoker.sample_rng`, would differ between the processes' rows).

    Args:
        dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
        drop_last, timeout, worker_init_fn, generator: As `stoker.DataLoader`'s;
            `batch_size` is the global batch, which must be divisible by the number of pieces
            `sharding` cuts the batch axis into (and so must a last, shorter batch, unless
            `drop_last=True`).
        multiprocessing_context: As `stoker.DataLoader`'s, except that None starts worker
            processes with "forkserver". Defaults to None.
        sharding: A `jax.sharding.Sharding` for the batch's leaves. None: the batch axis split
            over every device (`jax.devices()`) of a 1-D mesh with the axis "data". Defaults
            to None.
        device_prefetch: How many batches are placed on the devices ahead of the one the
            consumer holds (their transfers run while the step does); 0 places each batch when
            it is asked for. A batch's host memory (its shared-memory slot) is kept until its
            transfers are done. Defaults to 2.
        process_index: This process's place among `process_count`, for processes that each run
            JAX on their own (no `jax.distributed`): each loads its even share of every global
            batch, placed on its own devices. None: `jax.process_index()`. Defaults to None.
        process_count: See `process_index`; given together. None: `jax.process_count()`.
            Defaults to None.
        **options: stoker.DataLoader's keyword-only arguments (`prefetch_factor`,
            `persistent_workers`, `in_order`, `last_batch`, `snapshot_every_n_steps`, `stats`,
            ...); `pin_memory` is torch's and refused.

    Raises:
        TypeError: when `sharding` is not a `jax.sharding.Sharding`, `device_prefetch`,
            `process_index` or `process_count` is not an int, or another argument is of a type
            `stoker.DataLoader` refuses.
        ValueError: when `batch_size` (or a last, shorter batch with `drop_last=False`) is not
            divisible by the pieces of the batch axis, `sharding` uses no device this process
            can address, `device_prefetch` < 0, only one of `process_index`/`process_count` is
            given or they are out of range or contradict JAX's, `shuffle=True` without a
            `generator` in a program of several processes, `pin_memory` is set, or an
            argument breaks `stoker.DataLoader`'s rules. At a batch: leaves with different
            numbers of rows (a ValueError naming them).
    """

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | Literal["auto"] = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
        generator: GeneratorLike = None,
        *,
        sharding: Any = None,
        device_prefetch: int = DEFAULT_PREFETCH,
        process_index: int | None = None,
        process_count: int | None = None,
        **options: Any,
    ) -> None:
        jax = import_jax()
        if options.pop("pin_memory", False):
            raise ValueError(
                "pin_memory is torch's; stoker.jax places batches on the devices itself "
                "(sharding=, device_prefetch=): leave pin_memory unset"
            )
        self.device_prefetch = int(check_int("device_prefetch", device_prefetch, low=0, unit="batches"))
        self.sharding = default_sharding(jax) if sharding is None else sharding
        if not isinstance(self.sharding, jax.sharding.Sharding):
            fail(
                TypeError, "sharding", "a jax.sharding.Sharding (e.g. NamedSharding(mesh, P('data'))) or None", sharding
            )
        if not self.sharding.addressable_devices:
            raise ValueError(
                f"sharding {self.sharding} uses no device this process (jax.process_index() "
                f"{jax.process_index()}) can address; give a sharding over a mesh that includes this process's devices"
            )
        own = _own_rows(jax, process_index, process_count)
        if generator is None and shuffle and (jax.process_count() > 1 or own is not None):
            raise ValueError(
                "generator should be given (an int seed, the same in every process) when several processes "
                "load one global batch: each draws the batches itself, and draws from each process's own "
                "global RNG would differ (samples read twice or never)"
            )
        self.process_index = jax.process_index() if own is None else own[0]
        self.process_count = jax.process_count() if own is None else own[1]
        self._layout = Layout(self.sharding, multiprocess=jax.process_count() > 1, own_rows=own)
        if multiprocessing_context is None and num_workers != 0 and not options.get("thread_pool"):
            multiprocessing_context = "forkserver"
        self._delivered = Delivered()  # the current epoch's state after the batch last handed over
        # an IterableDataset read by several processes: each stream gives its process's rows
        self._iterable_share = is_iterable_dataset(dataset) and (self._layout.multiprocess or own is not None)
        given_batch = batch_size
        if self._iterable_share and isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > 0:
            self._layout.check_batch(batch_size)
            start, stop = self._layout.rows(batch_size)
            batch_size = stop - start
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            False,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            **options,
        )
        if not self._auto_collation:
            raise ValueError(
                "stoker.jax.DataLoader lays out batches: give batch_size (or a batch_sampler), not batch_size=None"
            )
        global_batch = given_batch if self._iterable_share else self.batch_size
        if global_batch is None:
            global_batch = getattr(self.batch_sampler, "batch_size", None)
        if global_batch is not None:
            self._layout.check_batch(int(global_batch))
            self._check_last_batch(int(global_batch))
        self._global_batch = global_batch

    def _check_last_batch(self, batch_size: int) -> None:
        """A last, shorter batch that the sharding cannot cut: refused now, naming drop_last."""
        if self._iterable or self.drop_last or self.batch_sampler is None:
            return
        try:
            count = len(self.sampler)  # type: ignore[arg-type]
        except TypeError:
            return  # checked at that batch
        if type(self.batch_sampler).__name__ != "BatchSampler" or getattr(self, "last_batch", None) == "rollover":
            return
        last = count % batch_size
        if last:
            try:
                self._layout.check_batch(last, "the last batch's length")
            except ValueError as error:
                raise ValueError(
                    f"{error}: the {count} samples make a last batch of {last}; pass drop_last=True, "
                    f"or a batch_size that divides {count}"
                ) from None

    # ------------------------------------------------------------------ the rows
    def _take_rows(self) -> Callable[[Any], Any] | None:
        """The function that cuts a global batch of indices to this process's rows."""
        if self._iterable or (not self._layout.multiprocess and self._layout.own_rows is None):
            return None
        layout = self._layout

        def take(indices: Any) -> Any:
            start, stop = layout.rows(len(indices))
            return list(indices)[start:stop]

        return take

    def _plan(
        self, resume: dict[str, Any] | None = None, replicas: Sequence[Any] = (), restore: bool = False
    ) -> LoadPlan:
        return dataclasses.replace(super()._plan(resume, replicas, restore), take_rows=self._take_rows())

    def _global_rows(self, batch: Any) -> int | None:
        """The global batch length a process's part of `batch` belongs to (None: the arrays
        are this process's alone)."""
        if not self._layout.multiprocess:
            return None
        local = _rows_of(batch)
        if local is None or self._iterable_share or self._global_batch is None:
            return None if local is None else local * self._layout.parts // self._layout.own_parts
        start, stop = self._layout.rows(int(self._global_batch))
        return local * int(self._global_batch) // (stop - start)

    # -------------------------------------------------------------- iteration
    def __iter__(self) -> JaxIterator:  # type: ignore[override]
        """Start an epoch (see `stoker.DataLoader.__iter__`): an iterator over its batches of
        `jax.Array`s, `device_prefetch` of them placed ahead."""
        self._delivered = Delivered()
        return JaxIterator(self, super().__iter__(), self._delivered)

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Where this loader is (see `stoker.DataLoader.state_dict`): after the last batch
        handed to the consumer, whatever `device_prefetch` placed ahead. Every process of a
        multi-process program holds the same state (except with an IterableDataset, whose
        streams are each process's own).

        Returns:
            The state: a dict, with stoker.DataLoader's keys and "jax" (how the rows were split).

        Raises:
            RuntimeError, TypeError: as `stoker.DataLoader.state_dict`.
        """
        # batches placed ahead were drawn from the core loader, whose own state counts them
        # (also after a `break` or a dropped iterator: the holder outlives the iterator)
        state = None if self._delivered.done else self._delivered.state
        if state is None:
            state = super().state_dict()
        return dict(state, **{STATE_KEY: self._split()})

    def _split(self) -> dict[str, Any]:
        per_process = self._iterable_share
        return {
            "rows": "per_process" if per_process else "global",
            "process_count": self.process_count,
            "process_index": self.process_index,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` (see `stoker.DataLoader.load_state_dict`): also one
        saved on another number of processes, devices or workers, or by `stoker.DataLoader`,
        except where each process read its own stream (an IterableDataset), which resumes only
        on the same processes.

        Args:
            state: What `state_dict()` returned (in any process).

        Raises:
            ValueError: when the state is from another configuration (as `stoker.DataLoader`'s
                refuses it), or its streams were split over other processes; the message says
                what differs, and nothing is applied.
        """
        if not isinstance(state, dict):
            fail(TypeError, "state", "a dict returned by DataLoader.state_dict()", state)
        split = state.get(STATE_KEY)
        here = self._split()
        if split is not None and (split.get("rows") == "per_process" or here["rows"] == "per_process"):
            for key in ("rows", "process_count", "process_index"):
                if split.get(key) != here[key]:
                    raise ValueError(
                        f"this DataLoader state is of another mesh configuration: {key} is "
                        f"{split.get(key)!r} in the state and {here[key]!r} here; each process read its own "
                        "stream, so it resumes only on the same processes. The state was not applied"
                    )
        super().load_state_dict({k: v for k, v in state.items() if k != STATE_KEY})
        self._delivered = Delivered()

    def __repr__(self) -> str:
        return f"stoker.jax.DataLoader(batch_size={self.batch_size}, sharding={self.sharding})"


def _rows_of(batch: Any) -> int | None:
    """The number of rows of the first leaf of rank >= 1 in `batch`, or None."""
    import numpy as np

    if isinstance(batch, np.ndarray) and batch.ndim:
        return int(batch.shape[0])
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _rows_of(item)
            if found is not None:
                return found
    return None


def _own_rows(jax: Any, process_index: Any, process_count: Any) -> tuple[int, int] | None:
    """(index, count) when the user placed this process, checked; None to follow JAX."""
    if process_index is None and process_count is None:
        return None
    if process_index is None or process_count is None:
        raise ValueError("process_index and process_count are given together, or neither (to follow JAX)")
    count = int(check_int("process_count", process_count, low=1, unit="processes"))
    index = int(check_int("process_index", process_index, low=0, unit="the place of this process"))
    if index >= count:
        raise ValueError(f"process_index should be below process_count ({count}), but got {index}")
    if jax.process_count() > 1:
        if (index, count) != (jax.process_index(), jax.process_count()):
            raise ValueError(
                f"process_index={index} and process_count={count} contradict JAX's "
                f"({jax.process_index()} of {jax.process_count()}, from jax.distributed): leave them None"
            )
        return None
    return (index, count) if count > 1 else None


class Delivered:
    """What a loader knows of its current epoch's delivery: the core loader's state after the
    batch last handed over (None: none was, or nothing was drawn ahead of it), and whether the
    epoch has ended (then the core loader's own state is the right one)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None
        self.done = False


class JaxIterator:
    """One epoch of a `stoker.jax.DataLoader`: its batches as `jax.Array`s, placed ahead."""

    def __init__(self, loader: DataLoader[Any], base: Iterator[Any], delivered: Delivered) -> None:
        self._base = base
        self._delivered = delivered
        self._length = _length_of(base)
        self._copier: JaxCopier | None = None
        self._device: DeviceIterator[Any] | None = None
        self._layout = loader._layout
        self._global_rows = loader._global_rows
        if loader.device_prefetch > 0:
            snapshot = _loader.DataLoader.state_dict

            def drawn() -> Iterator[tuple[Any, Any]]:
                # the loader's state after each batch drawn: what state_dict() reports once
                # that batch is the last one handed over
                for batch in base:
                    yield batch, snapshot(loader)

            self._copier = JaxCopier(loader._layout, loader._global_rows, delivered)
            self._device = DeviceIterator(drawn(), self._copier, loader.device_prefetch)

    def __iter__(self) -> JaxIterator:
        return self

    def __next__(self) -> Any:
        try:
            if self._device is not None:
                return next(self._device)
            batch = next(self._base)
            placed = self._layout.place(batch, self._global_rows(batch))
            return placed
        except StopIteration:
            self._delivered.done = True
            raise

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this epoch's length is unknown (the dataset has no len())")
        return self._length

    def close(self) -> None:
        """Wait for the transfers in flight and let their host batches go."""
        if self._device is not None:
            self._device.close()
        close = getattr(self._base, "close", None)
        if close is not None and not getattr(self._base, "_persistent", False):
            close()


def _length_of(base: Iterable[Any]) -> int | None:
    try:
        return len(base)  # type: ignore[arg-type]
    except TypeError:
        return None
