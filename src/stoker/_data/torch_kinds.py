"""stoker.torch's datasets and samplers, of torch's kind.

`Dataset`, `IterableDataset` and `Sampler` are torch's own classes, and so are
`ConcatDataset` and `ChainDataset`: they are what `a + b` makes of torch's datasets, so the
exported name must be that class. The other dataset wrappers and the samplers subclass both
stoker's class (its behaviour: torch's exact random sequences, skipping an epoch's
consumed batches without fetching them on resume, elastic resume across world sizes) and
torch's (its type), so that `isinstance` checks in torch and in training frameworks
(Lightning's sampler injection, accelerate's `prepare`) answer as they do for torch's.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.utils.data as _td

from . import datasets as _datasets
from . import distributed as _distributed
from . import samplers as _samplers

T_co = TypeVar("T_co", covariant=True)

Dataset = _td.Dataset
IterableDataset = _td.IterableDataset
Sampler = _td.Sampler


ConcatDataset = _td.ConcatDataset
ChainDataset = _td.ChainDataset


class _AddsTorchKinds:
    """`a + b` gives torch's ConcatDataset (ChainDataset for streams), as torch's does
    (stoker's Dataset comes first in these classes' order and would make its own)."""

    def __add__(self, other: Any) -> Any:
        this: Any = self
        if isinstance(this, _td.IterableDataset):
            return ChainDataset([this, other])
        return ConcatDataset([this, other])


class TensorDataset(_AddsTorchKinds, _datasets.TensorDataset, _td.TensorDataset):
    __doc__ = _datasets.TensorDataset.__doc__


class Subset(_AddsTorchKinds, _datasets.Subset[T_co], _td.Subset[T_co]):  # type: ignore[misc]
    __doc__ = _datasets.Subset.__doc__


class StackDataset(_AddsTorchKinds, _datasets.StackDataset, _td.StackDataset):
    __doc__ = _datasets.StackDataset.__doc__


class SequentialSampler(_samplers.SequentialSampler, _td.SequentialSampler):
    __doc__ = _samplers.SequentialSampler.__doc__


class RandomSampler(_samplers.RandomSampler, _td.RandomSampler):
    __doc__ = _samplers.RandomSampler.__doc__
    _flavour = "torch"


class SubsetRandomSampler(_samplers.SubsetRandomSampler, _td.SubsetRandomSampler):
    __doc__ = _samplers.SubsetRandomSampler.__doc__
    _flavour = "torch"


class WeightedRandomSampler(_samplers.WeightedRandomSampler, _td.WeightedRandomSampler):  # type: ignore[misc]
    __doc__ = _samplers.WeightedRandomSampler.__doc__
    _flavour = "torch"


class BatchSampler(_samplers.BatchSampler, _td.BatchSampler):
    __doc__ = _samplers.BatchSampler.__doc__


class DistributedSampler(_distributed.DistributedSampler, _td.DistributedSampler):  # type: ignore[misc]
    __doc__ = _distributed.DistributedSampler.__doc__
    _flavour = "torch"
