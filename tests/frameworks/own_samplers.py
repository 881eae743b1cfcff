"""stoker's own samplers of one rank's share (`ShardedSampler`, `StreamSampler`) for the
framework tests: the data they run on, built alike in the test process and in every rank, and
what each rank reads from the plain loader, without any framework (the reference).

- "sharded": `SHARDED_N` samples written as tar shards to a local folder (`write`), read by a
  `ShardedDataset`; a sample's identity is its number (the "cls" field).
- "stream": `PackedDataset` rows (torch tensors) of token documents, `ROWS` an epoch; a row's
  identity is the CRC-32 of its tokens (the rows of an epoch are distinct).

Both counts are odd, so on 2 ranks the sampler pads the tail: each rank's share is
`share(kind)` samples, `BATCH` to a batch, the last batch short.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np

SHARDED_N = 61
ROWS = 45
BATCH = 4
WORLD = 2
KINDS = ("sharded", "stream")
SHARD_BYTES = 6000  # a few samples a shard: about a dozen shards


def share(kind: str) -> int:
    """Samples a rank reads an epoch."""
    return -(-(SHARDED_N if kind == "sharded" else ROWS) // WORLD)


def write(folder: str) -> None:
    """The shards "sharded" reads, written once by the test process."""
    from stoker.shards import write_shards

    write_shards(
        [{"__key__": f"{i:05d}", "cls": i} for i in range(SHARDED_N)], folder, shard_bytes=SHARD_BYTES, workers=1
    )


def dataset(kind: str, folder: str) -> Any:
    if kind == "sharded":
        from stoker.shards import ShardedDataset

        return ShardedDataset(folder, cache_dir=os.path.join(folder, "cache"))
    from stoker.mix import PackedDataset, TokenDataset

    lengths = np.random.default_rng(0).integers(3, 40, size=80)
    documents = [np.arange(1, n + 1) + 1000 * d for d, n in enumerate(lengths)]
    return PackedDataset(
        TokenDataset.from_documents(documents), seq_len=32, window_size=16, rows_per_epoch=ROWS, tensors=True
    )


def sampler(kind: str, data: Any, **kwargs: Any) -> Any:
    """The kind's sampler; num_replicas and rank from torch.distributed unless given."""
    if kind == "sharded":
        from stoker.shards import ShardedSampler

        return ShardedSampler(data, window_shards=2, seed=3, **kwargs)
    from stoker.mix import StreamSampler

    return StreamSampler(data, **kwargs)


def collate(kind: str) -> Any:
    if kind == "sharded":
        return None  # the loader's default_collate
    from stoker.mix import collate_packed

    return collate_packed


def loader(kind: str, folder: str, num_workers: int = 0, **kwargs: Any) -> Any:
    """A `stoker.torch.DataLoader` over the kind's dataset with its sampler, `BATCH` a batch."""
    import stoker.torch

    data = dataset(kind, folder)
    extra = {} if collate(kind) is None else {"collate_fn": collate(kind)}
    return stoker.torch.DataLoader(
        data, batch_size=BATCH, sampler=sampler(kind, data, **kwargs), num_workers=num_workers, **extra
    )


def identities(kind: str, batch: Any) -> list[int]:
    """The identities of a batch's samples, in order."""
    if kind == "sharded":
        return [int(i) for i in batch["cls"]]
    return [zlib.crc32(np.ascontiguousarray(row.cpu().numpy()).tobytes()) for row in batch["input_ids"]]


def plain(kind: str, folder: str, rank: int, epochs: int = 2) -> list[list[int]]:
    """What rank `rank` of `WORLD` reads from the plain loader, without a framework: each
    epoch's identities in order, the sampler's `set_epoch` called before each epoch."""
    plain_loader = loader(kind, folder, num_replicas=WORLD, rank=rank)
    out = []
    for epoch in range(epochs):
        plain_loader.sampler.set_epoch(epoch)
        out.append([i for batch in plain_loader for i in identities(kind, batch)])
    return out
