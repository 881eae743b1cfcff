"""Datasets bigger than the machine: shards at a URL, read through a bounded local cache.

`write_shards` writes any dataset as shards (WebDataset tar or Parquet) and an index to a
URL prefix (`s3://`, a local path, or any scheme of the client layer); `build_index` (or the
`stoker index URL` command) indexes shards another tool wrote. `ShardedDataset` reads them
as a map-style dataset, and `ShardedSampler` gives the shard-aware order that reads each
shard in one stretch, the same on any number of workers and ranks, so that a loader's
`state_dict()` resumes exactly on another world size.

    from stoker.shards import ShardedDataset, ShardedSampler, write_shards

    write_shards(my_dataset, "s3://bucket/train")
    data = ShardedDataset("s3://bucket/train", cache_bytes=20 << 30)
    loader = DataLoader(data, batch_size=64, num_workers=8, sampler=ShardedSampler(data))

Lightning, accelerate and the Hugging Face Trainer keep `ShardedSampler` as each rank's share
instead of sharding its loader again (the guide's page on them says how).

Remote stores need the `stream` extra (`pip install stoker[stream]`: obstore and fsspec);
Parquet shards need `parquet` (pyarrow).
"""

from ._shards.dataset import ShardedDataset
from ._shards.errors import (
    AccessDeniedError,
    CacheFullError,
    CorruptShardError,
    MissingObjectError,
    StoreError,
)
from ._shards.formats import decode_auto
from ._shards.index import build_index
from ._shards.sampler import ShardedSampler
from ._shards.writer import write_shards

__all__ = [
    "AccessDeniedError",
    "CacheFullError",
    "CorruptShardError",
    "MissingObjectError",
    "ShardedDataset",
    "ShardedSampler",
    "StoreError",
    "build_index",
    "decode_auto",
    "write_shards",
]
