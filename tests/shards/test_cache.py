"""ShardCache: the cap holds under concurrent processes, one download per shard, a killed
downloader leaves nothing that is read as valid, pins stop eviction, bad bytes and failing
fetches leave nothing, and errors name the folder. Real processes, real files; anything that
could hang runs in a child process with a hard timeout."""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

import pytest

from stoker._shards.cache import ShardCache, measure_usage
from stoker._shards.errors import CacheFullError, CorruptShardError

CHILD = str(Path(__file__).with_name("cache_child.py"))


def content(name: str, size: int) -> bytes:
    block = hashlib.sha256(name.encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def sha(name: str, size: int) -> str:
    return hashlib.sha256(content(name, size)).hexdigest()


class Fetch:
    """A fetch that writes shard `name` and counts its calls."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size, self.calls = name, size, 0

    def __call__(self, out: BinaryIO) -> int:
        self.calls += 1
        out.write(content(self.name, self.size))
        return self.size


def get(cache: ShardCache, name: str, size: int, fetch: Fetch | None = None) -> str:
    return cache.get(name, size, sha(name, size), fetch or Fetch(name, size))


def start(job: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, CHILD, json.dumps(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"child hung past {timeout_s} s; stderr:\n{err}")
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err}\n{out}"
    return json.loads(out.strip().splitlines()[-1])


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"child exited ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, f"child did not create {path}"
        time.sleep(0.01)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)


def fetch_counts(log: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            counts[line] = counts.get(line, 0) + 1
    return counts


def files(directory: Path, sub: str) -> list[str]:
    return sorted(os.listdir(directory / sub))


def test_get_downloads_once_then_hits(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), 10_000)
    fetch = Fetch("a.tar", 1000)
    path = cache.get("a.tar", 1000, sha("a.tar", 1000), fetch)
    assert Path(path).read_bytes() == content("a.tar", 1000)
    assert cache.get("a.tar", 1000, None, fetch) == path
    assert fetch.calls == 1 and cache.downloads == 1
    assert cache.usage() == 1000 == measure_usage(str(tmp_path / "c"))
    assert cache.peak == 1000
    assert files(tmp_path / "c", "tmp") == []


def test_names_with_slashes_and_dots_get_files_of_their_own(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), 10_000)
    names = ["a/b.tar", "a%2Fb.tar", "..", ".", "../x", "x" * 400, "x" * 401]
    paths = [get(cache, name, 100 + i) for i, name in enumerate(names)]
    assert len(set(paths)) == len(names)
    for i, (name, path) in enumerate(zip(names, paths)):
        assert os.path.dirname(path) == str(tmp_path / "c" / "shards")
        assert Path(path).read_bytes() == content(name, 100 + i)


def test_a_shard_whose_size_changed_is_fetched_again(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), 10_000)
    get(cache, "a", 100)
    path = get(cache, "a", 300)
    assert Path(path).read_bytes() == content("a", 300)
    assert cache.downloads == 2 and cache.usage() == 300


def test_lru_evicts_the_least_recently_used(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), 3000)
    for name in ("a", "b", "c"):
        get(cache, name, 1000)
    with cache.reading("a") as f:  # a is now more recent than b
        assert f.read() == content("a", 1000)
    get(cache, "d", 1000)
    assert files(tmp_path / "c", "shards") == ["a", "c", "d"]
    assert cache.evictions == 1
    assert cache.peak == 3000


def test_cap_never_exceeded_by_four_processes(tmp_path):
    directory = tmp_path / "c"
    cap = 150_000
    shards = {f"s{i:02d}.tar": 20_000 + 4_000 * i for i in range(12)}  # 504 kB: > 3 x cap
    ShardCache(str(directory), cap)
    samples: list[int] = []
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            # under the cache's lock: the usage at one instant (see measure_usage)
            samples.append(measure_usage(str(directory), locked=True))

    watcher = threading.Thread(target=monitor)
    watcher.start()
    try:
        children = [
            start(
                dict(
                    job="hammer",
                    dir=str(directory),
                    cap=cap,
                    shards=shards,
                    seconds=3.0,
                    threads=3,
                    seed=seed,
                    log=str(tmp_path / "log"),
                )
            )
            for seed in range(4)
        ]
        results = [finish(child) for child in children]
    finally:
        stop.set()
        watcher.join()
    assert all(r["errors"] == [] for r in results)
    assert sum(r["reads"] for r in results) > 50
    assert sum(r["evictions"] for r in results) > 5  # the cap was under pressure
    assert len(samples) > 100
    assert max(samples) <= cap, f"the folder held {max(samples)} bytes, cap {cap}"
    assert max(r["peak"] for r in results) <= cap
    assert files(directory, "tmp") == []


def test_each_shard_downloaded_once_when_four_processes_want_it(tmp_path):
    directory, log, go = tmp_path / "c", tmp_path / "log", tmp_path / "go"
    shards = {"x.tar": 30_000, "y.tar": 40_000, "z/w.tar": 50_000}
    children = [
        start(dict(job="once", dir=str(directory), cap=1_000_000, shards=shards, start=str(go), log=str(log)))
        for _ in range(4)
    ]
    time.sleep(0.3)  # let them all start and wait on the start file
    go.touch()
    results = [finish(child) for child in children]
    assert fetch_counts(log) == {name: 1 for name in shards}
    assert sum(r["downloads"] for r in results) == 3
    assert all("errors" not in r for r in results)


def test_threads_of_one_process_download_a_shard_once(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), 100_000)
    calls = []

    def fetch(out: BinaryIO) -> int:
        calls.append(1)
        time.sleep(0.2)
        out.write(content("t", 5000))
        return 5000

    paths: list[str] = []
    threads = [
        threading.Thread(target=lambda: paths.append(cache.get("t", 5000, sha("t", 5000), fetch))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(paths) == 8 and len(set(paths)) == 1
    assert len(calls) == 1


def test_killed_downloader_leaves_no_shard_and_the_next_get_downloads_afresh(tmp_path):
    directory, log, ready = tmp_path / "c", tmp_path / "log", tmp_path / "ready"
    child = start(
        dict(job="stall", dir=str(directory), cap=100_000, name="k.tar", size=60_000, log=str(log), ready=str(ready))
    )
    wait_for(ready, child)
    assert len(files(directory, "tmp")) == 1
    assert measure_usage(str(directory)) == 60_000  # pre-sized: counted from the start
    with pytest.raises(TimeoutError, match=r"another process has been downloading shard k\.tar"):
        get(ShardCache(str(directory), 100_000, timeout_s=0.3), "k.tar", 60_000)
    kill(child)
    assert files(directory, "shards") == []
    cache = ShardCache(str(directory), 100_000, timeout_s=10)
    with pytest.raises(FileNotFoundError):
        cache.pin("k.tar")
    fetch = Fetch("k.tar", 60_000)
    path = cache.get("k.tar", 60_000, sha("k.tar", 60_000), fetch)
    assert fetch.calls == 1
    assert Path(path).read_bytes() == content("k.tar", 60_000)
    assert files(directory, "tmp") == []  # the stale temporary file is gone
    assert measure_usage(str(directory)) == 60_000


def test_a_killed_downloaders_room_is_reclaimed(tmp_path):
    directory, ready = tmp_path / "c", tmp_path / "ready"
    child = start(
        dict(
            job="stall",
            dir=str(directory),
            cap=100_000,
            name="k.tar",
            size=80_000,
            log=str(tmp_path / "log"),
            ready=str(ready),
        )
    )
    wait_for(ready, child)
    cache = ShardCache(str(directory), 100_000, timeout_s=0.3)
    with pytest.raises(CacheFullError, match="80000 are downloads in progress"):
        get(cache, "other", 50_000)  # the live download's room is taken
    kill(child)
    get(cache, "other", 50_000)
    assert files(directory, "tmp") == []


def test_pinned_shards_are_never_evicted(tmp_path):
    directory, ready = tmp_path / "c", tmp_path / "ready"
    child = start(
        dict(
            job="pin", dir=str(directory), cap=30_000, shards={"p": 10_000}, log=str(tmp_path / "log"), ready=str(ready)
        )
    )
    try:
        wait_for(ready, child)
        cache = ShardCache(str(directory), 30_000, timeout_s=0.5)
        get(cache, "q", 10_000)
        get(cache, "r", 10_000)
        get(cache, "s", 10_000)  # needs room: q goes, not p (older but pinned by the child)
        assert files(directory, "shards") == ["p", "r", "s"]
        cache.pin("r")
        cache.pin("s")
        with pytest.raises(CacheFullError) as caught:  # after timeout_s, not forever
            get(cache, "t", 10_000)
        message = str(caught.value)
        assert str(directory) in message and "30000" in message and "10000 bytes" in message
        assert "30000 are in use, of which 30000 are pinned" in message
        assert "raise the cap" in message
        assert files(directory, "shards") == ["p", "r", "s"]
        cache.unpin("s")
        get(cache, "t", 10_000)  # s, unpinned, goes; p and r stay
        assert files(directory, "shards") == ["p", "r", "t"]
    finally:
        kill(child)
    get(cache, "u", 10_000)  # the child's pin died with it: p (least recent) goes
    assert files(directory, "shards") == ["r", "t", "u"]


def test_a_lease_pins_its_shard_and_leaves_the_spare_room_to_readers(tmp_path):
    directory = tmp_path / "c"
    cache = ShardCache(str(directory), 30_000, timeout_s=0.5)
    told: list[bool] = []

    def lease(name: str, fetch: Fetch, spare: int = 10_000) -> bool:
        return cache.lease(name, 10_000, sha(name, 10_000), fetch, spare_bytes=spare, decided=told.append)

    a, b, c = Fetch("a", 10_000), Fetch("b", 10_000), Fetch("c", 10_000)
    assert lease("a", a) and lease("b", b)  # 20_000 leased + 10_000 spare: the cap
    assert told == [True, True] and a.calls == b.calls == 1
    assert cache.pinned() == {"a": 1, "b": 1}
    # c would leave no room to spare: skipped at once, nothing fetched, nothing evicted
    # False, not CacheFullError: a lease never goes down the path that waits for room
    assert not lease("c", c)
    assert told[-1] is False and c.calls == 0 and files(directory, "shards") == ["a", "b"]
    # a reader's get finds the spare room; the next one evicts it, never a leased shard
    get(cache, "c", 10_000)
    get(cache, "d", 10_000)
    assert files(directory, "shards") == ["a", "b", "d"]
    # a present shard is leased without a download when the budget allows it
    d = Fetch("d", 10_000)
    assert not lease("d", d)
    assert lease("d", d, spare=0) and d.calls == 0
    assert cache.pinned() == {"a": 1, "b": 1, "d": 1}
    with pytest.raises(CacheFullError, match="30000 are pinned"):
        get(cache, "e", 10_000)
    assert lease("a", a) and cache.pinned()["a"] == 2  # leased again by this process: counted
    for name in ("a", "a", "b"):
        cache.unpin(name)
    get(cache, "e", 10_000)  # a or b goes, d stays
    assert "d" in files(directory, "shards")
    with pytest.raises(ValueError, match="spare_bytes should be an int >= 0"):
        cache.lease("f", 10, None, Fetch("f", 10), spare_bytes=-1)


def test_a_killed_leaseholders_leases_end_with_it(tmp_path):
    directory, ready = tmp_path / "c", tmp_path / "ready"
    shards = {"p": 10_000, "q": 10_000}
    child = start(
        dict(job="lease", dir=str(directory), cap=30_000, shards=shards, log=str(tmp_path / "log"), ready=str(ready))
    )
    try:
        wait_for(ready, child)
        cache = ShardCache(str(directory), 30_000, timeout_s=0.3)
        get(cache, "r", 10_000)
        with pytest.raises(CacheFullError, match="20000 are pinned"):
            get(cache, "s", 20_000)  # the leases hold p and q
        assert files(directory, "shards") == ["p", "q", "r"]  # evicting r alone would not do
    finally:
        kill(child)
    get(cache, "s", 30_000)  # the leases died with their holder: everything can go
    assert files(directory, "shards") == ["s"]


def test_pins_are_counted_and_reading_pins(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), 2000, timeout_s=0.2)
    get(cache, "a", 1000)
    get(cache, "b", 1000)
    cache.pin("a")
    cache.pin("a")
    cache.unpin("a")
    assert cache.pinned() == {"a": 1}
    with cache.reading("b") as f:
        with pytest.raises(CacheFullError):
            get(cache, "c", 1000)  # a pinned, b being read
        assert f.read() == content("b", 1000)
    cache.unpin("a")
    assert cache.pinned() == {}
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin("a")
    get(cache, "c", 1000)
    get(cache, "d", 1000)
    with pytest.raises(FileNotFoundError, match="get\\(\\) it again"):
        with cache.reading("a"):
            pass
    assert cache.pinned() == {}


def test_too_big_a_shard_fails_at_once(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), 1000)
    with pytest.raises(CacheFullError, match="bigger than the cache's cap"):
        get(cache, "big", 1001)


def test_checksum_mismatch_keeps_nothing(tmp_path):
    directory = tmp_path / "c"
    cache = ShardCache(str(directory), 10_000)
    wrong = "0" * 64
    with pytest.raises(CorruptShardError) as caught:
        cache.get("bad.tar", 1000, wrong, Fetch("bad.tar", 1000))
    assert isinstance(caught.value, OSError)
    message = str(caught.value)
    assert "bad.tar" in message and wrong in message and sha("bad.tar", 1000) in message
    assert measure_usage(str(directory)) == 0
    assert files(directory, "shards") == [] and files(directory, "tmp") == []
    with pytest.raises(CorruptShardError, match="expected 1000 bytes, got 999"):
        cache.get("short", 1000, None, Fetch("short", 999))
    with pytest.raises(CorruptShardError, match="expected 1000 bytes, got at least 1001"):
        cache.get("long", 1000, None, Fetch("long", 1001))
    assert measure_usage(str(directory)) == 0
    assert cache.downloads == 0


def test_fetch_that_raises_leaves_nothing_and_releases_its_locks(tmp_path):
    directory = tmp_path / "c"
    cache = ShardCache(str(directory), 10_000, timeout_s=2)
    failure = ConnectionResetError("store went away")

    def fetch(out: BinaryIO) -> int:
        out.write(b"x" * 500)
        raise failure

    with pytest.raises(ConnectionResetError) as caught:
        cache.get("f", 1000, None, fetch)
    assert caught.value is failure
    assert measure_usage(str(directory)) == 0 and files(directory, "tmp") == []
    # another process gets the shard at once: no lock was left behind
    result = finish(
        start(
            dict(job="get", dir=str(directory), cap=10_000, name="f", size=1000, log=str(tmp_path / "log"), timeout_s=2)
        )
    )
    assert "error" not in result and result["downloads"] == 1


def test_a_fetch_may_start_over(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), 10_000)

    def fetch(out: BinaryIO) -> int:
        out.write(b"garbage")
        out.seek(0)
        out.truncate()
        out.write(content("r", 1000))
        return out.tell()

    path = cache.get("r", 1000, sha("r", 1000), fetch)
    assert Path(path).read_bytes() == content("r", 1000)


def test_a_folder_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(OSError) as caught:
        ShardCache(str(tmp_path / "file" / "cache"), 1000)
    assert str(tmp_path / "file" / "cache") in str(caught.value)
    assert caught.value.errno == errno.ENOTDIR


def test_bad_arguments_name_the_argument(tmp_path):
    # a wrong type is a TypeError, a wrong value a ValueError, worded as torch words its own
    for kwargs, error, message in [
        (dict(cap_bytes=0), ValueError, "cap_bytes should be an int >= 1 (bytes), but got cap_bytes=0"),
        (dict(cap_bytes=True), TypeError, "cap_bytes should be an int >= 1 (bytes), but got cap_bytes=True"),
        (dict(cap_bytes=10, timeout_s=-1), ValueError, "timeout_s should be a finite number >= 0 (seconds)"),
        (dict(cap_bytes=10, timeout_s=float("nan")), ValueError, "but got timeout_s=nan"),
        (dict(cap_bytes=10, timeout_s="1"), TypeError, "but got timeout_s='1'"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            ShardCache(str(tmp_path / "c"), **kwargs)
    with pytest.raises(ValueError, match="directory should be a non-empty path, but got directory=''"):
        ShardCache("", 10)
    with pytest.raises(TypeError, match="directory should be a non-empty path, but got directory=3"):
        ShardCache(3, 10)  # type: ignore[arg-type]
    cache = ShardCache(str(tmp_path / "c"), 1000)
    with pytest.raises(ValueError, match="name should be a non-empty string without NUL, but got name=''"):
        cache.get("", 1, None, Fetch("", 1))
    with pytest.raises(ValueError, match=re.escape("size should be an int >= 0 (bytes), but got size=-1")):
        cache.get("a", -1, None, Fetch("a", 1))
    with pytest.raises(ValueError, match="sha256 should be 64 hex digits or None, but got sha256='abc'"):
        cache.get("a", 1, "abc", Fetch("a", 1))
    with pytest.raises(TypeError, match="fetch should be a callable taking a binary file, but got fetch=None"):
        cache.get("a", 1, None, None)  # type: ignore[arg-type]


def _pickled_child(blob: bytes, queue) -> None:
    cache = pickle.loads(blob)
    queue.put(
        (cache.directory, cache.cap_bytes, cache.pinned(), Path(cache.get("n", 10, None, Fetch("n", 10))).read_bytes())
    )


def test_pickles_and_a_forked_child_holds_none_of_its_parents_pins(tmp_path):
    directory = tmp_path / "c"
    cache = ShardCache(str(directory), 2000, timeout_s=0.5)
    get(cache, "a", 1000)
    cache.pin("a")
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.directory == cache.directory and copy.pinned() == {}

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_pickled_child, args=(pickle.dumps(cache), queue))
    child.start()
    assert queue.get(timeout=30) == (str(directory), 2000, {}, content("n", 10))
    child.join(timeout=30)

    # a forked child outlives the parent's pin: the parent's unpin still frees the shard
    go, done = ctx.Event(), ctx.Event()

    def linger() -> None:
        if cache.pinned() != {}:
            os._exit(3)
        done.set()
        go.wait(30)

    child = ctx.Process(target=linger)
    child.start()
    try:
        assert done.wait(30)
        cache.unpin("a")
        get(cache, "b", 1000)  # makes room: n goes first (least recent), then a
        get(cache, "c", 1000)
        assert "a" not in files(directory, "shards")
    finally:
        go.set()
        child.join(timeout=30)
    assert child.exitcode == 0


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _unshare_works(),
    reason="needs `unshare -m` and mount (root) for a private tmpfs",
)


def in_tmpfs(mount: Path, job: dict, options: str, then: str = "") -> tuple[dict, str]:
    """Run a child job with its cache in a fresh tmpfs at `mount`, in a mount namespace of its
    own (the mount goes when the child does); `then` runs in the namespace after it."""
    mount.mkdir()
    job = dict(job, dir=f"{mount}/cache", log=f"{mount.parent}/{mount.name}.log")
    script = (
        f"mount -t tmpfs -o {options} tmpfs {mount} && {sys.executable} {CHILD} '{json.dumps(job)}' && echo END {then}"
    )
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    first, _, rest = done.stdout.partition("END")
    return json.loads(first), rest


@needs_mounts
def test_a_full_disk_is_named_and_its_file_removed(tmp_path):
    # the cap (1 MB) is above what the disk holds (256 kB): space runs out on the disk itself
    job = dict(job="get", cap=1_000_000, name="big", size=400_000)
    for no_fallocate, fetches in ((False, 0), (True, 1)):  # found when reserving; while writing
        mount = tmp_path / f"m{int(no_fallocate)}"
        result, listing = in_tmpfs(
            mount, dict(job, no_fallocate=no_fallocate), "size=256k", f"; ls -A {mount}/cache/tmp {mount}/cache/shards"
        )
        assert result["error"] == "OSError" and result["errno"] == errno.ENOSPC, result
        assert f"{mount}/cache is full" in result["message"]
        assert result["downloads"] == 0 and result["fetches"] == fetches
        assert sorted(listing.split()) == [f"{mount}/cache/shards:", f"{mount}/cache/tmp:"]  # empty


@needs_mounts
def test_a_read_only_folder_is_named(tmp_path):
    mount = tmp_path / "m"
    result, _ = in_tmpfs(mount, dict(job="get", cap=1000, name="a", size=10), "size=64k,ro")
    assert result["error"] == "PermissionError", result
    assert f"{mount}/cache is not writable" in result["message"]


@needs_mounts
def test_cap_holds_on_a_disk_exactly_the_caps_size(tmp_path):
    # the kernel counts: on a tmpfs of exactly `cap` bytes, shards of whole pages, going over
    # the cap even once would fail a download with ENOSPC
    mount, cap = tmp_path / "m", 40 * 4096
    mount.mkdir()
    shards = {f"s{i:02d}": 4096 * (4 + i) for i in range(10)}
    jobs = [
        json.dumps(
            dict(
                job="hammer",
                dir=f"{mount}/cache",
                cap=cap,
                shards=shards,
                seconds=2.0,
                threads=2,
                seed=seed,
                log=f"{tmp_path}/log",
            )
        )
        for seed in range(4)
    ]
    # the folder's layout is made first: four constructors racing four hammers that already
    # filled the disk to the cap was seen to fail a constructor once under load
    init = json.dumps(dict(job="get", dir=f"{mount}/cache", cap=cap, name="init", size=0, log=f"{tmp_path}/init.log"))
    script = (
        f"mount -t tmpfs -o size={cap} tmpfs {mount} && {sys.executable} {CHILD} '{init}' > /dev/null && "
        + " & ".join(f"{sys.executable} {CHILD} '{job}'" for job in jobs)
        + " & wait"
    )
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == 4, done.stderr
    assert all(r.get("errors") == [] for r in results), (results, done.stderr[-3000:])
    assert sum(r["evictions"] for r in results) > 5
    assert max(r["peak"] for r in results) <= cap
