"""`DataLoader`: torch's arguments, checked with torch's exception types and wording, plus
MXNet Gluon's `last_batch`, `batchify_fn` and `thread_pool`.

The loader itself holds configuration only: its constructor is one call to
`plan.resolve_arguments` (every check and default of its arguments, in torch's order) and the
assignment of what it returns to attributes; `iter(loader)` hands a `LoadPlan` (one frozen
value) to a new `LoaderIterator`, or starts the next epoch of its persistent one.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import multiprocessing.context
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any, ClassVar, Generic, Literal, TypeVar

from .._data import collate as _collate
from .._data.datasets import Dataset
from .._data.distributed import ranks, shards_by_rank, torch_distributed_world
from .._data.rng import GeneratorLike, RandomSource
from .._data.samplers import (
    BatchSampler,
    InfiniteConstantSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    native_index_sampler,
)
from .arena import Arena, arena_limit
from .auto import Auto, AutoStart, Choice, choose
from .errors import ReplicaUnsaved, UnshardedWarning
from .forkserver import prepare_forkserver
from .hostpin import BORN
from .iterator import LoaderIterator
from .plan import Arguments, LoadPlan, resolve_arguments, resolve_context, usable_cpus
from .replica import Kept, records, replica_part
from .resume import (
    ELASTIC_KEYS,
    Progress,
    capture_epoch,
    distributed_sampler,
    is_stateful,
    make_elastic,
    predraw,
)
from .resume import VERSION as STATE_VERSION
from .resume import check as check_resume
from .resume import describe as describe_resume
from .resume import upgrade as upgrade_state
from .stats import LoaderStats, Recorder, clock

T_co = TypeVar("T_co", covariant=True)


_READ_ONLY = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")


def start_method_of(context: multiprocessing.context.BaseContext | str | None) -> str:
    """The start method workers started with `context` (a context, a method's name, or None for
    multiprocessing's default) use, without fixing multiprocessing's default: asking the
    default context would, and a later `set_start_method` would then fail."""
    if isinstance(context, str):
        return context
    if context is not None:
        return str(context.get_start_method())
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def warn_if_too_many_workers(num_workers: int, stacklevel: int = 2) -> None:
    """torch's warning when more workers than usable CPUs are asked for. `stacklevel` counts
    from the caller of this function: 2 names the line that called the caller."""
    if not num_workers:
        return
    suggest = usable_cpus()
    if suggest is not None and num_workers <= suggest:
        return
    if suggest is None:
        detail = "DataLoader is not able to compute a suggested max number of worker in current system."
    else:
        cpuset = "" if hasattr(os, "sched_getaffinity") else " (`cpuset` is not taken into account)"
        detail = (
            f"Our suggested max number of worker in current system is {suggest}{cpuset}, which is "
            "smaller than what this DataLoader is going to create."
        )
    warnings.warn(
        f"This DataLoader will create {num_workers} worker processes in total. {detail} "
        "Please be aware that excessive worker creation might get DataLoader running slow or "
        "even freeze, lower the worker number to avoid potential slowness/freeze if necessary.",
        stacklevel=stacklevel + 1,
    )


class DataLoader(Generic[T_co]):
    """Combines a dataset and a sampler, and provides an iterable over the given dataset.

    The arguments are those of `torch.utils.data.DataLoader`, with torch's meaning, defaults,
    checks and error messages, plus MXNet Gluon's `last_batch`, `batchify_fn` and
    `thread_pool`, and stoker's own `auto_reload`, `max_worker_restarts`, `seed_each_batch`,
    `stats`, `progress`, `pin_memory="born"` and `"auto"` for `num_workers` and
    `prefetch_factor`. The user guide page "Workers and failures" tells how stoker delivers
    them.

    Batches keep numpy as numpy and tensors as tensors (`stoker.default_collate`); the
    `stoker.torch` flavour of this class, also a `torch.utils.data.DataLoader`, makes them
    torch tensors exactly as torch does.

    `num_workers="auto"` / `prefetch_factor="auto"` are chosen once, in the first epoch, and
    kept for the loader's life. A map-style dataset's first epoch starts in this process: its
    first few batches are fetched here, timed and delivered as usual, and the rest of the
    epoch goes to the workers chosen from those times and the usable CPUs and memory. With
    only `prefetch_factor="auto"`, or an IterableDataset, the choice is made at the first
    `iter()`. It is stated in a log record of the "stoker" logger and in `stats().choice`.
    `num_workers` and `prefetch_factor` read as ints throughout, as torch's do: until the
    choice, the counts "auto" starts from (`num_workers`: one less than the usable CPUs, at
    least 1 and at most 8, which is also what an IterableDataset gets; `prefetch_factor`: 2),
    after it the counts chosen (0 and None included). Each is an int subclass that remembers
    "auto": a loader made from the attributes of another (Lightning re-creating it around its
    sampler, accelerate around a shard) asks for "auto" again and makes its own choice.

    Args:
        dataset: The dataset to load from: a map-style dataset (`__getitem__` and `__len__`)
            or an `IterableDataset`.
        batch_size: How many samples per batch. None turns automatic batching off: each
            sample is passed on as it is, through `collate_fn` (or `default_convert`).
            Defaults to 1.
        shuffle: True reshuffles the data at every epoch (a `RandomSampler` drawing from
            `generator`); None and False keep the dataset's order. Must not be True with
            `sampler`, or be given at all with an IterableDataset (except a torch
            `IterDataPipe` under `stoker.torch`, which takes it itself). Defaults to None.
        sampler: The order of the indices to load: a `Sampler` or any iterable of indices.
            None: sequential, or random with `shuffle=True`. Defaults to None.
        batch_sampler: Like `sampler`, but yields the list of indices of each batch.
            Mutually exclusive with `batch_size`, `shuffle`, `sampler`, `drop_last` and
            `last_batch`. Defaults to None.
        num_workers: How many workers load batches: 0 loads them in this process, at
            `next()`; n > 0 runs n worker processes (threads with `thread_pool=True`);
            "auto" lets the loader choose (see above). Defaults to 0.
        collate_fn: Merges a list of samples into a batch. None: `default_collate` with
            automatic batching, `default_convert` without it. Defaults to None.
        pin_memory: True copies the tensors of each batch into page-locked (pinned) memory
            before handing the batch out, as torch does (on a pin thread, safe under copies
            on any stream). "born" (stoker's own, with process workers) hands out batches
            born pinned in the loader's shared-memory slots, registered with CUDA, with no
            pin copy; the user guide page "Feeding a GPU" states the rule it asks of the
            consumer (copy each batch on the iterating thread's current stream, or
            synchronise before dropping it). Defaults to False.
        drop_last: True drops the last batch of an epoch when the dataset size is not
            divisible by `batch_size`; False keeps it, smaller. Defaults to False.
        timeout: Seconds to wait for a batch from the workers before raising `RuntimeError`;
            0 waits as long as the workers live. Defaults to 0.
        worker_init_fn: Called in each worker with its id (0 to `num_workers - 1`), after
            seeding and before loading. Defaults to None.
        multiprocessing_context: How worker processes start: a start method's name ("fork",
            "spawn", "forkserver") or a multiprocessing context. None: multiprocessing's
            default. Needs `num_workers > 0`. Defaults to None.
        generator: The randomness of the sampler `shuffle=True` makes, of the workers'
            base seeds and of a torch `IterDataPipe`'s shared seed per epoch: an int seed,
            a `numpy.random.Generator` or a `torch.Generator`. None draws from the global
            RNG: numpy's, or torch's under `stoker.torch`, as torch's loader does. Defaults
            to None.
        prefetch_factor: Batches loaded ahead per worker; at most
            `prefetch_factor * num_workers` batches are in flight. None means 2 with workers
            and must stay None with `num_workers=0`; "auto" lets the loader choose (see
            above). Defaults to None.
        persistent_workers: True keeps the workers (and their dataset replicas) alive
            between epochs instead of starting new ones at each `iter()`. Needs
            `num_workers > 0`. Defaults to False.
        pin_memory_device: Deprecated in torch, kept for compatibility: with `pin_memory`, a
            non-empty value warns, as torch's does, and memory is pinned for the current
            accelerator.
            Defaults to "".
        in_order: True hands out batches in the sampler's order; False hands out each as
            soon as it is ready, so that a slow sample does not hold up the others.
            Defaults to True.
        last_batch: What to do with an epoch's short last batch (MXNet Gluon): "keep",
            "discard" (as `drop_last=True`) or "rollover" (its samples open the next epoch's
            first batch; map-style datasets only). None: `drop_last` decides. Needs the
            loader's own batching (no `batch_sampler`, `batch_size` not None).
            Defaults to None.
        batchify_fn: Another name for `collate_fn` (MXNet Gluon's); give at most one of
            them. Defaults to None.
        thread_pool: With `num_workers > 0`, True makes the workers threads of this process
            instead of processes (MXNet Gluon's); batches are then handed over by reference.
            Defaults to False.
        auto_reload: With `persistent_workers=True`, True starts the workers on the next
            epoch's first batches as soon as the current epoch's last batch is sent, instead
            of at the next `iter()`. It hides the epoch boundary, but those batches read the
            dataset before the loop reaches `iter()`: a `dataset.set_epoch(e)` (or any
            change to the dataset) made between epochs misses them; a sampler with
            `set_epoch` is waited for. Defaults to False.
        max_worker_restarts: How many times one iterator replaces a worker process that died
            (killed by the OOM killer, a segfault, `os._exit`) and re-sends the batches it
            owed, so that the epoch completes with every sample once, in order. 0: a
            worker's death raises `WorkerDiedError`. No effect on thread workers and
            `num_workers=0`. Defaults to 0.
        seed_each_batch: True seeds a worker process's global RNGs (Python's `random`,
            numpy's, torch's if imported) before each batch from (base seed, epoch, batch
            position), so that a dataset drawing from them gives the same samples whatever
            worker loads the batch and however many workers there are; with `num_workers=0`
            the main process's RNG states are saved and restored around each fetch. Refused
            with `thread_pool=True` and workers (threads share the global RNGs): draw from
            `stoker.sample_rng()` there. Defaults to False.
        stats: True keeps the live figures that `stats()` reads; False turns them off, with
            their small cost. Defaults to True.
        progress: True draws a tqdm bar per epoch (needs tqdm:
            `pip install stoker[progress]`) and `stats=True`. Defaults to False.
        snapshot_every_n_steps: torchdata's argument: how often (in batches of one worker's
            replica) an IterableDataset replica's state (its `state_dict()`, and its
            iterator's) is taken and sent with its batch; 0 takes it only at the end of the
            replica's stream. Every position stays exact: a resume loads the last state taken
            and draws again (without collating) the items drawn since, so a larger value trades
            the cost of a `state_dict()` and its pickling per batch for that replay. A stream
            that keeps no state is replayed from its epoch's start whatever the value; a
            map-style dataset that keeps a state has it taken with every batch (a fetch cannot
            be replayed). Defaults to 1.

    Raises:
        TypeError: when an argument has the wrong type: `num_workers` not an int or "auto",
            `prefetch_factor` not an int, None or "auto", `max_worker_restarts` not an int,
            `timeout` not a number, `pin_memory` neither a bool nor a string,
            `pin_memory_device` not a str, `collate_fn`, `batchify_fn` or `worker_init_fn`
            neither callable nor None, `generator` not None, an int, a numpy or a torch
            Generator, `multiprocessing_context` neither a start method's name nor a
            context, or one of `in_order`, `thread_pool`, `auto_reload`, `seed_each_batch`,
            `stats`, `progress` not a bool, or `snapshot_every_n_steps` not an int.
        ValueError: when the values contradict torch's rules or each other: a negative
            `num_workers`, `snapshot_every_n_steps`, `timeout`, `prefetch_factor`, `max_worker_restarts` or int
            `generator`; `prefetch_factor` or `persistent_workers=True` or
            `multiprocessing_context` with `num_workers=0`; an unknown start method;
            `pin_memory` another string than "born"; `last_batch` not one of "keep",
            "discard", "rollover" or None; `sampler` with `shuffle=True`; `batch_sampler`
            with `batch_size`, `shuffle`, `sampler` or `drop_last`; `batch_size=None` with
            `drop_last=True`; `last_batch` with `batch_sampler` or `batch_size=None`, or
            with `drop_last=True` unless "discard"; an IterableDataset with `shuffle`,
            `sampler`, `batch_sampler` or `last_batch="rollover"`; both `collate_fn` and
            `batchify_fn`; `auto_reload=True` without `persistent_workers=True`;
            `progress=True` with `stats=False`; `seed_each_batch=True` with
            `thread_pool=True` and workers.
        ImportError: when `progress=True` and tqdm is not installed.
    """

    _flavour = "numpy"
    _random_sampler_cls: ClassVar[type[Any]] = RandomSampler
    _sequential_sampler_cls: ClassVar[type[Any]] = SequentialSampler

    dataset: Dataset[T_co]
    batch_size: int | None
    num_workers: int  # with "auto": an `Auto`, the count it starts from until it chooses
    pin_memory: bool | Literal["born"]  # "born": see hostpin
    drop_last: bool
    timeout: float
    sampler: Sampler[Any] | Iterable[Any]
    batch_sampler: Sampler[Sequence[Any]] | Iterable[Sequence[Any]] | None
    prefetch_factor: int | None
    _iterator: LoaderIterator[Any] | None

    __initialized = False

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[Sequence[Any]] | Iterable[Sequence[Any]] | None = None,
        num_workers: int | Literal["auto"] = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool | Literal["born"] = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
        generator: GeneratorLike = None,
        *,
        prefetch_factor: int | Literal["auto"] | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        last_batch: str | None = None,
        batchify_fn: Callable[[list[Any]], Any] | None = None,
        thread_pool: bool = False,
        auto_reload: bool = False,
        max_worker_restarts: int = 0,
        seed_each_batch: bool = False,
        stats: bool = True,
        progress: bool = False,
        snapshot_every_n_steps: int = 1,
    ) -> None:
        arguments = resolve_arguments(
            type(self),
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
            last_batch=last_batch,
            batchify_fn=batchify_fn,
            thread_pool=thread_pool,
            auto_reload=auto_reload,
            max_worker_restarts=max_worker_restarts,
            seed_each_batch=seed_each_batch,
            stats=stats,
            progress=progress,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )
        self._keep(arguments)
        self._start_fresh()
        self.__initialized = True
        workers = arguments.workers
        if not workers.auto_workers:
            warn_if_too_many_workers(workers.given, stacklevel=2)
        if workers.given > 0 and not thread_pool and self._start_method() == "forkserver":
            prepare_forkserver(dataset, self.collate_fn, start=True)  # imports overlap the caller's set-up

    def _keep(self, arguments: Arguments) -> None:
        """The resolved arguments as attributes, under torch's names."""
        self.dataset = arguments.dataset
        workers = arguments.workers
        self.num_workers = arguments.num_workers
        self.prefetch_factor = workers.prefetch_factor
        self._auto = workers.auto
        self._choice: str | None = None  # what "auto" chose, and why
        self.timeout = workers.timeout
        self.max_worker_restarts = workers.max_worker_restarts
        self.persistent_workers = workers.persistent_workers
        self.auto_reload = workers.auto_reload
        self.pin_memory = arguments.pin_memory
        self.pin_memory_device = arguments.pin_memory_device
        self.worker_init_fn = arguments.worker_init_fn
        self.__multiprocessing_context = arguments.multiprocessing_context  # resolved: no setter
        self.in_order = arguments.in_order
        self.thread_pool = arguments.thread_pool
        self.seed_each_batch = arguments.seed_each_batch
        self.stats_enabled = arguments.stats
        self.progress = arguments.progress
        self.snapshot_every_n_steps = arguments.snapshot_every_n_steps
        batching = arguments.batching
        self._iterable = batching.iterable
        self._dataset_kind = arguments.dataset_kind
        self.batch_size = batching.batch_size
        self.drop_last = batching.drop_last
        self.sampler = batching.sampler
        self.batch_sampler = batching.batch_sampler
        self.last_batch = arguments.last_batch
        self.generator = arguments.generator
        self._ranks = arguments.ranks
        self.collate_fn = arguments.collate_fn

    def _start_fresh(self) -> None:
        """No iterator, arena or epoch yet: the state the loader's life then changes."""
        self._warned_unsharded = False
        self._iterable_len_called: int | None = None
        self._iterator = None
        self._arena: Arena | None = None
        self._pid = os.getpid()  # the process whose workers and arena those are
        self._seed_source: RandomSource | None = None
        self._epochs_started = 0  # epochs begun over the loader's life: seeds depend on it
        self._latest: Progress | None = None  # how far the latest iterator got: state_dict reads it
        self._resume: dict[str, Any] | None = None  # a loaded state, for the next iter()
        self._resume_replicas: list[Kept | None] = []  # its replicas' places (see replica)
        self._resume_restore = False  # its replicas are put back (a load), or are where they are (a state of our own)
        self._description: tuple[Any, dict[str, Any]] | None = None  # see _described
        self._last_iterator: weakref.ref[LoaderIterator[Any]] | None = None  # for stats()
        self._last_recorder: Recorder | None = None  # kept when that iterator is dropped

    def _start_method(self) -> str:
        """The start method the workers will use."""
        return start_method_of(self.multiprocessing_context)

    # ------------------------------------------------------------- flavour
    @staticmethod
    def _kind_of(iterable: bool) -> Any:
        """`_dataset_kind`'s value: torch's DataLoader has an enum there."""
        return "iterable" if iterable else "map"

    @staticmethod
    def _shuffles_itself(dataset: Any, shuffle: bool) -> bool:
        """Whether an iterable dataset takes the loader's `shuffle` itself (it is then
        applied to it): torch's IterDataPipe does, under stoker.torch."""
        return False

    @staticmethod
    def _infinite_sampler() -> Sampler[None]:
        return InfiniteConstantSampler()

    @staticmethod
    def _batch_sampler(sampler: Any, batch_size: int, drop_last: bool, last_batch: str | None) -> Any:
        return BatchSampler(sampler, batch_size, drop_last, last_batch=last_batch)

    @staticmethod
    def _default_collate() -> Callable[[list[Any]], Any]:
        return _collate.default_collate

    @staticmethod
    def _default_convert() -> Callable[[Any], Any]:
        return _collate.default_convert

    # ------------------------------------------------------------ attributes
    @property
    def multiprocessing_context(self) -> multiprocessing.context.BaseContext | None:
        """The context worker processes start with (a start method's name given to the
        constructor reads back as its context), or None for multiprocessing's default.

        Setting it raises ValueError without `num_workers > 0` or for an unknown start
        method's name, and TypeError for a value that is neither a name nor a context.
        """
        return self.__multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: Any) -> None:
        self.__multiprocessing_context = resolve_context(context, self.num_workers, auto=self._auto is not None)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__initialized and name in _READ_ONLY:
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is initialized")
        super().__setattr__(name, value)

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    def _shared_memory(self) -> Arena:
        """The shared-memory arena of this loader's process workers, kept across epochs."""
        if self._arena is None:
            self._arena = Arena(arena_limit())
        return self._arena

    def _resolve_auto(self) -> None:
        """Make the "auto" choice now (once; it is kept for the loader's life), unless the
        first epoch makes it (`_head_start`)."""
        if self._auto is None or self._choice_in_epoch():
            return
        auto_workers, auto_prefetch = self._auto
        choice = choose(
            self.dataset,
            iterable=self._iterable,
            collate_fn=self.collate_fn,
            auto_collation=self._auto_collation,
            batch_size=self.batch_size,
            cpus=usable_cpus() or 1,
            workers=None if auto_workers else self.num_workers,
            prefetch_factor=None if auto_prefetch else self.prefetch_factor,
            auto_prefetch=auto_prefetch,
        )
        self._adopt(choice)

    def _choice_in_epoch(self) -> bool:
        """num_workers="auto" on a map-style dataset: the first epoch chooses, from its own
        first batches."""
        return self._auto is not None and self._auto[0] and not self._iterable

    def _adopt(self, choice: Choice, iterator: LoaderIterator[Any] | None = None) -> None:
        """Keep the "auto" choice; a persistent iterator that moved to its workers is kept."""
        assert self._auto is not None
        auto_workers, auto_prefetch = self._auto
        self._auto = None
        self.num_workers = Auto(choice.num_workers) if auto_workers else choice.num_workers
        prefetch = choice.prefetch_factor
        self.prefetch_factor = Auto(prefetch) if auto_prefetch and prefetch is not None else prefetch
        self._choice = choice.reason
        if iterator is not None and self.persistent_workers and choice.num_workers > 0:
            self._iterator = iterator
        logging.getLogger("stoker").info("DataLoader chose %s", choice.reason)

    def _head_start(self) -> AutoStart:
        """What an iterator needs to choose in its first epoch (it holds the loader weakly)."""
        assert self._auto is not None
        loader = weakref.ref(self)

        def on_choice(choice: Choice, iterator: Any) -> None:
            owner = loader()
            if owner is not None and owner._auto is not None:
                owner._adopt(choice, iterator)

        return AutoStart(
            cpus=usable_cpus() or 1,
            auto_prefetch=self._auto[1],
            prefetch_factor=None if self._auto[1] else self.prefetch_factor,
            persistent=bool(self.persistent_workers),
            arena=None if self.thread_pool else self._shared_memory(),
            on_choice=on_choice,
        )

    def _plan(
        self, resume: dict[str, Any] | None = None, replicas: Sequence[Kept | None] = (), restore: bool = False
    ) -> LoadPlan:
        """What a new iterator needs, read now: where it resumes, and its replicas' places."""
        self._resolve_auto()
        head = self._head_start() if self._choice_in_epoch() else None
        workers = 0 if head is not None else int(self.num_workers)
        processes = workers > 0 and not self.thread_pool
        if self._seed_source is None or self._seed_source.generator is not self.generator:
            self._seed_source = RandomSource(self.generator, self._flavour)
        given_prefetch = None if self.prefetch_factor is None else int(self.prefetch_factor)
        prefetch = given_prefetch if workers > 0 and given_prefetch is not None else 1
        return LoadPlan(
            dataset=self.dataset,
            dataset_kind="iterable" if self._iterable else "map",
            auto_collation=self._auto_collation,
            index_sampler=native_index_sampler(self._index_sampler),
            collate_fn=self.collate_fn,
            drop_last=self.drop_last,
            batch_size=self.batch_size,
            num_workers=workers,
            window=max(1, prefetch * max(workers, 1)),
            persistent=bool(self.persistent_workers) and workers > 0,
            auto_reload=self.auto_reload,
            timeout=float(self.timeout or 0),
            worker_init_fn=self.worker_init_fn,
            context=self.multiprocessing_context,
            in_order=self.in_order,
            pin_memory=bool(self.pin_memory),
            pin_memory_device=self.pin_memory_device,
            threads=bool(self.thread_pool),
            flavour=self._flavour,
            len_called=self._iterable_len_called,
            arena=self._shared_memory() if processes else None,
            seed_source=self._seed_source,
            max_worker_restarts=self.max_worker_restarts,
            seed_each_batch=self.seed_each_batch,
            first_epoch=self._epochs_started,
            stats=self.stats_enabled,
            progress=self.progress,
            prefetch_factor=given_prefetch if workers > 0 else None,
            choice=self._choice,
            resume=resume,
            auto=head,
            ranks=self._ranks,
            pin_in_place=isinstance(self.pin_memory, str) and self.pin_memory == BORN,
            replicas=tuple(replicas),
            restore=restore,
            snapshot_every=self.snapshot_every_n_steps,
        )

    # -------------------------------------------------------------- iteration
    def __iter__(self) -> LoaderIterator[Any]:
        """Start an epoch: an iterator over its batches.

        Without `persistent_workers`, each call starts new workers (the previous epoch's
        iterator, if still running, keeps its own). With `persistent_workers=True`, it
        returns the loader's one iterator, moved to the next epoch. After
        `load_state_dict`, the epoch continues from the saved point.

        Returns:
            An iterator over the epoch's batches; `len()` of it is `len(loader)`.

        Raises:
            Exception: in `next()`, what the dataset, `collate_fn` or `worker_init_fn`
                raised in a worker, re-raised in this process at that batch (a
                `WorkerError` when its type cannot be rebuilt here).
            WorkerDiedError: in `next()`, when a worker process died and
                `max_worker_restarts` replacements were spent.
            RuntimeError: in `next()`, when no batch came within `timeout` seconds.
        """
        begun = clock()
        if self._pid != os.getpid():
            # a process forked from the loader's: the persistent workers and the arena's
            # slots are the parent's, in use there; this process starts its own
            self._pid, self._iterator, self._arena = os.getpid(), None, None
        self._resolve_auto()
        persistent = self.persistent_workers and self._auto is None and self.num_workers > 0
        if persistent and self._iterator is not None and self._iterator.usable() and self._resume is None:
            self._iterator.start_next_epoch(begun, self._iterable_len_called)
            self._epochs_started += 1
            return self._iterator
        if self._auto is None:
            warn_if_too_many_workers(self.num_workers, stacklevel=2)
        if not self._warned_unsharded:
            self._warned_unsharded = True
            self._warn_if_unsharded()
        resume, self._resume = self._resume, None
        replicas, self._resume_replicas = self._resume_replicas, []
        restore = self._resume_restore
        if resume is None:
            replicas, restore = self._carried(), False
        if resume is None and self._latest is not None:
            # a resumed run whose next epoch the saved run had already drawn (prefetched by
            # persistent workers), continued by a new iterator
            origin = self._latest.take_pending(self._epochs_started)
            if origin is not None:
                resume = {
                    "epoch": self._epochs_started,
                    "position": 0,
                    "origin": origin,
                    "drawn": True,
                    "base_seed": None,
                }
        iterator: LoaderIterator[Any] = LoaderIterator(self._plan(resume, replicas, restore), begun)
        self._latest = iterator.progress
        self._last_iterator = weakref.ref(iterator)
        self._last_recorder = iterator.recorder
        self._epochs_started += 1
        if persistent:
            self._iterator = iterator
        return iterator

    def _warn_if_unsharded(self) -> None:
        """Warn when several training ranks run and this loader's sampler does not split the
        dataset by rank: every rank would read all of it."""
        if self._iterable:  # a stream may shard itself by rank: nothing to see from here
            return
        world = torch_distributed_world() or ranks()[1]
        if world <= 1 or shards_by_rank(self._index_sampler):
            return
        warnings.warn(
            f"{world} training ranks are running and this DataLoader's sampler "
            f"({type(self.sampler).__name__}) does not split the dataset by rank, so every rank "
            "reads the whole dataset. Give it sampler=DistributedSampler(dataset) (or let your "
            "framework inject one: pass the loader to Lightning's Trainer or accelerate's "
            "prepare); if every rank should read everything (evaluation on each rank), silence "
            "this with warnings.filterwarnings('ignore', category=stoker.UnshardedWarning)",
            UnshardedWarning,
            stacklevel=3,
        )

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: its current iterator's position (or the start of its next
        epoch), as torchdata's `StatefulDataLoader.state_dict()` gives it. `load_state_dict`
        on a loader of the same configuration makes its next `iter()` continue exactly from
        here.

        stoker's own parts are plain JSON values (generator states, positions, counts); what a
        dataset, its iterator or a sampler returned from its own `state_dict()` is held as it
        was returned, never converted. Between epochs (before the first `iter()`, after an
        epoch's end), the next epoch's draws (its order and base seed) are made now, from the
        loader's `generator` or the global RNG, so that the state fixes them, as torchdata's
        does: the global RNG moves on here rather than at the next `iter()`.

        Returns:
            The state: a dict (see the user guide page "Randomness and resume").

        Raises:
            RuntimeError: when a replica's `state_dict()` (an IterableDataset's, its
                iterator's, or a map-style dataset's that keeps a state) raised; the message
                names the dataset, the worker and the error.
            TypeError: when such a state cannot be pickled (stoker keeps each state pickled
                from the moment it is taken); the message names the dataset and the worker.
        """
        try:
            # with the seed the run's per-sample draws derive from (see RandomSource.run_seed)
            view = self._resume_view()
            return dict(self._state(view), sample_seed=view.seed_source.run_seed)
        except ReplicaUnsaved as unsaved:
            where = "in this process (num_workers=0)" if self.num_workers == 0 else f"in worker {unsaved.worker}"
            error = TypeError if unsaved.kind == "pickle" else RuntimeError
            raise error(
                f"DataLoader.state_dict() cannot save the state of {type(self.dataset).__name__} {where}: "
                f"{unsaved}. A dataset's (or its iterator's) state_dict() must return a value "
                "that pickle can hold; stoker keeps it as returned"
            ) from None

    def _first_state(self) -> dict[str, Any]:
        """A state as `state_dict()` gives it, except that between epochs it makes no draws
        (the next epoch draws at its `iter()`, from the RNGs as they are then): for a framework
        that keeps a loader's state from the moment it wraps it (accelerate), where the user
        asked for none and the global RNG must move on as it does without stoker."""
        view = self._resume_view()
        return dict(self._state(view, fix=False), sample_seed=view.seed_source.run_seed)

    def _resume_view(self) -> SimpleNamespace:
        """What a state describes and draws from, read without building a whole plan (a
        `state_dict()` per step stays cheap): the fields `resume.describe` reads, and the seed
        source."""
        if self._seed_source is None or self._seed_source.generator is not self.generator:
            self._seed_source = RandomSource(self.generator, self._flavour)
        return SimpleNamespace(
            dataset=self.dataset,
            dataset_kind="iterable" if self._iterable else "map",
            index_sampler=native_index_sampler(self._index_sampler),
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            seed_source=self._seed_source,
        )

    def _state(self, plan: SimpleNamespace, fix: bool = True) -> dict[str, Any]:
        if self._resume is not None:  # loaded (or fixed) and not iterated yet: still that point
            return self._with_records(self._resume, self._resume_replicas)
        point = self._latest.point(fix=fix) if self._latest is not None else None
        if (point is None or not point.get("drawn", True)) and not fix:
            # between epochs, nothing drawn: the next epoch draws at its iter() (see _first_state)
            origin = capture_epoch(None if self._iterable else plan.index_sampler, plan.seed_source, draws_seed=True)
            point = {
                "epoch": self._epochs_started,
                "position": 0,
                "delivered_after": [],
                "drawn": False,
                "origin": origin,
                "base_seed": None,
                "next_origin": None,
                "replicas": self._replica_part(self._carried(), 0),
            }
        elif point is None or not point.get("drawn", True):
            # no epoch under way: the next one's draws are made now and kept for its iter()
            origin, base_seed = predraw(
                None if self._iterable else plan.index_sampler, plan.seed_source, draws_seed=True
            )
            carried = self._carried()
            point = {
                "epoch": self._epochs_started,
                "position": 0,
                "delivered_after": [],
                "drawn": True,
                "origin": origin,
                "base_seed": base_seed,
                "next_origin": None,
                "replicas": self._replica_part(carried, 0),
            }
            self._resume = {"version": STATE_VERSION, "config": self._described(plan), **point, "replicas": None}
            self._resume["replicas"] = None if point["replicas"] is None else dict(point["replicas"], records=[])
            self._resume_replicas, self._resume_restore = carried, False
            return self._with_records(self._resume, carried)
        return {"version": STATE_VERSION, "config": self._described(plan), **point}

    def _described(self, plan: Any) -> dict[str, Any]:
        """`resume.describe(plan)`, kept while what it reads stays the same: the index
        sampler, the dataset's length and a DistributedSampler's share (the rest is fixed at
        construction), so that a state taken every step does not describe the stream anew."""
        sharded = distributed_sampler(plan.index_sampler)
        key = (
            id(self._index_sampler),
            len(plan.dataset) if plan.dataset_kind == "map" else None,
            None
            if sharded is None
            else (
                sharded.num_replicas,
                sharded.rank,
                sharded.total_size,
                sharded.seed,
                sharded.shuffle,
                sharded.drop_last,
            ),
        )
        if self._description is None or self._description[0] != key:
            self._description = (key, describe_resume(plan))
        return dict(self._description[1])

    def _carried(self) -> list[Kept | None]:
        """The replicas' places at the start of a new iterator's first epoch: where the last
        iterator's left them when the replica is the loader's own dataset (num_workers=0, or
        thread workers), afresh when new workers copy the dataset."""
        count = max(int(self.num_workers), 1)
        if self._latest is None or not (self.num_workers == 0 or self.thread_pool):
            return [None] * count
        carried = self._latest.carried()
        return carried if len(carried) == count else [None] * count

    def _keeps_replicas(self) -> bool:
        return self._iterable or is_stateful(self.dataset)

    def _replica_part(self, kept: Sequence[Kept | None], next_worker: int) -> dict[str, Any] | None:
        if not self._keeps_replicas():
            return None
        return replica_part(list(kept), int(self.num_workers), next_worker)

    @staticmethod
    def _with_records(state: dict[str, Any], kept: Sequence[Kept | None]) -> dict[str, Any]:
        """A kept state with its replicas' records made afresh (the user's states unpickled
        anew, so that the caller never holds the loader's own objects)."""
        part = state.get("replicas")
        if part is None:
            return dict(state)
        return dict(state, replicas=dict(part, records=records(list(kept))))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`: the next `iter()` yields exactly the batches the
        saved run would have yielded next, and the epochs after match too.

        A persistent iterator still running is closed. The state may come from a loader with
        another `num_workers`, `prefetch_factor`, `batch_size` or number of ranks, within
        what the user guide page "Randomness and resume" describes; the replicas of an
        IterableDataset (or of a map-style dataset that keeps a state) resume only with the
        same number of workers, each in its own worker's place. A state of an older format
        (version 1) is read.

        Args:
            state: What `state_dict()` returned (also after a round trip through
                `torch.save`/`torch.load`, or through JSON when every state a dataset
                returned is JSON).

        Raises:
            ValueError: when the state is from another configuration (another dataset
                length, sampler, shuffle, seed source...), from an unknown version of the state
                format, lacks a key, holds a malformed replica record, or holds the states of
                another number of replicas than this loader's `num_workers`. The message says
                what differs, and nothing is applied.
        """
        plan = self._plan()
        config = describe_resume(plan)
        state = upgrade_state(state)
        check_resume(state, config)
        for key in ("epoch", "position", "origin"):
            if key not in state:
                raise ValueError(f"this DataLoader state lacks {key!r}; it was not applied")
        run_seed = _run_seed_of(state)
        kept = self._loaded_replicas(state.get("replicas"))
        if any(state["config"].get(key) != config.get(key) for key in ELASTIC_KEYS):
            state = make_elastic(state, plan.index_sampler, plan.auto_collation)
        if self._iterator is not None:  # a persistent iterator would go on from its own point
            self._iterator.close()
            self._iterator = None
        self._resume = dict(state)
        part = state.get("replicas")
        self._resume["replicas"] = None if part is None else dict(part, records=[])
        self._resume_replicas, self._resume_restore = kept, True
        self._epochs_started = int(state["epoch"])
        plan.seed_source.run_seed = run_seed  # None: the resumed iterator's base seed starts the run

    def _loaded_replicas(self, part: Any) -> list[Kept | None]:
        """A state's replica records checked against this loader, as the places its workers
        are put back in (nothing is applied when one does not fit)."""
        count = max(int(self.num_workers), 1)
        if part is None:
            if self._iterable:
                raise ValueError("this DataLoader state holds no replica records, which an IterableDataset needs")
            return [None] * count
        if not isinstance(part, dict) or not isinstance(part.get("records"), list):
            raise ValueError("this DataLoader state's 'replicas' is not a replica part (with 'records'); not applied")
        records = part["records"]
        kept = [Kept.loaded(r, f"replica record {w}") for w, r in enumerate(records)]
        if all(k is None for k in kept):
            return [None] * count
        saved_workers = part.get("num_workers")
        if saved_workers != self.num_workers or len(kept) != count:
            what = "IterableDataset replica(s)" if self._iterable else f"{type(self.dataset).__name__} replica(s)"
            raise ValueError(
                f"this DataLoader state holds the states of {len(kept)} {what} "
                f"(num_workers={saved_workers}); this loader has num_workers={self.num_workers}: a "
                "dataset that keeps a state resumes only with the same number of workers, each "
                "replica in its own worker's place"
            )
        replayed = sum(k.drawn - k.drawn_at for k in kept if k is not None)
        if replayed and self._iterable and not is_stateful(self.dataset):
            warnings.warn(
                f"resuming {type(self.dataset).__name__} by replaying the {replayed} item(s) its replicas had "
                "drawn since their last saved state (a dataset without state_dict()/load_state_dict(state) "
                "has none): each worker draws its stream again up to where it was, without collating (the "
                "time grows with the position)",
                UserWarning,
                stacklevel=3,
            )
        if not self._iterable and not is_stateful(self.dataset):
            raise ValueError(
                f"this DataLoader state holds the states of a dataset's replicas; this loader's "
                f"{type(self.dataset).__name__} keeps none (no state_dict()/load_state_dict(state)): "
                "it was not applied"
            )
        return kept

    def __len__(self) -> int:
        """The number of batches in an epoch (samples without automatic batching).

        For an IterableDataset, an estimate from `len(dataset)` (a warning follows if more
        batches arrive), as torch's.

        Raises:
            TypeError: when the dataset (or the sampler) has no `len()`.
        """
        if self._iterable:
            length = self._iterable_len_called = len(self.dataset)  # type: ignore[arg-type]
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else math.ceil(length / self.batch_size)
            return length
        return len(self._index_sampler)

    def stats(self) -> LoaderStats:
        """The figures of this loader's latest epoch: the one it is delivering, or the one
        it delivered last (also after its iterator was dropped).

        Returns:
            A `LoaderStats` snapshot (batches, throughput, the consumer's waits, per-worker
            figures, what "auto" chose); the user guide page "Statistics and the doctor"
            explains its fields.

        Raises:
            RuntimeError: when the loader was made with `stats=False`, or before the first
                `iter()`.
        """
        if not self.stats_enabled:
            raise RuntimeError(
                "this DataLoader was made with stats=False, so it keeps no statistics; make it "
                "with stats=True (the default) to read stats()"
            )
        iterator = self._last_iterator() if self._last_iterator is not None else None
        if iterator is not None:
            return iterator.stats()
        if self._last_recorder is None:
            raise RuntimeError("this DataLoader has not been iterated yet: stats() describes an epoch begun by iter()")
        return self._last_recorder.snapshot(0)

    def check_worker_number_rationality(self) -> None:
        """Warn, with torch's `UserWarning`, when `num_workers` exceeds the CPUs this
        process may use (torch's method of the same name; the constructor and `iter()` call
        it already)."""
        if self._auto is None:
            warn_if_too_many_workers(self.num_workers, stacklevel=2)


def _run_seed_of(state: dict[str, Any]) -> int | None:
    """The run seed a state names (`sample_seed`; None in a state saved before its run drew one,
    or by an older stoker)."""
    seed = state.get("sample_seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(
            f"this DataLoader state's 'sample_seed' should be an int >= 0 or None, but got {seed!r}; it was not applied"
        )
    return seed
