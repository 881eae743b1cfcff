"""The loader's arguments resolved into what its iterators read.

`DataLoader.__init__` is one call, `resolve_arguments`, and the assignment of the `Arguments`
it returns: every check and default of its arguments is made here, by the steps below in this
order. Each step takes arguments as the user gave them, raises torch's exception type and
wording for a bad one, and returns a small frozen value or an attribute's value. The order is
part of the behaviour: of two bad arguments, the one checked first is raised (torch's choice
where both are torch's).

```
 resolve_workers     num_workers, prefetch_factor ("auto" too), timeout,   → Workers
                     max_worker_restarts, persistent_workers, auto_reload
 check_callables     collate_fn, batchify_fn, worker_init_fn
 check_flags         in_order, thread_pool, seed_each_batch, stats, progress
 resolve_pin_memory  pin_memory, pin_memory_device                         → False/True/"born"
 check_generator     generator (from `_data.rng`)
 resolve_batchify    collate_fn or batchify_fn                             → the one given
 check_last_batch    last_batch's value
 resolve_context     multiprocessing_context (also when it is set later)   → a context
 check_int           snapshot_every_n_steps
 resolve_batching    the dataset's kind, shuffle, sampler, batch_sampler,  → Batching
                     batch_size, drop_last, last_batch
 resolve_ranks       the training rank the workers' seeds mix in           → (rank, world, local)
 resolve_collate     the collate function, or the flavour's default
```

Where the two flavours differ (the samplers made by default, whether an iterable dataset
takes `shuffle` itself, the default collate, `_dataset_kind`), a step asks the loader's
class, a `Flavour`.

`LoadPlan` is what each new iterator then gets (`DataLoader._plan()`): everything the
iterator and the engines read from the loader, as one frozen value, so that neither imports
the loader nor touches its attributes.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .._base.checks import check_bool, check_callable, check_int
from .._data.datasets import is_iterable_dataset
from .._data.distributed import ranks, torch_distributed_world
from .._data.rng import check_generator
from .._data.samplers import LAST_BATCH_CHOICES, native_index_sampler
from .auto import START_PREFETCH, Auto, start_workers
from .hostpin import check_pin_memory
from .resume import distributed_sampler
from .stats import require_tqdm

if TYPE_CHECKING:
    from .._data.rng import RandomSource
    from .arena import Arena
    from .auto import AutoStart

AUTO = "auto"


@dataclass(frozen=True)
class LoadPlan:
    """One loader's configuration, read once when an iterator is created."""

    dataset: Any
    dataset_kind: str  # "map" | "iterable"
    auto_collation: bool
    index_sampler: Any  # the batch sampler (auto-collation) or the sampler
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    batch_size: int | None
    num_workers: int
    window: int  # tasks dispatched and not yet delivered, at most
    persistent: bool
    # prefetch the next epoch before iter() (persistent workers only): an opt-in, as it reads
    # the dataset and sampler before anything the user sets between epochs
    auto_reload: bool
    timeout: float
    worker_init_fn: Callable[[int], None] | None
    context: BaseContext | None  # None: multiprocessing's default
    in_order: bool
    pin_memory: bool
    pin_memory_device: str
    threads: bool
    flavour: str
    len_called: int | None  # len(dataset) as reported to len(loader), for IterableDataset
    arena: Arena | None  # the loader's shared-memory arena (process workers), else None
    seed_source: RandomSource  # where each iterator draws its workers' base seed
    max_worker_restarts: int
    seed_each_batch: bool  # seed the global RNGs of the worker before each batch
    first_epoch: int  # the loader's number for this iterator's first epoch
    stats: bool = True  # workers time their batches; the iterator keeps `LoaderStats`
    progress: bool = False  # a tqdm bar per epoch
    prefetch_factor: int | None = None  # as given to the loader (for `LoaderStats`)
    choice: str | None = None  # what num_workers="auto" / prefetch_factor="auto" chose
    resume: dict[str, Any] | None = None  # a loaded state: where this iterator's first epoch resumes
    auto: AutoStart | None = None  # num_workers="auto": the first epoch starts inline, then chooses
    ranks: tuple[int, int, int | None] = (0, 1, None)  # (rank, world size, local rank) for workers
    pin_in_place: bool = False  # pin_memory="born": batches born pinned in the arena (see hostpin)
    # each replica's place as the first epoch starts (`replica.Kept` per worker, or None:
    # afresh); `restore`: a resume, whose workers put those places back before fetching
    replicas: tuple[Any, ...] = ()
    restore: bool = False
    snapshot_every: int = 1  # an iterable replica's state is taken every n batches (0: at its end)
    # the part of each batch of indices this process loads (stoker.jax: its devices' rows)
    take_rows: Callable[[Any], Any] | None = None

    @property
    def iterable(self) -> bool:
        return self.dataset_kind == "iterable"

    @property
    def processes(self) -> bool:
        """Workers are processes (not threads, not the caller's thread)."""
        return self.num_workers > 0 and not self.threads


# ------------------------------------------------------------------ argument resolution
class Flavour(Protocol):
    """What a loader class decides for its flavour (`stoker.DataLoader` or
    `stoker.torch.DataLoader`, each passed as the class itself)."""

    _random_sampler_cls: type[Any]
    _sequential_sampler_cls: type[Any]

    @staticmethod
    def _kind_of(iterable: bool) -> Any: ...

    @staticmethod
    def _shuffles_itself(dataset: Any, shuffle: bool) -> bool: ...

    @staticmethod
    def _infinite_sampler() -> Any: ...

    @staticmethod
    def _batch_sampler(sampler: Any, batch_size: int, drop_last: bool, last_batch: str | None) -> Any: ...

    @staticmethod
    def _default_collate() -> Callable[[list[Any]], Any]: ...

    @staticmethod
    def _default_convert() -> Callable[[Any], Any]: ...


@dataclass(frozen=True)
class Workers:
    """`num_workers` and the arguments checked against it."""

    given: int  # the workers asked for; 1 with "auto", which may choose some
    auto_workers: bool  # num_workers="auto", or an `Auto` count another loader chose
    auto_prefetch: bool
    prefetch_factor: int | None  # the attribute: 2 by default with workers, an `Auto` with "auto"
    timeout: float
    max_worker_restarts: int
    persistent_workers: bool
    auto_reload: bool

    @property
    def auto(self) -> tuple[bool, bool] | None:
        """What "auto" stands for until it chooses, (num_workers, prefetch_factor); None
        when neither was asked for."""
        return (self.auto_workers, self.auto_prefetch) if self.auto_workers or self.auto_prefetch else None


def resolve_workers(
    num_workers: Any,
    prefetch_factor: Any,
    *,
    timeout: Any,
    max_worker_restarts: Any,
    persistent_workers: bool,
    auto_reload: Any,
) -> Workers:
    """How many workers were asked for, and the arguments that depend on it, in torch's
    order of checks (num_workers, timeout, prefetch_factor, persistent_workers)."""
    # an `Auto` is a count that "auto" gave another loader (one re-created from its attributes)
    auto_workers = isinstance(num_workers, Auto) or num_workers == AUTO
    auto_prefetch = isinstance(prefetch_factor, Auto) or prefetch_factor == AUTO
    if not auto_workers:
        if isinstance(num_workers, str):
            raise TypeError(f"num_workers should be an int or 'auto', but got num_workers={num_workers!r}")
        check_int("num_workers", num_workers)
    if isinstance(prefetch_factor, str) and not auto_prefetch:
        raise TypeError(
            f"prefetch_factor should be an int, None or 'auto', but got prefetch_factor={prefetch_factor!r}"
        )
    given: int = 1 if auto_workers else num_workers  # "auto" may choose workers
    check_int("max_worker_restarts", max_worker_restarts)
    if max_worker_restarts < 0:
        raise ValueError(
            "max_worker_restarts should be a non-negative int (0: a worker's death raises), "
            f"but got max_worker_restarts={max_worker_restarts}"
        )
    if given < 0:
        raise ValueError("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout should be a number of seconds, but got timeout={timeout!r}")
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if given == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing."
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    if given > 0 and prefetch_factor is None:
        prefetch_factor = 2
    elif prefetch_factor is not None and not auto_prefetch:
        check_int("prefetch_factor", prefetch_factor)
        if prefetch_factor < 0:
            raise ValueError("prefetch_factor option should be non-negative")
    if persistent_workers and given == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    check_bool("auto_reload", auto_reload)
    if auto_reload and not persistent_workers:
        raise ValueError(
            "auto_reload=True prefetches the next epoch on the workers that finish this one; "
            "it needs persistent_workers=True (and num_workers > 0), but got "
            f"persistent_workers={persistent_workers!r}"
        )
    return Workers(
        given=given,
        auto_workers=auto_workers,
        auto_prefetch=auto_prefetch,
        # "auto": until the choice, the count it starts from (an int, as torch's attribute is)
        prefetch_factor=Auto(START_PREFETCH) if auto_prefetch else prefetch_factor,
        timeout=timeout,
        max_worker_restarts=max_worker_restarts,
        persistent_workers=persistent_workers,
        auto_reload=auto_reload,
    )


def check_callables(collate_fn: Any, batchify_fn: Any, worker_init_fn: Any) -> None:
    """Each of the functions is a callable or None."""
    check_callable("collate_fn", collate_fn, none_ok=True)
    check_callable("batchify_fn", batchify_fn, none_ok=True)
    check_callable("worker_init_fn", worker_init_fn, none_ok=True)


def check_flags(
    workers: Workers, *, in_order: Any, thread_pool: Any, seed_each_batch: Any, stats: Any, progress: Any
) -> None:
    """The switches are bools that do not contradict each other; `progress=True` finds tqdm
    now rather than in the middle of a run."""
    check_bool("in_order", in_order)
    check_bool("thread_pool", thread_pool)
    check_bool("seed_each_batch", seed_each_batch)
    check_bool("stats", stats)
    check_bool("progress", progress)
    if progress and not stats:
        raise ValueError(
            "progress=True shows figures from the loader's statistics, which stats=False "
            "turns off; give stats=True (the default) or progress=False"
        )
    if progress:
        require_tqdm()
    if seed_each_batch and thread_pool and workers.given > 0:
        raise ValueError(
            "seed_each_batch=True cannot be combined with thread_pool=True: thread workers "
            "share the process's global RNGs, so seeding them per batch would race; draw "
            "per-sample randomness from stoker.sample_rng() (or stoker.sample_seed()) instead"
        )


def resolve_pin_memory(pin_memory: Any, pin_memory_device: Any) -> bool | Literal["born"]:
    """`pin_memory` as the loader keeps it (see `hostpin.check_pin_memory`), with its device
    checked."""
    pin = check_pin_memory(pin_memory)
    if not isinstance(pin_memory_device, str):
        raise TypeError(f"pin_memory_device should be a str, but got pin_memory_device={pin_memory_device!r}")
    return pin


def resolve_batchify(collate_fn: Any, batchify_fn: Any) -> Any:
    """The collate function given, under either of its names (None when neither was)."""
    if batchify_fn is None:
        return collate_fn
    if collate_fn is not None:
        raise ValueError("collate_fn and batchify_fn are two names for the same argument; give only one")
    return batchify_fn


def check_last_batch(last_batch: Any) -> None:
    """`last_batch` is one of MXNet Gluon's choices or None."""
    if last_batch is not None and last_batch not in LAST_BATCH_CHOICES:
        raise ValueError(f"last_batch should be one of {LAST_BATCH_CHOICES} or None, but got last_batch={last_batch!r}")


def resolve_context(context: Any, num_workers: int, auto: bool) -> BaseContext | None:
    """The context worker processes start with: a start method's name read as its context,
    None for multiprocessing's default. It needs workers (`num_workers > 0`, or "auto", which
    may choose some)."""
    if context is None:
        return None
    if not auto and num_workers <= 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading "
            f"(num_workers > 0), but got num_workers={num_workers}"
        )
    if isinstance(context, str):
        methods = multiprocessing.get_all_start_methods()
        if context not in methods:
            raise ValueError(
                f"multiprocessing_context option should specify a valid start method in "
                f"{methods!r}, but got multiprocessing_context={context!r}"
            )
        context = multiprocessing.get_context(context)
    if not isinstance(context, BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context}"
        )
    return context


@dataclass(frozen=True)
class Batching:
    """Where a loader's indices come from and how they are batched."""

    iterable: bool  # an IterableDataset: its replicas make the samples, the sampler only counts
    batch_size: int | None  # None: no automatic batching (also with a batch_sampler)
    drop_last: Any  # as given, unless last_batch or a batch_sampler decides
    sampler: Any
    batch_sampler: Any  # None: no automatic batching

    @property
    def auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def index_sampler(self) -> Any:
        """What yields each task's index: the batch sampler, or the sampler without one."""
        return self.batch_sampler if self.auto_collation else self.sampler


def resolve_batching(
    flavour: Flavour,
    dataset: Any,
    *,
    batch_size: Any,
    shuffle: Any,
    sampler: Any,
    batch_sampler: Any,
    drop_last: Any,
    last_batch: str | None,
    generator: Any,
) -> Batching:
    """The samplers and batch size a loader iterates, with torch's checks in torch's order
    (the dataset's kind, shuffle and sampler, then batch_sampler, batch_size and drop_last)."""
    iterable = is_iterable_dataset(dataset)
    random = resolve_shuffle(
        flavour, dataset, iterable, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler, last_batch=last_batch
    )
    batch_size, drop_last = resolve_batch_size(
        batch_size, drop_last, last_batch, batch_sampler=batch_sampler, shuffle=random, sampler=sampler
    )
    if sampler is None:
        sampler = default_sampler(flavour, dataset, iterable, shuffle=random, generator=generator)
    if batch_size is not None and batch_sampler is None:
        # a map-style dataset's sampler yields ints; an iterable's (InfiniteConstantSampler)
        # yields None, which the iterable fetcher ignores
        batch_sampler = flavour._batch_sampler(sampler, batch_size, drop_last, last_batch)
    return Batching(iterable, batch_size, drop_last, sampler, batch_sampler)


def resolve_shuffle(
    flavour: Flavour,
    dataset: Any,
    iterable: bool,
    *,
    shuffle: Any,
    sampler: Any,
    batch_sampler: Any,
    last_batch: str | None,
) -> bool:
    """Whether the loader shuffles (its default sampler is random). An IterableDataset takes
    none of shuffle, sampler, batch_sampler or last_batch="rollover", unless the flavour says
    it shuffles itself (stoker.torch: a torch IterDataPipe, which is then told to)."""
    if iterable:
        takes_shuffle = shuffle is not None and flavour._shuffles_itself(dataset, shuffle)
        if not takes_shuffle and shuffle not in {False, None}:
            raise ValueError(
                f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
            )
        if sampler is not None:
            raise ValueError(
                f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
            )
        if batch_sampler is not None:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified "
                f"batch_sampler option, but got batch_sampler={batch_sampler}"
            )
        if last_batch == "rollover":
            raise ValueError(
                "last_batch='rollover' needs a map-style dataset; an IterableDataset has no "
                "epoch order to carry indices across"
            )
        return False  # the stream's order is its own
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    return bool(shuffle)


def resolve_batch_size(
    batch_size: Any, drop_last: Any, last_batch: str | None, *, batch_sampler: Any, shuffle: bool, sampler: Any
) -> tuple[int | None, Any]:
    """`batch_size` and `drop_last` as the loader keeps them: a batch_sampler makes its own
    batches (batch_size None, drop_last False), and last_batch decides drop_last."""
    if last_batch is not None:
        if batch_sampler is not None or batch_size is None:
            raise ValueError(
                "last_batch applies to batches the DataLoader makes itself; it cannot be "
                "combined with batch_sampler or batch_size=None"
            )
        if drop_last and last_batch != "discard":
            raise ValueError(
                f"drop_last=True contradicts last_batch={last_batch!r}; give one of them "
                "(drop_last=True is last_batch='discard')"
            )
        drop_last = last_batch == "discard"
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
            )
        return None, False
    if batch_size is None and drop_last:
        raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
    return batch_size, drop_last


def default_sampler(flavour: Flavour, dataset: Any, iterable: bool, *, shuffle: bool, generator: Any) -> Any:
    """The sampler a loader makes when given none: the flavour's random or sequential one, or
    for an IterableDataset one that only counts."""
    if iterable:
        return flavour._infinite_sampler()
    if shuffle:
        return flavour._random_sampler_cls(dataset, generator=generator)
    return flavour._sequential_sampler_cls(dataset)


def resolve_ranks(index_sampler: Any) -> tuple[int, int, int | None]:
    """(rank, world size, local rank): the training rank that the workers' seeds mix in.

    torch.distributed's or torchrun's; without either, a DistributedSampler's own rank. Nothing
    is agreed with other ranks (a constructor never communicates): without a generator the
    base seeds come from each rank's global RNG, as torch's do.
    """
    sharded = distributed_sampler(native_index_sampler(index_sampler))
    rank, world_size, local_rank = ranks()
    if sharded is not None and not torch_distributed_world():  # its ranks are all we know
        rank, world_size = sharded.rank, sharded.num_replicas
    return rank, world_size, local_rank


def resolve_collate(flavour: Flavour, collate_fn: Any, auto_collation: bool) -> Callable[[Any], Any]:
    """The collate function given, or the flavour's default: `default_collate` with automatic
    batching, `default_convert` without."""
    if collate_fn is not None:
        return collate_fn
    return flavour._default_collate() if auto_collation else flavour._default_convert()


def usable_cpus() -> int | None:
    """CPUs this process may run on (its affinity mask), or None when unknown."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return len(os.sched_getaffinity(0))
        except OSError:
            pass
    return os.cpu_count()


@dataclass(frozen=True)
class Arguments:
    """`DataLoader.__init__`'s arguments checked, with their defaults applied: each field is the
    value of the loader's attribute of that name, and `workers` and `batching` hold the values of
    the workers' and the batching's attributes (`Workers`, `Batching`)."""

    dataset: Any
    workers: Workers
    num_workers: int  # with "auto": an `Auto`, the count it starts from until it chooses
    pin_memory: bool | Literal["born"]
    pin_memory_device: str
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: BaseContext | None  # a start method's name reads back as its context
    in_order: bool
    thread_pool: bool
    seed_each_batch: bool
    stats: bool
    progress: bool
    snapshot_every_n_steps: int
    batching: Batching
    dataset_kind: Any  # the flavour's value for `_dataset_kind`
    last_batch: str | None  # as given (None: drop_last says): a loader re-made from attributes gets it
    generator: Any
    ranks: tuple[int, int, int | None]
    collate_fn: Callable[[Any], Any]


def resolve_arguments(
    flavour: Flavour,
    dataset: Any,
    *,
    batch_size: Any,
    shuffle: Any,
    sampler: Any,
    batch_sampler: Any,
    num_workers: Any,
    collate_fn: Any,
    pin_memory: Any,
    drop_last: Any,
    timeout: Any,
    worker_init_fn: Any,
    multiprocessing_context: Any,
    generator: Any,
    prefetch_factor: Any,
    persistent_workers: Any,
    pin_memory_device: Any,
    in_order: Any,
    last_batch: Any,
    batchify_fn: Any,
    thread_pool: Any,
    auto_reload: Any,
    max_worker_restarts: Any,
    seed_each_batch: Any,
    stats: Any,
    progress: Any,
    snapshot_every_n_steps: Any,
) -> Arguments:
    """`DataLoader.__init__`'s arguments, as the user gave them, checked and resolved by the
    steps of this module's table in its order; `flavour` is the loader's class.

    Raises:
        TypeError, ValueError, ImportError: as `DataLoader` says, for the first bad argument in
            the steps' order.
    """
    workers = resolve_workers(
        num_workers,
        prefetch_factor,
        timeout=timeout,
        max_worker_restarts=max_worker_restarts,
        persistent_workers=persistent_workers,
        auto_reload=auto_reload,
    )
    check_callables(collate_fn, batchify_fn, worker_init_fn)
    check_flags(
        workers,
        in_order=in_order,
        thread_pool=thread_pool,
        seed_each_batch=seed_each_batch,
        stats=stats,
        progress=progress,
    )
    pin = resolve_pin_memory(pin_memory, pin_memory_device)
    check_generator(generator)
    given_collate = resolve_batchify(collate_fn, batchify_fn)
    check_last_batch(last_batch)
    context = resolve_context(multiprocessing_context, workers.given, auto=workers.auto is not None)
    snapshot_every = check_int("snapshot_every_n_steps", snapshot_every_n_steps, low=0)
    batching = resolve_batching(
        flavour,
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        sampler=sampler,
        batch_sampler=batch_sampler,
        drop_last=drop_last,
        last_batch=last_batch,
        generator=generator,
    )
    return Arguments(
        dataset=dataset,
        workers=workers,
        num_workers=Auto(start_workers(usable_cpus() or 1)) if workers.auto_workers else workers.given,
        pin_memory=pin,
        pin_memory_device=pin_memory_device,
        worker_init_fn=worker_init_fn,
        multiprocessing_context=context,
        in_order=in_order,
        thread_pool=thread_pool,
        seed_each_batch=seed_each_batch,
        stats=stats,
        progress=progress,
        snapshot_every_n_steps=snapshot_every,
        batching=batching,
        dataset_kind=flavour._kind_of(batching.iterable),
        last_batch=last_batch,
        generator=generator,
        ranks=resolve_ranks(batching.index_sampler),
        collate_fn=resolve_collate(flavour, given_collate, batching.auto_collation),
    )
