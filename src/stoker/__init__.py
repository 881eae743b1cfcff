"""stoker: a data loader that keeps an accelerator fed.

The API is `torch.utils.data`'s, plus MXNet Gluon's `last_batch`, `batchify_fn` and
`thread_pool`. This flavour keeps numpy as numpy; `stoker.torch` is the drop-in flavour
whose batches are torch tensors, exactly as `torch.utils.data` makes them.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Names are imported on first use, so that a worker process (spawn, forkserver) that
# unpickles a dataset subclassing stoker.Dataset imports what it needs and not the loader,
# the iterator or the doctor: start-up time is import time there.
_EXPORTS = {
    "ArrayRecordDataset": "._shards.array_record",
    "UnshardedWarning": "._core.errors",
    "WorkerDiedError": "._core.errors",
    "WorkerError": "._core.errors",
    "WorkerRestartWarning": "._core.errors",
    "DataLoader": "._core.loader",
    "sample_rng": "._core.seeding",
    "sample_seed": "._core.seeding",
    "LoaderStats": "._core.stats",
    "WorkerStats": "._core.stats",
    "WorkerInfo": "._core.worker",
    "get_worker_info": "._core.worker",
    "collate": "._data.collate",
    "default_collate": "._data.collate",
    "default_collate_fn_map": "._data.collate",
    "default_convert": "._data.collate",
    "ArrayDataset": "._data.datasets",
    "ChainDataset": "._data.datasets",
    "ConcatDataset": "._data.datasets",
    "Dataset": "._data.datasets",
    "IterableDataset": "._data.datasets",
    "StackDataset": "._data.datasets",
    "Subset": "._data.datasets",
    "TensorDataset": "._data.datasets",
    "random_split": "._data.datasets",
    "DistributedSampler": "._data.distributed",
    "BatchSampler": "._data.samplers",
    "RandomSampler": "._data.samplers",
    "Sampler": "._data.samplers",
    "SequentialSampler": "._data.samplers",
    "SubsetRandomSampler": "._data.samplers",
    "WeightedRandomSampler": "._data.samplers",
    "SharedList": "._data.shared_list",
    "Shard": "._data.stream_split",
    "shard_for": "._data.stream_split",
}

if TYPE_CHECKING:
    from ._core.errors import UnshardedWarning, WorkerDiedError, WorkerError, WorkerRestartWarning
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
    from ._data.stream_split import Shard, shard_for
    from ._shards.array_record import ArrayRecordDataset


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stoker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__version__ = "0.1.0"

__all__ = [
    "ArrayDataset",
    "ArrayRecordDataset",
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
    "shard_for",
    "random_split",
    "sample_rng",
    "sample_seed",
]
