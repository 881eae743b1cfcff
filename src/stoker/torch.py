"""The drop-in flavour: `from stoker.torch import DataLoader` replaces
`from torch.utils.data import DataLoader`.

Same names as `torch.utils.data` (plus `get_worker_info`, and stoker's `sample_seed` and
`sample_rng`). Batches are torch tensors made exactly as torch's `default_collate` makes
them, and randomness without an explicit `generator` comes from torch's global RNG, so
`torch.manual_seed` reproduces a run the way it does with torch. Needs torch
(`pip install stoker[torch]`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "stoker.torch needs PyTorch; install it with `pip install stoker[torch]`, "
        "or use `stoker` (numpy batches) instead"
    ) from exc

from ._core import loader as _loader
from ._core.device import to_device
from ._core.errors import WorkerDiedError, WorkerError, WorkerRestartWarning
from ._core.seeding import sample_rng, sample_seed
from ._core.stats import LoaderStats, WorkerStats
from ._core.worker import WorkerInfo, get_worker_info
from ._data import datasets as _datasets
from ._data import distributed as _distributed
from ._data import samplers as _samplers
from ._data.collate import CollateFnMap
from ._data.datasets import (
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
)
from ._data.rng import GeneratorLike
from ._data.samplers import BatchSampler, Sampler, SequentialSampler
from ._data.shard import Shard, shard_for
from ._data.shared_list import SharedList
from ._data.torch_collate import collate as _collate
from ._data.torch_collate import default_collate, default_convert
from ._data.torch_collate import default_collate_fn_map as _default_map

T = TypeVar("T")


class RandomSampler(_samplers.RandomSampler):
    __doc__ = _samplers.RandomSampler.__doc__
    _flavour = "torch"


class SubsetRandomSampler(_samplers.SubsetRandomSampler):
    __doc__ = _samplers.SubsetRandomSampler.__doc__
    _flavour = "torch"


class WeightedRandomSampler(_samplers.WeightedRandomSampler):
    __doc__ = _samplers.WeightedRandomSampler.__doc__
    _flavour = "torch"


class DistributedSampler(_distributed.DistributedSampler):
    __doc__ = _distributed.DistributedSampler.__doc__
    _flavour = "torch"


class DataLoader(_loader.DataLoader[T]):
    __doc__ = _loader.DataLoader.__doc__
    _flavour = "torch"
    _random_sampler_cls = RandomSampler

    @staticmethod
    def _default_collate() -> Callable[[list[Any]], Any]:
        return default_collate

    @staticmethod
    def _default_convert() -> Callable[[Any], Any]:
        return default_convert


def random_split(
    dataset: Dataset[T], lengths: Sequence[int | float], generator: GeneratorLike = None
) -> list[Subset[T]]:
    """Split a dataset into non-overlapping random subsets; equals torch's `random_split`
    for the same generator (torch's global RNG when none is given)."""
    return _datasets.random_split(dataset, lengths, generator, _flavour="torch")


def collate(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """torch's `collate`: dispatch on the first sample's type through `collate_fn_map`."""
    return _collate(batch, collate_fn_map=collate_fn_map)


default_collate_fn_map: CollateFnMap = _default_map()

__all__ = [
    "BatchSampler",
    "ChainDataset",
    "ConcatDataset",
    "DataLoader",
    "Dataset",
    "DistributedSampler",
    "IterableDataset",
    "LoaderStats",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "Shard",
    "SharedList",
    "StackDataset",
    "Subset",
    "SubsetRandomSampler",
    "TensorDataset",
    "WeightedRandomSampler",
    "WorkerDiedError",
    "WorkerRestartWarning",
    "WorkerStats",
    "WorkerError",
    "WorkerInfo",
    "collate",
    "default_collate",
    "default_collate_fn_map",
    "default_convert",
    "get_worker_info",
    "shard_for",
    "random_split",
    "sample_rng",
    "sample_seed",
    "to_device",
]
