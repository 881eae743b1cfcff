"""The drop-in flavour: `from stoker.torch import DataLoader` replaces
`from torch.utils.data import DataLoader`.

Same names as `torch.utils.data` (plus `get_worker_info`, and stoker's `sample_seed` and
`sample_rng`), of torch's kind: `DataLoader` is a `torch.utils.data.DataLoader`, `Dataset`,
`IterableDataset` and `Sampler` are torch's own classes and the other datasets and samplers
subclass torch's, so training frameworks (Lightning, accelerate) treat them as torch's.
Batches are torch tensors made exactly as torch's `default_collate` makes them, and
randomness without an explicit `generator` comes from torch's global RNG, so
`torch.manual_seed` reproduces a run the way it does with torch. Needs torch
(`pip install stoker[torch]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "stoker.torch needs PyTorch; install it with `pip install stoker[torch]`, "
        "or use `stoker` (numpy batches) instead"
    ) from exc

from ._core.device import normalize, to_device
from ._core.errors import UnshardedWarning, WorkerDiedError, WorkerError, WorkerRestartWarning
from ._core.seeding import sample_rng, sample_seed
from ._core.stats import LoaderStats, WorkerStats
from ._core.torch_loader import DataLoader
from ._core.worker import WorkerInfo, get_worker_info
from ._data import datasets as _datasets
from ._data.collate import CollateFnMap
from ._data.rng import GeneratorLike
from ._data.shard import Shard, shard_for
from ._data.shared_list import SharedList
from ._data.torch_collate import collate as _collate
from ._data.torch_collate import default_collate, default_convert
from ._data.torch_collate import default_collate_fn_map as _default_map
from ._data.torch_kinds import (
    BatchSampler,
    ChainDataset,
    ConcatDataset,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    StackDataset,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from ._frameworks import accelerate as _accelerate
from ._frameworks.accelerate import adopt

T = TypeVar("T")

_accelerate.install()  # accelerate's prepare keeps stoker loaders stoker's (now or when imported)


def random_split(
    dataset: Dataset[T], lengths: Sequence[int | float], generator: GeneratorLike = None
) -> list[Subset[T]]:
    """Split a dataset into non-overlapping random subsets; equals torch's `random_split`
    for the same generator (torch's global RNG when none is given)."""
    return _datasets.split_randomly(dataset, lengths, generator, "torch", Subset)  # type: ignore[arg-type, return-value]


def collate(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """torch's `collate`: dispatch on the first sample's type through `collate_fn_map`."""
    return _collate(batch, collate_fn_map=collate_fn_map)


default_collate_fn_map: CollateFnMap = _default_map()

__all__ = [
    "adopt",
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
    "UnshardedWarning",
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
    "normalize",
    "shard_for",
    "random_split",
    "sample_rng",
    "sample_seed",
    "to_device",
]
