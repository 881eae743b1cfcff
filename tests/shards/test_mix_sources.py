"""stoker.mix over ShardedDataset sources on a real moto S3 server (loopback): each source
walked in its shard-aware order, the loader's upcoming rows passed on to the sources' plans,
each shard downloaded once per epoch, and the rows those of the main process."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("moto")

from tests.support.s3server import FaultProxy

from stoker import DataLoader
from stoker.mix import MixedDataset, PackedDataset, StreamSampler, collate_packed
from stoker.shards import ShardedDataset, write_shards

SIZES = (90, 60)


def tokens(source: int, i: int) -> np.ndarray:
    n = 5 + (i * 37 + source * 11) % 60
    return (np.arange(n, dtype=np.int32) * (i + 1) + source * 1000) % 30_000 + 1


def write(url: str, source: int) -> Any:
    docs = [{"__key__": f"{i:05d}", "tokens.npy": tokens(source, i)} for i in range(SIZES[source])]
    return write_shards(docs, url, shard_bytes=2500, workers=1)


def shard_gets(proxy: FaultProxy) -> collections.Counter[str]:
    return collections.Counter(path for method, path, _ in proxy.log if method == "GET" and path.endswith(".tar"))


@pytest.mark.timeout(120)
def test_sharded_sources_mix_in_windows_and_download_each_shard_once(
    s3_url: str, fault_proxy: Any, tmp_path: Path
) -> None:
    indexes = [write(f"{s3_url}/s{k}", k) for k in range(2)]
    assert all(len(ix.shards) >= 6 for ix in indexes)
    proxy = fault_proxy()

    def sources() -> list[ShardedDataset]:
        return [
            ShardedDataset(
                f"{s3_url}/s{k}",
                cache_dir=str(tmp_path / f"cache{k}"),
                cache_bytes=sum(s.size for s in indexes[k].shards),
                storage_options={"endpoint_url": proxy.endpoint},
            )
            for k in range(2)
        ]

    srcs = sources()
    mix = MixedDataset(srcs, [0.6, 0.4], field="tokens.npy", window_shards=2, seed=3)
    assert hasattr(type(mix), "stoker_upcoming")  # the sources plan: so does the mix
    # each source's pass is shard-aware: at most window_shards shards begun and not finished
    s, j = mix.sources_block(0, 200)
    for k, src in enumerate(srcs):
        draws = j[s == k][: SIZES[k]]
        assert sorted(draws.tolist()) == list(range(SIZES[k]))
        shard = np.searchsorted(src.shard_starts, draws, side="right") - 1
        left = collections.Counter(dict(enumerate(np.diff(src.shard_starts).tolist())))
        open_shards: set[int] = set()
        for sh in shard.tolist():
            open_shards.add(sh)
            left[sh] -= 1
            if left[sh] == 0:
                open_shards.discard(sh)
            assert len(open_shards) <= 2, (k, open_shards)
    # the loader's rows are the main process's, and every shard is downloaded once
    rows = PackedDataset(mix, seq_len=64, window_size=16)
    assert hasattr(type(rows), "stoker_upcoming")
    loader = DataLoader(
        rows, batch_size=4, sampler=StreamSampler(rows), collate_fn=collate_packed, num_workers=2, timeout=30
    )
    got = [r.tobytes() for batch in loader for r in batch["input_ids"]]
    spawned = DataLoader(
        rows,
        batch_size=4,
        sampler=StreamSampler(rows),
        collate_fn=collate_packed,
        num_workers=1,
        multiprocessing_context="spawn",
        timeout=60,
    )
    assert [r.tobytes() for batch in spawned for r in batch["input_ids"]] == got  # the mix pickles
    fresh = PackedDataset(
        MixedDataset(sources(), [0.6, 0.4], field="tokens.npy", window_shards=2, seed=3), seq_len=64, window_size=16
    )
    assert got == [fresh[g]["input_ids"].tobytes() for g in range(len(fresh))]
    gets = shard_gets(proxy)
    assert len(gets) == sum(len(ix.shards) for ix in indexes) and set(gets.values()) == {1}, gets
    # each row's documents are the sources' own samples
    first = fresh.pieces(0)
    p, a, b = first[0]
    source, sample = fresh.dataset.source_at(p)
    assert np.array_equal(fresh[0]["input_ids"][: b - a], tokens(source, sample)[a:b])
