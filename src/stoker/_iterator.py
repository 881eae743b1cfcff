"""The loader iterator: epochs, the engine, the scheduler, errors and shutdown.

`iter_loader(loader)` picks the engine once (serial, threads or processes) and returns a
`LoaderIterator`. Each `__next__` refills the prefetch window, hands out the next batch the
scheduler releases, and otherwise waits on the engine — in slices, so that a dead worker is
seen within a second and `timeout` is honoured.

With `persistent_workers`, the loader keeps one iterator and `iter(loader)` starts its
next epoch. When the current epoch's last index has been dispatched, the next epoch's
first batches are dispatched at once (next-epoch prefetch), unless the sampler has
`set_epoch` — it must see the new epoch before it is read.

The iterator holds no reference to the loader, and its engine is closed by a
`weakref.finalize`, so workers stop when the iterator is exhausted (non-persistent),
dropped, garbage-collected, closed, or at interpreter exit.
"""

from __future__ import annotations

import math
import multiprocessing
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ._engines import ProcessEngine, SerialEngine, ThreadEngine
from ._errors import WorkerDiedError, describe_index
from ._protocol import Done, Failed
from ._scheduler import Scheduler
from ._worker import WorkerConfig

T = TypeVar("T")

WAIT_SLICE_S = 0.5  # longest single wait on the engine; bounds how late a dead thread is seen


@dataclass(frozen=True)
class _Plan:
    """What the iterator needs from the loader, read once."""

    dataset: Any
    dataset_kind: str
    auto_collation: bool
    index_sampler: Any
    collate_fn: Any
    drop_last: bool
    batch_size: int | None
    num_workers: int
    window: int
    persistent: bool
    timeout: float
    worker_init_fn: Any
    context: Any
    in_order: bool
    pin_memory: bool
    threads: bool
    flavour: str
    len_called: int | None
    arena: Any  # the loader's shared-memory arena (process workers), else None

    @classmethod
    def of(cls, loader: Any) -> _Plan:
        workers = loader.num_workers
        prefetch = loader.prefetch_factor if workers > 0 else 1
        return cls(
            dataset=loader.dataset,
            dataset_kind=loader._dataset_kind,
            auto_collation=loader._auto_collation,
            index_sampler=loader._index_sampler,
            collate_fn=loader.collate_fn,
            drop_last=loader.drop_last,
            batch_size=loader.batch_size,
            num_workers=workers,
            window=max(1, prefetch * max(workers, 1)),
            persistent=bool(loader.persistent_workers) and workers > 0,
            timeout=float(loader.timeout or 0),
            worker_init_fn=loader.worker_init_fn,
            context=loader.multiprocessing_context,
            in_order=loader.in_order,
            pin_memory=loader.pin_memory,
            threads=bool(getattr(loader, "thread_pool", False)),
            flavour=loader._flavour,
            len_called=loader._iterable_len_called,
            arena=loader._shared_memory() if workers > 0 and not getattr(loader, "thread_pool", False) else None,
        )

    @property
    def iterable(self) -> bool:
        return self.dataset_kind == "iterable"


def iter_loader(loader: Any) -> LoaderIterator[Any]:
    """`iter(loader)`: a new iterator, or the next epoch of the persistent one."""
    persistent = loader.persistent_workers and loader.num_workers > 0
    if persistent:
        current = loader._iterator
        if current is not None and current._usable():
            current._start_next_epoch()
            return current
    iterator: LoaderIterator[Any] = LoaderIterator(loader)
    if persistent:
        loader._iterator = iterator
    return iterator


def _seed_source(loader: Any) -> Any:
    source = loader.__dict__.get("_seed_source")
    if source is None:
        from ._rng import RandomSource

        source = RandomSource(loader.generator, loader._flavour)
        loader.__dict__["_seed_source"] = source
    return source


class LoaderIterator(Generic[T]):
    """Iterates one loader's batches; with persistent workers, across epochs."""

    def __init__(self, loader: Any) -> None:
        plan = self._plan = _Plan.of(loader)
        # The sampler's iterator exists before the workers' base seed is drawn, as in torch,
        # so a shared generator is consumed in the same order.
        first_source = None if plan.iterable else iter(plan.index_sampler)
        self._base_seed = int(_seed_source(loader).seed64())
        self._broken: BaseException | None = None
        self._yielded = 0
        self._prefetch_next = plan.persistent and not _has_set_epoch(plan.index_sampler)
        if plan.pin_memory:
            if getattr(loader, "pin_memory_device", ""):
                warnings.warn(
                    "pin_memory_device is deprecated, the current accelerator will be used as "
                    f"the device, ignore pin_memory_device='{loader.pin_memory_device}'.",
                    stacklevel=3,
                )
            self._pin = _pin_function(loader)
        else:
            self._pin = None
        if plan.num_workers > 0:
            from ._loader import warn_if_too_many_workers

            warn_if_too_many_workers(plan.num_workers)
        self._engine = _make_engine(plan, self._base_seed)
        self._close = weakref.finalize(self, self._engine.close)
        iterable_index: dict[str, Any] = {}
        if plan.iterable:
            iterable_index["iterable_index"] = plan.batch_size if plan.auto_collation else None
        workers = max(plan.num_workers, 1)
        self._scheduler = Scheduler(workers, plan.window, plan.in_order, **iterable_index)
        self._scheduler.begin_epoch(first_source)
        self._pump()

    # --------------------------------------------------------------- epochs
    def _usable(self) -> bool:
        return self._broken is None and self._close.alive

    def _start_next_epoch(self) -> None:
        """`iter(loader)` again on a persistent loader: start (or adopt) the next epoch."""
        self._yielded = 0
        scheduler = self._scheduler
        if scheduler.current_epoch is not None and self._started_current:
            scheduler.abandon_epoch()  # dropped half-way: its results are discarded
        if scheduler.current_epoch is None:
            self._begin_epoch()
        self._started_current = True
        self._pump()

    def _begin_epoch(self) -> None:
        plan = self._plan
        source = None if plan.iterable else iter(plan.index_sampler)
        self._scheduler.begin_epoch(source, reset_workers=plan.iterable)

    _started_current = True

    # ------------------------------------------------------------- iteration
    def __iter__(self) -> LoaderIterator[T]:
        return self

    def __len__(self) -> int:
        return len(self._plan.index_sampler)

    def __next__(self) -> T:
        if self._broken is not None:
            raise RuntimeError(
                "this DataLoader iterator was shut down after an earlier error and cannot "
                "continue; create a new one with iter(loader)"
            ) from self._broken
        if not self._started_current:
            raise StopIteration
        scheduler = self._scheduler
        deadline = time.monotonic() + self._plan.timeout if self._plan.timeout > 0 else None
        while True:
            got = scheduler.deliver()
            if got is not None:
                self._pump()
                return self._hand_out(*got)
            if scheduler.current_finished():
                self._end_epoch()
                raise StopIteration
            self._pump()
            self._wait(deadline)

    def _pump(self) -> None:
        """Top up the prefetch window, opening the next epoch early when allowed."""
        scheduler = self._scheduler
        if (
            self._prefetch_next
            and scheduler.dispatching_done()
            and not scheduler.has_prefetched_epoch()
            and scheduler.current_epoch is not None
        ):
            self._begin_epoch()
        engine = self._engine
        for worker_id, message in scheduler.dispatch():
            engine.send(worker_id, message)

    def _wait(self, deadline: float | None) -> None:
        engine = self._engine
        try:
            while True:
                wait = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
                replies = engine.poll(max(wait, 0.0))
                for worker_id, reply in replies:
                    self._scheduler.complete(worker_id, reply)
                deaths = engine.dead()
                if deaths:
                    self._fail(self._death_error(deaths))
                if replies:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise RuntimeError(self._timeout_message())
        except (KeyboardInterrupt, SystemExit, GeneratorExit) as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """Shut the workers down and make the iterator refuse further use, then raise."""
        self._broken = exc
        self._close()
        raise exc

    def _death_error(self, deaths: list[tuple[int, int | None, int | None]]) -> WorkerDiedError:
        worker_id, pid, exitcode = deaths[0]
        owed = self._scheduler.outstanding(worker_id)
        detail = f" while it owed {len(owed)} batch(es)" if owed else ""
        if self._plan.threads:
            detail += "; a thread worker ended without being asked (an error inside stoker)"
        if len(deaths) > 1:
            detail += f"; workers {[d[0] for d in deaths[1:]]} died too"
        return WorkerDiedError(worker_id, pid, exitcode, detail)

    def _timeout_message(self) -> str:
        message = f"DataLoader timed out after {self._plan.timeout:g} seconds"
        waiting = self._scheduler.waiting_for()
        if waiting is not None:
            message += f" waiting for batch {waiting.batch} of epoch {waiting.epoch}"
            if waiting.worker_id is not None:
                message += f" from worker {waiting.worker_id}"
                pids = getattr(self._engine, "pids", None)
                if pids:
                    message += f" (pid {pids[waiting.worker_id]})"
            if waiting.index is not None or self._plan.iterable:
                message += f", {describe_index(waiting.index, self._plan.iterable)}"
        return message

    def _hand_out(self, index: Any, reply: Any) -> T:
        if isinstance(reply, Failed):
            error = reply.error
            raise error if isinstance(error, BaseException) else error.rebuild()
        assert isinstance(reply, Done)
        self._yielded += 1
        self._warn_if_longer_than_reported()
        batch = reply.payload
        if self._pin is not None:
            batch = self._pin(batch)
        return batch

    def _warn_if_longer_than_reported(self) -> None:
        plan = self._plan
        if not plan.iterable or plan.len_called is None:
            return
        reported = plan.len_called
        if plan.batch_size is not None:
            reported = (reported // plan.batch_size) if plan.drop_last else math.ceil(reported / plan.batch_size)
        if self._yielded > reported:
            message = (
                f"Length of IterableDataset {plan.dataset} was reported to be {plan.len_called} "
                f"samples ({reported} batches, when accessing len(dataloader)), but "
                f"{self._yielded} batches have been fetched. "
            )
            if plan.num_workers > 0:
                message += (
                    "For multi-worker loading, this is usually an IterableDataset whose replicas "
                    "are not sharded with get_worker_info()."
                )
            warnings.warn(message, stacklevel=3)

    def _end_epoch(self) -> None:
        self._scheduler.finish_epoch()
        self._started_current = False
        if not self._plan.persistent:
            self._close()

    # --------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Stop the workers now; later `next()` calls end the iteration."""
        self._started_current = False
        self._close()


def _has_set_epoch(index_sampler: Any) -> bool:
    inner = getattr(index_sampler, "sampler", None)
    return hasattr(index_sampler, "set_epoch") or hasattr(inner, "set_epoch")


def _make_engine(plan: _Plan, base_seed: int) -> Any:
    def config(worker_id: int, num_workers: int, thread: bool) -> WorkerConfig:
        return WorkerConfig(
            worker_id=worker_id,
            num_workers=num_workers,
            base_seed=base_seed,
            dataset=plan.dataset,
            dataset_kind=plan.dataset_kind,
            auto_collation=plan.auto_collation,
            collate_fn=plan.collate_fn,
            drop_last=plan.drop_last,
            worker_init_fn=plan.worker_init_fn,
            thread=thread,
        )

    n = plan.num_workers
    if n == 0:
        return SerialEngine(config(0, 1, thread=True))
    if plan.threads:
        return ThreadEngine([config(i, n, thread=True) for i in range(n)])
    context = plan.context if plan.context is not None else multiprocessing.get_context()
    return ProcessEngine([config(i, n, thread=False) for i in range(n)], context, plan.arena)


def _pin_function(loader: Any) -> Any:
    """A function that pins a batch's tensors, or None (with torch's warning) when it cannot."""
    try:
        import torch
    except ImportError:
        warnings.warn(
            "'pin_memory' argument is set as true but torch is not installed, "
            "then device pinned memory won't be used.",
            stacklevel=4,
        )
        return None
    accelerator = getattr(torch, "accelerator", None)
    available = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
    if not available:
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=4,
        )
        return None
    return _pin_batch


def _pin_batch(batch: Any) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return type(batch)({k: _pin_batch(v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_pin_batch(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_pin_batch(v) for v in batch)
    return batch

