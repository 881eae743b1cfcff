"""ShardedDataset end to end: stoker's DataLoader (and stoker.torch's) over shards on a real
moto S3 server on loopback, with a FaultProxy in front of it where a test needs requests
counted or broken.

Every sample of an epoch once, start-up in one request, each shard downloaded once per epoch;
5xx, resets and hung requests retried; a store that always fails, a missing, denied, corrupt
or truncated shard raised at the batch that needs it, naming the object and the sample; cache
folder and cap errors at construction; a SIGKILLed worker replaced; a resume on another
worker count.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("moto")

from tests.support.s3server import FaultProxy, S3Server

from stoker import DataLoader, WorkerRestartWarning
from stoker.shards import (
    CacheFullError,
    CorruptShardError,
    ShardedDataset,
    ShardedSampler,
    write_shards,
)

N = 60
BATCH = 4
SHARD_BYTES = 6000  # three samples a shard: 20 shards
CHILD = Path(__file__).with_name("dataset_child.py")
CHILD_TIMEOUT_S = 90


def payload(i: int) -> bytes:
    return bytes((i * 7 + k) % 251 for k in range(500 + i % 5))


def sample(i: int) -> dict[str, Any]:
    return {"__key__": f"{i:05d}", "cls": i, "bin": payload(i)}


def write(url: str, n: int = N) -> Any:
    index = write_shards([sample(i) for i in range(n)], url, shard_bytes=SHARD_BYTES, workers=1)
    assert len(index.shards) >= 10, "the tests want many shards"
    return index


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def ids_of(loader: Any) -> list[int]:
    return [int(c) for batch in loader for c in batch["cls"]]


def object_path(url: str, name: str) -> tuple[str, str]:
    """(bucket, key) of the object `name` under the prefix `url`."""
    parsed = urllib.parse.urlsplit(url)
    return parsed.netloc, f"{parsed.path.strip('/')}/{name}"


def full_text(exc: BaseException) -> str:
    """An exception's message with its notes and its causes' messages."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 10:
        parts.append(f"{type(seen).__name__}: {seen}")
        parts.extend(getattr(seen, "__notes__", []))
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


def shard_gets(proxy: FaultProxy) -> collections.Counter[str]:
    """How many times each shard was downloaded (GETs: the fsspec client, which a worker forked
    from a process that used obstore falls back to, also asks HEAD first)."""
    return collections.Counter(
        path.rsplit("/", 1)[1] for method, path, _ in proxy.log if method == "GET" and path.endswith(".tar")
    )


# ---------------------------------------------------------------------------------------- 1
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers, method", [(0, None), (2, "fork"), (2, "spawn")])
def test_an_epoch_reads_every_sample_once_and_each_shard_once(
    s3_url: str, fault_proxy: Any, tmp_path: Path, workers: int, method: str | None
) -> None:
    index = write(s3_url)
    proxy = fault_proxy()
    data = ShardedDataset(
        s3_url,
        cache_dir=str(tmp_path / "cache"),
        cache_bytes=sum(s.size for s in index.shards),
        storage_options={"endpoint_url": proxy.endpoint},
    )
    # start-up reads the index alone, whatever the number of shards
    assert proxy.requests == 1, list(proxy.log)
    assert list(proxy.log)[0][1].endswith("/stoker-index.json")
    assert len(data) == N
    loader = DataLoader(
        data,
        batch_size=BATCH,
        sampler=ShardedSampler(data, seed=5, window_shards=3),
        num_workers=workers,
        multiprocessing_context=method,
        collate_fn=as_list,
        timeout=30 if workers else 0,
    )
    samples = [s for batch in loader for s in batch]
    assert sorted(s["cls"] for s in samples) == list(range(N))
    for s in samples:  # decode="auto": cls an int, other fields the bytes written
        i = s["cls"]
        assert type(i) is int
        assert s["__key__"] == f"{i:05d}" and s["bin"] == payload(i)
    assert [s["cls"] for s in samples] != list(range(N)), "the sampler should have shuffled"
    gets = shard_gets(proxy)
    assert gets == {s.name: 1 for s in index.shards}, gets
    # the cache holds the whole dataset: a second epoch asks the store for nothing
    before = proxy.requests
    assert sorted(s["cls"] for batch in loader for s in batch) == list(range(N))
    assert proxy.requests == before, list(proxy.log)[before:]


@pytest.mark.timeout(60)
def test_torch_loader_collates_tensors_from_the_shards(s3_url: str, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import stoker.torch as st

    write(s3_url)
    data = ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"))
    loader = st.DataLoader(data, batch_size=BATCH, sampler=ShardedSampler(data, shuffle=False), num_workers=2)
    batches = list(loader)
    assert all(isinstance(b["cls"], torch.Tensor) and b["cls"].dtype == torch.int64 for b in batches)
    assert torch.cat([b["cls"] for b in batches]).tolist() == list(range(N))


# ---------------------------------------------------------------------------------------- 2
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "faults, outcome",
    [
        ({"fail_fraction": 0.3, "fail_status": 503}, "fail"),
        ({"fail_fraction": 0.3, "fail_status": 500}, "fail"),
        ({"reset_fraction": 0.3}, "reset"),
    ],
    ids=["503-slowdown", "500", "reset"],
)
def test_transient_faults_are_retried_and_the_epoch_completes(
    s3_url: str, fault_proxy: Any, tmp_path: Path, faults: dict[str, Any], outcome: str
) -> None:
    write(s3_url)
    proxy = fault_proxy(seed=3, **faults)
    data = ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"), storage_options={"endpoint_url": proxy.endpoint})
    loader = DataLoader(
        data,
        batch_size=BATCH,
        sampler=ShardedSampler(data, seed=1),
        num_workers=2,
        multiprocessing_context="fork",
        timeout=30,
    )
    ids = ids_of(loader)
    assert sorted(ids) == list(range(N))
    assert proxy.faults[outcome] >= 3, proxy.faults  # the faults did happen


def run_child(s3_server: S3Server, url: str, tmp_path: Path, **spec: Any) -> dict[str, Any]:
    spec = {
        "upstream": s3_server.endpoint,
        "url": url,
        "cache_dir": str(tmp_path / "cache"),
        **spec,
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.timeout(CHILD_TIMEOUT_S + 20)
def test_hung_requests_time_out_and_are_retried(s3_url: str, s3_server: S3Server, tmp_path: Path) -> None:
    write(s3_url)
    result = run_child(
        s3_server,
        s3_url,
        tmp_path,
        proxy={"hang_fraction": 0.2, "seed": 2},
        store_timeout_s=1.0,
        workers=2,
    )
    assert result["error"] is None, result["message"]
    assert result["ids"] == list(range(N))
    assert result["faults"].get("hang", 0) >= 2, result["faults"]


@pytest.mark.timeout(CHILD_TIMEOUT_S + 20)
def test_a_store_that_always_fails_raises_naming_the_url_without_hanging(
    s3_url: str, s3_server: S3Server, tmp_path: Path
) -> None:
    write(s3_url)
    result = run_child(s3_server, s3_url, tmp_path, faults={"fail_fraction": 1.0}, store_retries=2, workers=2)
    assert result["error"] is not None and result["ids"] == [], result
    message = result["message"]
    assert f"{s3_url}/shard-" in message and ".tar" in message, message
    assert "StoreError" in message and "failed 3 times (retries=2)" in message, message
    assert any(why in message for why in ("SlowDown", "Service Unavailable", "503")), message
    assert "needed by sample 0" in message, message


# ---------------------------------------------------------------------------------------- 3, 4
FIRST_BAD = 30  # the first sample of the shard made unreadable (with three samples a shard)


def break_shard(kind: str, s3_server: S3Server, proxy: FaultProxy, url: str, index: Any) -> str:
    """Make the shard holding sample FIRST_BAD unreadable after the index was written."""
    number = int(index.locate(FIRST_BAD)[0])
    shard = index.shards[number]
    assert index.locate(FIRST_BAD)[1] == 0, "FIRST_BAD should open its shard"
    bucket, key = object_path(url, shard.name)
    if kind == "deleted":
        status, body = s3_server.request("DELETE", f"/{bucket}/{urllib.parse.quote(key)}")
        assert status == 204, body
    elif kind == "missing":
        proxy.missing(f"{bucket}/{key}")
    elif kind == "denied":
        proxy.deny(f"{bucket}/{key}")
    else:
        status, data = s3_server.request("GET", f"/{bucket}/{urllib.parse.quote(key)}")
        assert status == 200 and len(data) == shard.size
        if kind == "corrupt":  # same size, one byte of a sample's data changed
            at = shard.size // 2
            data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
        else:
            data = data[: shard.size // 2]
        s3_server.put_object(bucket, key, data)
    return f"{url}/{shard.name}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kind, workers, expected",
    [
        ("deleted", 0, FileNotFoundError),
        ("deleted", 2, FileNotFoundError),
        ("missing", 2, FileNotFoundError),
        ("denied", 0, PermissionError),
        ("denied", 2, PermissionError),
        ("corrupt", 2, CorruptShardError),
        ("truncated", 0, OSError),
        ("truncated", 2, OSError),
    ],
)
def test_an_unreadable_shard_raises_at_the_batch_that_needs_it(
    s3_url: str,
    s3_server: S3Server,
    fault_proxy: Any,
    tmp_path: Path,
    kind: str,
    workers: int,
    expected: type,
) -> None:
    index = write(s3_url)
    proxy = fault_proxy()
    shard_url = break_shard(kind, s3_server, proxy, s3_url, index)
    data = ShardedDataset(
        s3_url,
        cache_dir=str(tmp_path / "cache"),
        storage_options={"endpoint_url": proxy.endpoint},
        store_retries=1,
    )
    loader = DataLoader(
        data,
        batch_size=BATCH,
        sampler=ShardedSampler(data, shuffle=False),
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
        timeout=30 if workers else 0,
    )
    read: list[int] = []
    batches = iter(loader)
    try:
        with pytest.raises(expected) as caught:
            for batch in batches:
                read.extend(int(c) for c in batch["cls"])
    finally:  # the workers stop now, not when the failure's traceback is collected
        batches.close()
    # every batch before the one holding FIRST_BAD came out, in order
    assert read == list(range(FIRST_BAD // BATCH * BATCH))
    text = full_text(caught.value)
    assert shard_url in text, text
    assert f"sample {FIRST_BAD}" in text, text
    if kind == "corrupt":
        assert "sha256" in text or "checksum" in text, text
    if kind == "truncated":
        assert str(index.shards[int(index.locate(FIRST_BAD)[0])].size) in text, text


# ---------------------------------------------------------------------------------------- 5
@pytest.mark.parametrize("cache_bytes", [None, 1 << 20])
def test_a_cache_folder_that_cannot_be_made_is_an_error_at_construction(
    s3_url: str, tmp_path: Path, cache_bytes: int | None
) -> None:
    write(s3_url)
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a folder")
    with pytest.raises(OSError, match="shard cache folder") as caught:
        ShardedDataset(s3_url, cache_dir=str(blocker / "cache"), cache_bytes=cache_bytes)
    assert str(blocker) in str(caught.value)


def test_a_cap_below_the_largest_shard_is_refused_at_construction(s3_url: str, tmp_path: Path) -> None:
    index = write(s3_url)
    largest = max(s.size for s in index.shards)
    with pytest.raises(ValueError, match=f"cache_bytes={largest - 1} is smaller than the largest shard"):
        ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"), cache_bytes=largest - 1)
    assert len(ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"), cache_bytes=largest)) == N


# ---------------------------------------------------------------------------------------- 6
class KillOnce:
    """A transform that SIGKILLs its worker the first time it sees sample `at`."""

    def __init__(self, at: int, marker: str) -> None:
        self.at = at
        self.marker = marker

    def __call__(self, s: dict[str, Any]) -> dict[str, Any]:
        if s["cls"] == self.at:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return s
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        return s


@pytest.mark.timeout(60)
def test_a_killed_worker_is_replaced_and_the_epoch_is_exact(s3_url: str, tmp_path: Path) -> None:
    write(s3_url)
    marker = tmp_path / "killed"
    data = ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"), transform=KillOnce(37, str(marker)))
    sampler = ShardedSampler(data, seed=4, window_shards=2)
    loader = DataLoader(
        data,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=2,
        multiprocessing_context="fork",
        max_worker_restarts=2,
        timeout=30,
    )
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        ids = ids_of(loader)
    assert marker.exists(), "the transform should have killed a worker"
    restarts = [w for w in warned if issubclass(w.category, WorkerRestartWarning)]
    assert len(restarts) == 1, [str(w.message) for w in warned]
    assert ids == list(sampler)  # each sample once, in the sampler's order


# ---------------------------------------------------------------------------------------- 7
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_a_resume_on_another_worker_count_continues_exactly(s3_url: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import stoker.torch as st

    index = write(s3_url)
    cache = str(tmp_path / "cache")
    cap = 5 * max(s.size for s in index.shards)  # smaller than the dataset: shards are evicted

    def loader(workers: int) -> Any:
        data = ShardedDataset(s3_url, cache_dir=cache, cache_bytes=cap)
        sampler = ShardedSampler(data, seed=9, window_shards=2)
        return st.DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=workers, timeout=30)

    def as_ids(batches: Any) -> list[list[int]]:
        return [b["cls"].tolist() for b in batches]

    reference = as_ids(loader(2))
    assert sorted(i for b in reference for i in b) == list(range(N))
    first = loader(2)
    head = []
    for batch in first:
        head.append(batch["cls"].tolist())
        if len(head) == 6:
            break
    state = json.loads(json.dumps(first.state_dict()))
    del first
    assert head == reference[:6]
    resumed = loader(3)
    resumed.load_state_dict(state)
    assert as_ids(resumed) == reference[6:]


# ---------------------------------------------------------------------------------------- 8
# The cache holds about two windows: the loader's process leases (pins) the shards of the
# batches it drew until their samples are read, so the window being read is never evicted to
# make room for the next one.
WINDOW = 4  # shards a window
PER_SHARD = 40  # samples a shard: a window is 20 batches, more than the 4 in flight


def write_windows(url: str) -> Any:
    index = write_shards([sample(i) for i in range(12 * PER_SHARD)], url, shard_bytes=PER_SHARD * 2048 - 1, workers=1)
    assert len(index.shards) == 12 and {s.samples for s in index.shards} == {PER_SHARD}
    return index


def decoding(sample: dict[str, Any]) -> dict[str, Any]:
    """A reader's pace (a few ms a sample, as decoding an image takes): a window is read over
    longer than the readers take to touch the shards they read."""
    time.sleep(0.012)
    return sample


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method, windows", [("fork", 2.0), ("fork", 2.5), ("spawn", 2.5)])
def test_a_cache_of_two_windows_downloads_each_shard_once_per_epoch(
    s3_url: str, fault_proxy: Any, tmp_path: Path, method: str, windows: float
) -> None:
    index = write_windows(s3_url)
    proxy = fault_proxy()
    largest = max(s.size for s in index.shards)
    data = ShardedDataset(
        s3_url,
        cache_dir=str(tmp_path / "cache"),
        cache_bytes=int(windows * WINDOW * largest),
        storage_options={"endpoint_url": proxy.endpoint},
        transform=decoding,
    )
    sampler = ShardedSampler(data, seed=3, window_shards=WINDOW)
    loader = DataLoader(
        data,
        batch_size=8,
        sampler=sampler,
        num_workers=2,
        multiprocessing_context=method,
        collate_fn=as_list,
        timeout=30,
    )
    for epoch in range(2):
        sampler.set_epoch(epoch)
        before = shard_gets(proxy)
        ids = sorted(s["cls"] for batch in loader for s in batch)
        assert ids == list(range(len(data)))
        gets = shard_gets(proxy) - before
        # once each; a shard still cached from the epoch before is not fetched again
        assert max(gets.values()) == 1, (epoch, gets)
        if epoch == 0:
            assert set(gets) == {s.name for s in index.shards}, gets
    data.close()


@pytest.mark.timeout(120)
def test_a_cap_smaller_than_a_window_still_reads_every_sample_once(
    s3_url: str, fault_proxy: Any, tmp_path: Path
) -> None:
    index = write_windows(s3_url)
    proxy = fault_proxy()
    largest = max(s.size for s in index.shards)
    # a window of 4 shards, a cap of 3: the leases take 2 (one shard's room is kept for the
    # readers), the readers fetch the rest as they need them, evicting what nobody leases;
    # none waits for a lease to end
    data = ShardedDataset(
        s3_url,
        cache_dir=str(tmp_path / "cache"),
        cache_bytes=3 * largest,
        storage_options={"endpoint_url": proxy.endpoint},
    )
    sampler = ShardedSampler(data, seed=3, window_shards=WINDOW)
    loader = DataLoader(
        data,
        batch_size=8,
        sampler=sampler,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=as_list,
        timeout=60,
    )
    ids = [s["cls"] for batch in loader for s in batch]
    assert ids == list(sampler)
    assert set(shard_gets(proxy)) == {s.name for s in index.shards}
    data.close()


_LEASING_RANK = r"""
import json, os, sys, time
from stoker import DataLoader
from stoker.shards import ShardedDataset, ShardedSampler

spec = json.loads(sys.argv[1])

def stall(sample):
    if sample["cls"] == spec["stall_at"]:
        open(spec["ready"], "w").close()
        time.sleep(3600)
    return sample

data = ShardedDataset(spec["url"], cache_dir=spec["cache_dir"], cache_bytes=spec["cap"], transform=stall)
sampler = ShardedSampler(data, shuffle=False, window_shards=4)
for batch in DataLoader(data, batch_size=8, sampler=sampler, num_workers=2, multiprocessing_context="fork"):
    pass
"""


@pytest.mark.timeout(120)
def test_a_killed_ranks_leases_end_with_it(s3_url: str, tmp_path: Path) -> None:
    index = write_windows(s3_url)
    largest = max(s.size for s in index.shards)
    cap = 2 * WINDOW * largest
    cache_dir, ready = str(tmp_path / "cache"), tmp_path / "ready"
    spec = {"url": s3_url, "cache_dir": cache_dir, "cap": cap, "stall_at": 2 * PER_SHARD - 5, "ready": str(ready)}
    rank = subprocess.Popen(
        [sys.executable, "-c", _LEASING_RANK, json.dumps(spec)],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert rank.poll() is None, rank.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the rank did not reach its stalled sample"
            time.sleep(0.05)
        # a worker is stalled in the first window: the rank leases its shards (and the next
        # window's), so the cache cannot be emptied
        cache = ShardedDataset(s3_url, cache_dir=cache_dir, cache_bytes=cap, timeout_s=0.5).cache
        assert cache.directory in {os.path.join(cache_dir, d) for d in os.listdir(cache_dir)}
        with pytest.raises(CacheFullError, match="are pinned by readers"):
            cache.get("filler", cap, None, lambda out: out.write(bytes(cap)))
    finally:
        os.killpg(rank.pid, signal.SIGKILL)  # the rank and its workers
        rank.communicate(timeout=30)
    cache.get("filler", cap, None, lambda out: out.write(bytes(cap)))  # every shard could go
    assert os.listdir(os.path.join(cache.directory, "shards")) == ["filler"]
