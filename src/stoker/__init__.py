"""stoker: a data loader that keeps an accelerator fed.

The API is `torch.utils.data`'s, plus MXNet Gluon's `last_batch`, `batchify_fn` and
`thread_pool`. This flavour keeps numpy as numpy; `stoker.torch` is the drop-in flavour
whose batches are torch tensors, exactly as `torch.utils.data` makes them.
"""

from ._collate import collate, default_collate, default_collate_fn_map, default_convert
from ._datasets import (
    ArrayDataset,
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
    random_split,
)
from ._distributed import DistributedSampler
from ._errors import WorkerDiedError, WorkerError, WorkerRestartWarning
from ._loader import DataLoader
from ._samplers import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from ._worker import WorkerInfo, get_worker_info

__version__ = "0.1.0"

__all__ = [
    "ArrayDataset",
    "BatchSampler",
    "ChainDataset",
    "ConcatDataset",
    "DataLoader",
    "Dataset",
    "DistributedSampler",
    "IterableDataset",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "StackDataset",
    "Subset",
    "SubsetRandomSampler",
    "TensorDataset",
    "WeightedRandomSampler",
    "WorkerDiedError",
    "WorkerRestartWarning",
    "WorkerError",
    "WorkerInfo",
    "collate",
    "default_collate",
    "default_collate_fn_map",
    "default_convert",
    "get_worker_info",
    "random_split",
]
