"""stoker: a data loader that keeps an accelerator fed.

The API is `torch.utils.data`'s, plus MXNet Gluon's `last_batch`, `batchify_fn` and
`thread_pool`. This flavour keeps numpy as numpy; `stoker.torch` is the drop-in flavour
whose batches are torch tensors, exactly as `torch.utils.data` makes them.
"""

from ._core.errors import WorkerDiedError, WorkerError, WorkerRestartWarning
from ._core.loader import DataLoader
from ._core.seeding import sample_rng, sample_seed
from ._core.stats import LoaderStats, WorkerStats
from ._core.worker import WorkerInfo, get_worker_info
from ._data.collate import collate, default_collate, default_collate_fn_map, default_convert
from ._data.datasets import (
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
from ._data.distributed import DistributedSampler
from ._data.samplers import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from ._data.shared_list import SharedList

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
    "LoaderStats",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
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
    "random_split",
    "sample_rng",
    "sample_seed",
]
