"""torch DataPipes, read as torch's DataLoader reads them.

An `IterDataPipe` (`torch.utils.data.datapipes`) is a graph of iterable stages. Two of its
stages take their settings from the loader, not from the user:

- a random stage (`.shuffle()`, anything with `set_shuffle` and `set_seed`) is given a seed
  at the start of every epoch. The loader draws one *shared seed* per epoch from its
  `generator` (torch's global RNG without one), exactly as it draws the workers' base seed,
  and every copy of the pipe (the main process's with num_workers=0, each worker's) seeds its
  random stages from a `torch.Generator` seeded with it. So every worker shuffles alike;
- a `sharding_filter()` keeps, in each copy, the items of that copy's share: worker `w` of
  `n` on training rank `r` of `world` keeps share `w * world + r` of `n * world`; with
  num_workers=0, share `r` of `world`. torch.distributed's rank and world size count when it
  is initialised, as in torch; otherwise the share is the whole. The ranks then use rank 0's
  shared seed (broadcast over a gloo group each iterator makes), so that they shuffle alike
  and their shares split one order.

The order of the draws from the loader's randomness is torch's: an iterator draws the shared
seed of its first epoch, then the base seed, and, with workers, one more shared seed that
torch draws when it primes the workers (and applies to the main process's copy); each later
epoch of persistent workers draws one shared seed, sent to the workers with the epoch's
`Reset`. So for the same `torch.manual_seed` (or generator) the items come in torch's order.

A spawn or forkserver worker receives the dataset pickled. A pipe that pickle cannot take
(one holding a lambda or a local function, as `.map(lambda x: ...)` makes) is then sent
through `dill` when it is installed, as torch's loader sends it: the worker start-up pickling
(see sharing) tries pickle first and, when that fails, pickles each DataPipe it meets with
dill (no shared-memory path then for arrays inside such a pipe). `loader.dataset` stays the
user's pipe (torch's loader replaces it by a private wrapper that does this pickling).

Nothing here imports torch: a dataset is a DataPipe only if torch's data package is already
loaded (it defines the class the dataset is an instance of).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def is_iter_datapipe(dataset: Any) -> bool:
    """Whether `dataset` is a torch `IterDataPipe` (False when torch's data package is not
    loaded: then nothing can be one)."""
    data = sys.modules.get("torch.utils.data")
    pipe_class = getattr(data, "IterDataPipe", None)
    return pipe_class is not None and isinstance(dataset, pipe_class)


def datapipe_classes() -> tuple[type, ...]:
    """torch's DataPipe base classes (`IterDataPipe`, `MapDataPipe`) when torch's data package
    is loaded, else ()."""
    data = sys.modules.get("torch.utils.data")
    found = (getattr(data, "IterDataPipe", None), getattr(data, "MapDataPipe", None))
    return tuple(c for c in found if isinstance(c, type))


def import_dill() -> Any:
    """The `dill` module, or None when it is not installed. Importing dill registers its
    types with the standard library's Python pickler; that is undone, so that nothing else
    pickles differently."""
    try:
        dill = importlib.import_module("dill")  # optional, and untyped
    except ImportError:
        return None
    dill.extend(use_dill=False)
    return dill


def reduce_by_dill(pipe: Any, dill: Any) -> tuple[Any, tuple[bytes]]:
    """A pickle reduction of `pipe` made by `dill`, which pickles lambdas and local functions
    by value; it unpickles as the pipe."""
    return _load_by_dill, (dill.dumps(pipe),)


def _load_by_dill(body: bytes) -> Any:
    dill = import_dill()
    if dill is None:
        raise ModuleNotFoundError(
            "this DataPipe was pickled with dill for a worker process, and dill is not installed in the worker"
        )
    return dill.loads(body)


def seed_pipe(dataset: Any, shared_seed: int) -> None:
    """Give each random stage of the pipe its seed for the next epoch, drawn from a
    `torch.Generator` seeded with `shared_seed` (the same in every copy of the pipe)."""
    import torch
    from torch.utils.data import graph_settings

    rng = torch.Generator()
    rng.manual_seed(shared_seed)
    graph_settings.apply_random_seed(dataset, rng)


def shard_pipe(dataset: Any, shares: int, share: int) -> None:
    """Make the pipe's `sharding_filter` keep share `share` of `shares`."""
    from torch.utils.data import graph_settings

    graph_settings.apply_sharding(dataset, shares, share)


def _distributed() -> Any:
    """torch.distributed when it is loaded and initialised, else None."""
    dist: Any = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def distributed_share() -> tuple[int, int]:
    """(world size, rank) of torch.distributed when it is initialised, else (1, 0): what a
    DataPipe is sharded by across training ranks, as torch's loader shards it. Read in the
    main process (a spawned worker has no process group)."""
    dist = _distributed()
    if dist is not None:
        return int(dist.get_world_size()), int(dist.get_rank())
    return 1, 0


def seed_group() -> Any:
    """The process group that the ranks agree on each shared seed through: a new gloo group
    when torch.distributed is initialised (a collective call: every rank makes its iterator at
    the same point, as torch's loader requires), else None."""
    dist = _distributed()
    return None if dist is None else dist.new_group(backend="gloo")


def agreed_seed(drawn: int, group: Any) -> int:
    """The shared seed every rank uses: rank 0's, broadcast through `group` (each rank has
    drawn its own, so every rank's randomness moves alike); `drawn` without a group."""
    if group is None:
        return drawn
    import torch
    import torch.distributed as dist

    seed = torch.tensor(drawn, dtype=torch.int64)
    dist.broadcast(seed, src=0, group=group)
    return int(seed.item())


def prepare_worker_copy(
    dataset: Any, shared_seed: int, worker_id: int, num_workers: int, share: tuple[int, int]
) -> None:
    """Seed and shard a worker's copy of the pipe before its first epoch: worker `worker_id`
    of `num_workers` keeps its share of the items of its training rank (`share`: world size,
    rank)."""
    world, rank = share
    seed_pipe(dataset, shared_seed)
    shard_pipe(dataset, num_workers * world, worker_id * world + rank)
