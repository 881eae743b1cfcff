"""What a user who ran `pip install 'stoker[torch,stream,parquet]'` gets, in a venv holding
that and the test runner alone (no s3fs, boto3 or moto: `make user-tier` builds it once per
run and installs this checkout into it as a wheel), against the moto server on loopback (run
by the test environment's interpreter, STOKER_S3_SERVER_PYTHON): the shards and mixing
guides' examples as written, a second `write_shards` in one process, a multi-worker epoch on
each start method with stoker's and torch's DataLoader and thread workers, and a deleted and
a corrupt shard read through forked workers, each the documented error naming its URL."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.utils.data as tud
from tests.support.docblocks import ROOT, Block, page_blocks, run_block
from tests.support.s3server import S3Server, client_env

import stoker.torch as st
from stoker.shards import (
    CorruptShardError,
    MissingObjectError,
    ShardedDataset,
    ShardedSampler,
    write_shards,
)

N = 240
SHARD_BYTES = 6_000
_buckets = itertools.count()
GUIDES = [ROOT / "docs" / "guide" / "shards.md", ROOT / "docs" / "guide" / "mixing-and-packing.md"]
GUIDE_BLOCKS = [b for page in GUIDES for b in page_blocks(page)]


def test_this_is_the_users_install() -> None:
    present = {
        m
        for m in ("s3fs", "boto3", "botocore", "aiobotocore", "moto", "webdataset", "datasets")
        if importlib.util.find_spec(m) is not None
    }
    assert not present, f"the user tier's venv holds {sorted(present)}: it should hold stoker's extras alone"
    for needed in ("obstore", "fsspec", "pyarrow", "torch"):
        assert importlib.util.find_spec(needed) is not None, needed
    assert "site-packages" in st.__file__, f"stoker should come from the installed wheel, not {st.__file__}"
    assert os.environ.get("STOKER_S3_SERVER_PYTHON"), "the moto server needs the test environment's interpreter"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in client_env(s3_server.endpoint).items():
        monkeypatch.setenv(name, value)
    bucket = f"user-{next(_buckets)}"
    s3_server.make_bucket(bucket)
    return f"s3://{bucket}"


def samples() -> list[dict[str, Any]]:
    return [{"__key__": f"{i:06d}", "cls": i, "npy": np.full(200, i, np.int32)} for i in range(N)]


def read_all(loader: Any) -> list[int]:
    return sorted(int(c) for batch in loader for c in batch["cls"])


def test_a_second_write_shards_in_one_process(s3_url: str) -> None:
    """The first write's index upload starts obstore's runtime here; the second write's
    processes are forked after it."""
    write_shards(samples(), f"{s3_url}/one", shard_bytes=SHARD_BYTES)
    write_shards(samples(), f"{s3_url}/two", shard_bytes=SHARD_BYTES)
    write_shards(samples(), f"{s3_url}/three", shard_bytes=SHARD_BYTES, format="parquet")
    for name in ("one", "two", "three"):
        data = ShardedDataset(f"{s3_url}/{name}", cache_dir=f"{s3_url.replace('s3://', '/tmp/')}-{name}")
        assert len(data) == N and len(data.index.shards) > 4
        assert sorted(int(data[i]["cls"]) for i in range(N)) == list(range(N))


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_a_multi_worker_epoch(s3_url: str, tmp_path: Path, context: str) -> None:
    """Two workers read an epoch through a cache that holds a third of the shards, so workers
    download too, after this process has read the index and downloaded ahead."""
    write_shards(samples(), f"{s3_url}/train", shard_bytes=SHARD_BYTES)
    probe = ShardedDataset(f"{s3_url}/train", cache_dir=str(tmp_path / "probe"))
    biggest = max(s.size for s in probe.index.shards)
    cap = max(biggest * 3, sum(s.size for s in probe.index.shards) // 3)
    options = None
    if context == "forkserver":
        # the forkserver was started with this process's environment of then (before this
        # test pointed it at the server), and its workers inherit that: name the server
        env = client_env(os.environ["AWS_ENDPOINT_URL"])
        options = {
            "endpoint_url": env["AWS_ENDPOINT_URL"],
            "key": env["AWS_ACCESS_KEY_ID"],
            "secret": env["AWS_SECRET_ACCESS_KEY"],
            "region": env["AWS_REGION"],
        }
    data = ShardedDataset(
        f"{s3_url}/train", cache_dir=str(tmp_path / "cache"), cache_bytes=cap, storage_options=options
    )
    sampler = ShardedSampler(data, seed=1, window_shards=2)
    loader = st.DataLoader(data, batch_size=16, sampler=sampler, num_workers=2, multiprocessing_context=context)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert read_all(loader) == list(range(N))


def test_torchs_dataloader_with_forked_workers(s3_url: str, tmp_path: Path) -> None:
    write_shards(samples(), f"{s3_url}/train", shard_bytes=SHARD_BYTES)
    data = ShardedDataset(f"{s3_url}/train", cache_dir=str(tmp_path / "cache"))
    assert int(data[0]["cls"]) == 0  # this process has used obstore before the workers fork
    loader = tud.DataLoader(data, batch_size=16, num_workers=2, multiprocessing_context="fork")
    assert read_all(loader) == list(range(N))


def test_thread_workers(s3_url: str, tmp_path: Path) -> None:
    write_shards(samples(), f"{s3_url}/train", shard_bytes=SHARD_BYTES)
    data = ShardedDataset(f"{s3_url}/train", cache_dir=str(tmp_path / "cache"))
    loader = st.DataLoader(data, batch_size=16, sampler=ShardedSampler(data), num_workers=2, thread_pool=True)
    assert read_all(loader) == list(range(N))


def _object(server: S3Server, url: str, name: str) -> tuple[str, str]:
    parsed = urllib.parse.urlsplit(f"{url}/{name}")
    return parsed.netloc, urllib.parse.quote(parsed.path.lstrip("/"))


@pytest.mark.parametrize("kind", ["deleted", "corrupt"])
def test_an_unreadable_shard_is_the_documented_error(
    s3_server: S3Server, s3_url: str, tmp_path: Path, kind: str
) -> None:
    url = f"{s3_url}/train"
    index = write_shards(samples(), url, shard_bytes=SHARD_BYTES)
    shard = index.shards[len(index.shards) // 2]
    bucket, key = _object(s3_server, url, shard.name)
    if kind == "deleted":
        status, body = s3_server.request("DELETE", f"/{bucket}/{key}")
        assert status == 204, body
    else:
        status, blob = s3_server.request("GET", f"/{bucket}/{key}")
        assert status == 200
        at = len(blob) // 2
        s3_server.put_object(bucket, urllib.parse.unquote(key), blob[:at] + bytes([blob[at] ^ 0xFF]) + blob[at + 1 :])
    data = ShardedDataset(url, cache_dir=str(tmp_path / "cache"), store_retries=1)
    loader = st.DataLoader(
        data,
        batch_size=16,
        sampler=ShardedSampler(data, shuffle=False),
        num_workers=2,
        multiprocessing_context="fork",
        timeout=60,
    )
    expected = MissingObjectError if kind == "deleted" else CorruptShardError
    batches = iter(loader)
    try:
        with pytest.raises(expected) as caught:
            for _ in batches:
                pass
    finally:
        batches.close()
    text = str(caught.value) + "".join(str(c) for c in (caught.value.__cause__, caught.value.__context__) if c)
    assert shard.name in text, text
    if kind == "deleted":
        assert f"{url}/{shard.name}" in text, text


@pytest.mark.timeout(400)
@pytest.mark.parametrize("block", GUIDE_BLOCKS, ids=[b.where for b in GUIDE_BLOCKS])
def test_the_guides_examples_run_as_written(block: Block, tmp_path: Path) -> None:
    if block.skip is not None:  # a block the page marks as not run (it names why)
        pytest.skip(block.skip)
    outcome = run_block(block, tmp_path / "example", python=sys.executable)
    assert outcome.returncode == 0, f"{block.where} failed after {outcome.seconds:.1f} s:\n{outcome.output[-4000:]}"
    assert not outcome.leftovers, f"{block.where} left processes behind: {outcome.leftovers}"
