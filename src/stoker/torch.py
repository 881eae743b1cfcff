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

from ._base.hooks import Stateful
from ._core.errors import UnshardedWarning, WorkerDiedError, WorkerError, WorkerRestartWarning
from ._core.seeding import sample_rng, sample_seed
from ._core.stats import LoaderStats, WorkerStats
from ._core.torch_loader import DataLoader, StatefulDataLoader
from ._core.torch_place import normalize, to_device
from ._core.worker import WorkerInfo, get_worker_info
from ._data import datasets as _datasets
from ._data.collate import CollateFnMap
from ._data.rng import GeneratorLike
from ._data.shared_list import SharedList
from ._data.stream_split import Shard, shard_for
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
    """Split a dataset into non-overlapping random subsets of the given lengths, as torch's
    `random_split` does: for the same generator (or the same state of torch's global RNG)
    the subsets are torch's, index for index.

    Args:
        dataset: The dataset to split.
        lengths: The subsets' lengths, summing to `len(dataset)`; or fractions summing to
            1, each made `floor(fraction * len(dataset))` long and the remainder spread one
            by one over the subsets in turn.
        generator: Where the permutation is drawn from: a `torch.Generator`, a
            `numpy.random.Generator` or an int seed; None draws from torch's global RNG.
            Defaults to None.

    Returns:
        One `Subset` of `dataset` per length, in the order of `lengths`.

    Raises:
        ValueError: when a fraction is not between 0 and 1, or the lengths (or fractions)
            do not add up to the dataset's length (or to 1).
        TypeError: when `generator` is of another type.
    """
    return _datasets.split_randomly(dataset, lengths, generator, "torch", Subset)  # type: ignore[arg-type, return-value]


def collate(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """Merge a list of samples into a batch as torch's `collate` does: the function
    registered in `collate_fn_map` for the type of the first sample collates the batch;
    dicts, namedtuples, tuples and lists are collated field by field, recursively.

    Args:
        batch: The samples of one batch.
        collate_fn_map: Type to function `fn(batch, *, collate_fn_map)` that collates a
            batch of that type (a subclass finds its base's). None: only containers are
            collated. `default_collate_fn_map` is torch's table, to copy and extend.
            Defaults to None.

    Returns:
        The batch, of the structure of one sample.

    Raises:
        TypeError: when a sample's type has no function in `collate_fn_map` and is no
            container.
        RuntimeError: when the sequences of a batch are not all of the same length.
    """
    return _collate(batch, collate_fn_map=collate_fn_map)


default_collate_fn_map: CollateFnMap = _default_map()
"""torch's `default_collate_fn_map`: the type-to-function table `default_collate` uses
(tensors, numpy arrays and scalars, floats, ints, strings, bytes). Copy it and add entries to
collate a type of your own with `collate(batch, collate_fn_map=...)`."""

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
    "Stateful",
    "StatefulDataLoader",
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
