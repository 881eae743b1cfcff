"""The look-ahead hook (`stoker_upcoming`): the loader tells a ShardedDataset the batches its
sampler draws, ahead of their dispatch, and the dataset's threads download their shards before
a worker asks; a dataset without the hook is read exactly as before."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker import DataLoader
from stoker.shards import ShardedDataset, ShardedSampler, write_shards

N = 400
PER_SHARD = 20  # about 20 shards


def samples() -> list[dict[str, Any]]:
    return [{"__key__": f"{i:05d}", "cls": i, "bin": bytes([i % 251]) * 1000} for i in range(N)]


@pytest.fixture
def shards(tmp_path: Path) -> str:
    url = str(tmp_path / "data")
    write_shards(samples(), url, shard_bytes=PER_SHARD * 2048 - 1, workers=1)
    return url


def wait_for(condition: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_shards_of_batches_drawn_ahead_are_downloaded_before_they_are_read(shards: str, tmp_path: Path) -> None:
    data = ShardedDataset(shards, cache_dir=str(tmp_path / "cache"), prefetch_shards=4)
    assert len(data.index.shards) >= 10
    sampler = ShardedSampler(data, num_replicas=1, rank=0, shuffle=False)
    loader = DataLoader(data, batch_size=10, sampler=sampler, num_workers=0)
    it = iter(loader)
    first = next(it)
    assert [int(x) for x in first["cls"]] == list(range(10))
    # the first batch read shard 0; the downloads ahead bring the next 4 shards, unread
    expected = {data.cache.path_of(data.index.shards[s].name) for s in range(5)}
    assert wait_for(lambda: all(os.path.exists(p) for p in expected)), sorted(os.listdir(data.cache.directory))
    assert not os.path.exists(data.cache.path_of(data.index.shards[8].name))
    rest = [int(x) for batch in it for x in batch["cls"]]
    assert rest == list(range(10, N))
    # the download threads exist only while there is work: none is left to be forked into a
    # process the user starts next (the epoch's downloads were all needed, so they are done)
    assert wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("stoker-shards")], 5.0)
    data.close()


def test_a_dataset_without_the_protocol_is_drawn_one_batch_at_a_time() -> None:
    drawn: list[int] = []

    class Counting:
        def __init__(self) -> None:
            self.inner = list(range(40))

        def __iter__(self) -> Any:
            for i in self.inner:
                drawn.append(i)
                yield i

        def __len__(self) -> int:
            return 40

    loader = DataLoader(np.arange(40), batch_size=4, sampler=Counting(), num_workers=0, prefetch_factor=None)
    it = iter(loader)
    next(it)
    # the serial loader draws the first batch (and no more than its prefetch window)
    assert len(drawn) <= 8
