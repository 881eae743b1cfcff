"""`DistributedSampler`: each of `num_replicas` processes reads its own shard of the dataset."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Sized
from typing import Any, cast

import numpy as np

from .samplers import Sampler


def _from_torch_distributed() -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_world_size(), dist.get_rank()


def torch_distributed_world() -> int:
    """torch.distributed's world size when it is initialised, else 0."""
    found = _from_torch_distributed()
    return found[0] if found is not None else 0


DEFAULT_SEED = 0  # torch's DistributedSampler default: every rank shuffles alike, unasked


def ranks() -> tuple[int, int, int | None]:
    """(rank, world size, local rank) of this process: torch.distributed's when initialised,
    else torchrun's RANK / WORLD_SIZE / LOCAL_RANK, else (0, 1, None)."""
    found = _from_torch_distributed()
    world, rank = found if found is not None else (_from_env("WORLD_SIZE", 1), _from_env("RANK", 0))
    local = _from_env("LOCAL_RANK", -1)
    return rank, world, (local if local >= 0 else None)


def _from_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} should be an integer, but got {name}={raw!r}") from None


# attribute pairs that mark a sampler as one rank's share: torch's and stoker's
# DistributedSampler (and Lightning's wrapper of it), accelerate's BatchSamplerShard
_RANK_MARKS = (("num_replicas", "rank"), ("num_processes", "process_index"))
# where samplers and batch samplers keep the one they wrap
_WRAPPED = ("sampler", "batch_sampler", "_sampler", "_batch_sampler")


def shards_by_rank(index_sampler: Any) -> bool:
    """Whether `index_sampler` (a sampler or a batch sampler, possibly wrapping others) gives
    each training rank its own share of the dataset."""
    seen: set[int] = set()
    todo = [index_sampler]
    while todo:
        part = todo.pop()
        if part is None or id(part) in seen or len(seen) > 16:
            continue
        seen.add(id(part))
        if any(hasattr(part, a) and hasattr(part, b) for a, b in _RANK_MARKS):
            return True
        todo.extend(getattr(part, name, None) for name in _WRAPPED)
    return False


class DistributedSampler(Sampler[int]):
    """Indices of one replica's shard; shuffled per epoch from `seed + epoch` when `shuffle`.

    Every rank must pass the same `seed` (and `shuffle`, `drop_last`): the ranks' shards are
    disjoint because they shuffle alike, and nothing is communicated to make them so. Without
    `drop_last`, indices are repeated so every replica gets the same number; with it, the tail
    that does not divide evenly is dropped. Call `set_epoch` before each epoch.

    Args:
        dataset: The map-style dataset; only its length is read.
        num_replicas: The number of ranks (int > 0). None means torch.distributed's world
            size when it is initialised, else the `WORLD_SIZE` environment variable, else
            1. Defaults to None.
        rank: This rank (0 <= rank < num_replicas). None means torch.distributed's rank,
            else the `RANK` environment variable, else 0. Defaults to None.
        shuffle: Shuffle the indices each epoch from `seed + epoch`. Defaults to True.
        seed: The shuffling seed, an int (0 as in torch). None means the same default
            seed, 0: a seed that differs between ranks, drawn or agreed, would need the
            ranks to communicate inside this constructor, which stoker never does.
            Defaults to 0.
        drop_last: Drop the tail that does not divide evenly by `num_replicas`; when
            False, indices are repeated to pad it. Defaults to False.

    Raises:
        ValueError: when `num_replicas` is not a positive int, when `rank` is outside
            [0, num_replicas - 1] (torch's wording), or when `WORLD_SIZE` or `RANK` is
            read and is not an integer.
        TypeError: when `seed` is neither an int nor None.
    """

    _flavour = "numpy"

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int | None = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            found = _from_torch_distributed()
            if num_replicas is None:
                num_replicas = found[0] if found else _from_env("WORLD_SIZE", 1)
            if rank is None:
                rank = found[1] if found else _from_env("RANK", 0)
        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas <= 0:
            raise ValueError(f"num_replicas should be a positive integer, but got num_replicas={num_replicas!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank >= num_replicas or rank < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        n = len(dataset)
        if drop_last and n % num_replicas != 0:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.shuffle = shuffle
        if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)):
            raise TypeError(f"seed should be an int or None, but got seed={seed!r}")
        self.seed = DEFAULT_SEED if seed is None else int(seed)

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        if type(self)._flavour == "torch":
            import torch

            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=g).tolist()
        return np.random.default_rng(self.seed + self.epoch).permutation(n).tolist()

    def __iter__(self) -> Iterator[int]:
        return self._iter_from(0)

    def _pad(self, indices: list[int], total: int) -> list[int]:
        if not self.drop_last:
            padding = total - len(indices)
            if indices and padding > 0:
                indices = indices + (indices * math.ceil(padding / len(indices)))[:padding]
            return indices
        return indices[:total]

    def resume_elastic(self, consumed: int, old_replicas: int, old_total: int) -> None:
        """Make the next iteration the rest of an epoch begun under another world size.

        `old_replicas` ranks had each consumed `consumed` samples of the epoch; the next
        iteration gives the samples none of them took, split over this world's ranks.
        The epochs after are ordinary. Every rank must make the same call.

        Args:
            consumed: How many samples each old rank had consumed of the epoch.
            old_replicas: The old world size (the number of ranks then).
            old_total: The old sampler's `total_size` (padded or truncated length of the
                epoch under the old world size).
        """
        self._elastic = (int(consumed), int(old_replicas), int(old_total))

    _elastic: tuple[int, int, int] | None = None

    def _rest_of_elastic_epoch(self) -> list[int]:
        consumed, old_replicas, old_total = self._elastic  # type: ignore[misc]
        if (old_replicas, old_total) == (self.num_replicas, self.total_size):
            # the same world, another rank's state (Lightning saves rank 0's loader state and
            # every rank loads it): this rank's share as the uninterrupted epoch gives it, from
            # where every rank was, padded as that epoch pads its tail (with the epoch's first
            # indices, though an old rank may have read them), not with the rest's
            share = self._pad(self._order(), self.total_size)[self.rank : self.total_size : self.num_replicas]
            return share[consumed:]
        # ranks take interleaved indices, so together they took the first consumed x world
        rest = self._order()[min(consumed * old_replicas, old_total) : old_total]
        per_rank = len(rest) // self.num_replicas if self.drop_last else math.ceil(len(rest) / self.num_replicas)
        total = per_rank * self.num_replicas
        return self._pad(rest, total)[self.rank : total : self.num_replicas]

    def _iter_from(self, skip: int) -> Iterator[int]:
        if self._elastic is not None:
            shard = self._rest_of_elastic_epoch()
            self._elastic = None
            return iter(shard[skip:])
        indices = self._order()
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if indices and padding > 0:
                indices += (indices * math.ceil(padding / len(indices)))[:padding]
        else:
            indices = indices[: self.total_size]
        return iter(indices[self.rank : self.total_size : self.num_replicas][skip:])

    def __len__(self) -> int:
        if self._elastic is not None:
            return len(self._rest_of_elastic_epoch())
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch whose order the next iteration gives.

        The shuffle is seeded with `seed + epoch`: call this before each epoch, with the
        same value on every rank, or every epoch repeats the same order.

        Args:
            epoch: The epoch number.
        """
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state: what fixes the order of the current epoch.

        Returns:
            A dict with `epoch` and `seed`.
        """
        return {"epoch": self.epoch, "seed": self.seed}


class RankShareSampler(DistributedSampler):
    """Base of stoker's own samplers of one rank's share that torch has no class for
    (`ShardedSampler`, `StreamSampler`).

    Training frameworks shard a loader again unless its sampler is a
    `torch.utils.data.DistributedSampler`: Lightning and Fabric wrap any other sampler in theirs,
    and each rank would read half of its share. So an instance made while torch is imported is
    also of torch's DistributedSampler kind (`rank_share_kind`: a subclass of both,
    named as its class), and the frameworks keep it; made without torch, it is this class, and
    `import stoker.shards` or `stoker.mix` never imports torch. accelerate shards whatever it
    gets: stoker's wrapping of `accelerator.prepare` (`_frameworks/accelerate.py`) finds these
    samplers by this class and keeps their shares.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        kind: type = cls
        if "torch.utils.data" in sys.modules:  # imported by someone: never imported from here
            kind = rank_share_kind(cls)
        return object.__new__(kind)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # the torch kind is made at run time: pickled as its plain class and made again,
        # of the kind the unpickling process gives it
        getstate = getattr(self, "__getstate__", None)
        state = getstate() if getstate is not None else dict(vars(self))
        return (_made_again, (plain_kind(type(self)), state))


_RANK_SHARE_KINDS: dict[type, type] = {}


def rank_share_kind(cls: type) -> type:
    """`cls` (a `RankShareSampler` subclass) of torch's DistributedSampler kind: a subclass of
    both, of the same name and module, made once per class. `cls` itself when it already is.
    Called only once torch is imported (it is never imported from here)."""
    import torch.utils.data as td

    if issubclass(cls, td.DistributedSampler):
        return cls
    kind = _RANK_SHARE_KINDS.get(cls)
    if kind is None:
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "_plain_kind": cls,
        }
        kind = _RANK_SHARE_KINDS.setdefault(cls, type(cls.__name__, (cls, td.DistributedSampler), namespace))
    return kind


def plain_kind(cls: type) -> type:
    """The class a rank-share sampler's torch kind was made from (or `cls` itself)."""
    return cast(type, vars(cls).get("_plain_kind", cls))


def _made_again(cls: Any, state: Any) -> Any:
    """A pickled rank-share sampler, made again (its kind chosen in this process)."""
    made = cls.__new__(cls)
    setstate = getattr(made, "__setstate__", None)
    if setstate is not None:
        setstate(state)
    elif state:
        vars(made).update(state)
    return made
