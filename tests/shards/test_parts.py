"""A remote shard larger than two parts arrives as parallel ranges, written in order, and is
the same shard: through resets and server errors too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from stoker import DataLoader
from stoker.shards import ShardedDataset, ShardedSampler, write_shards

N = 48


def samples() -> list[dict[str, Any]]:
    return [{"__key__": f"{i:05d}", "cls": i, "bin": os.urandom(40_000)} for i in range(N)]


@pytest.mark.parametrize("faults", [{}, {"reset_fraction": 0.3, "fail_fraction": 0.2}])
def test_a_shard_in_parallel_parts_reads_back_whole(
    s3_url: str, fault_proxy: Any, tmp_path: Path, faults: dict[str, float]
) -> None:
    written = samples()
    index = write_shards(written, s3_url, shard_bytes=1 << 30, workers=1)  # one shard, ~2 MB
    (shard,) = index.shards
    proxy = fault_proxy(seed=1, **faults)  # a seed whose draws fault some of the parts
    data = ShardedDataset(
        s3_url,
        cache_dir=str(tmp_path / "cache"),
        part_bytes=256 << 10,
        decode=None,
        storage_options={"endpoint_url": proxy.endpoint},
        store_timeout_s=5.0,
    )
    loader = DataLoader(data, batch_size=8, sampler=ShardedSampler(data, num_replicas=1, rank=0), num_workers=0)
    got = {
        bytes(k).decode() if isinstance(k, bytes) else k: b
        for batch in loader
        for k, b in zip(batch["__key__"], batch["bin"])
    }
    assert got == {s["__key__"]: s["bin"] for s in written}
    parts = -(-shard.size // (256 << 10))
    gets = [entry for entry in proxy.log if entry[0] == "GET" and shard.name in entry[1]]
    if not faults:
        assert len(gets) == parts  # one request a part, no whole-object read
    else:
        assert proxy.faults["reset"] + proxy.faults["fail"] > 0
    data.close()


def test_part_bytes_is_checked(s3_url: str) -> None:
    write_shards(samples()[:4], s3_url, workers=1)
    with pytest.raises(ValueError, match="part_bytes"):
        ShardedDataset(s3_url, part_bytes=0)


CHILD = """
import os, sys, time
from stoker import DataLoader
from stoker.shards import ShardedDataset, ShardedSampler
data = ShardedDataset(sys.argv[1], cache_dir=sys.argv[2], storage_options={"endpoint_url": sys.argv[3]},
                      prefetch_shards=8)
loader = DataLoader(data, batch_size=4, sampler=ShardedSampler(data, num_replicas=1, rank=0, shuffle=False))
next(iter(loader))
print("first", flush=True)
"""


def test_downloads_ahead_do_not_hold_up_the_exit(s3_url: str, fault_proxy: Any, tmp_path: Path) -> None:
    import subprocess
    import sys

    many = [dict(s, __key__=f"{k}-{s['__key__']}") for k in range(4) for s in samples()]
    write_shards(many, s3_url, shard_bytes=400_000, workers=1)  # ~20 shards of 400 KB
    proxy = fault_proxy(bandwidth=100_000)  # 4 s a shard: the downloads ahead take 8 s or more
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, s3_url, str(tmp_path / "cache"), proxy.endpoint],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "first"
        child.wait(timeout=60)
        # the main thread ended after the first batch: the downloads under way and queued
        # are abandoned, not waited for. Waiting would have sent the 8 shards drawn ahead
        # whole (over 3 MB); abandoned, the proxy sent the first shard and parts of the
        # ones under way on the other download threads.
        assert proxy.bytes_sent < 6 * 400_000, proxy.bytes_sent
    finally:
        child.kill()
