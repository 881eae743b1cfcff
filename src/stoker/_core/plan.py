"""`LoadPlan`: everything an iterator needs from its DataLoader, as one frozen value.

The loader validates its arguments and builds the plan (`DataLoader._plan()`); the
iterator and the engines read only the plan, so neither imports the loader nor touches
its attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._data.rng import RandomSource
    from .arena import Arena
    from .auto import AutoStart


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

    @property
    def iterable(self) -> bool:
        return self.dataset_kind == "iterable"

    @property
    def processes(self) -> bool:
        """Workers are processes (not threads, not the caller's thread)."""
        return self.num_workers > 0 and not self.threads
