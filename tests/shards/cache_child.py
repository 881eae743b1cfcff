"""A process that uses a ShardCache, for tests/shards/test_cache.py: run as
`python cache_child.py '<json job>'`; prints one JSON line with what it saw, and exits 0 when
everything it read was right.

Jobs (the "job" key):
- hammer: threads get() and read random shards for a while (the cap test).
- once: wait for a start file, then get() shards with a slow fetch (one download each).
- stall: start downloading a shard, write part of it, create a ready file, sleep (killed).
- pin: get() and pin shards, create a ready file, sleep (killed).
- lease: lease() shards (downloading them), create a ready file, sleep (killed).
- get: one get() of one shard; an error is printed as {"error": type, "message": ...}.
Every fetch appends the shard's name as a line to the job's "log" file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

from stoker._shards.cache import ShardCache


def content(name: str, size: int) -> bytes:
    """The bytes of shard `name` (the tests compute the same)."""
    block = hashlib.sha256(name.encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def make_fetch(name: str, size: int, log: str, pause_s: float = 0.0, stall: str | None = None):
    def fetch(out: BinaryIO) -> int:
        with open(log, "a") as f:
            f.write(name + "\n")
        data = content(name, size)
        half = size // 2
        out.write(data[:half])
        if stall is not None:
            with open(stall, "w"):
                pass
            time.sleep(3600)
        time.sleep(pause_s)
        out.write(data[half:])
        return size

    return fetch


def wait_for(path: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.005)


def hammer(job: dict[str, Any], cache: ShardCache) -> dict[str, Any]:
    shards: dict[str, int] = job["shards"]
    names = sorted(shards)
    end = time.monotonic() + job["seconds"]
    errors: list[str] = []
    reads = [0]

    def loop(seed: int) -> None:
        try:
            run(seed)
        except BaseException:
            errors.append(traceback.format_exc())

    def run(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            name = rng.choice(names)
            size = shards[name]
            sha = hashlib.sha256(content(name, size)).hexdigest()
            for _ in range(20):  # evicted between get() and the read: get it again
                cache.get(name, size, sha, make_fetch(name, size, job["log"]))
                try:
                    with cache.reading(name) as f:
                        if f.read() != content(name, size):
                            errors.append(f"wrong bytes in {name}")
                        reads[0] += 1
                    break
                except FileNotFoundError:
                    continue

    threads = [threading.Thread(target=loop, args=(job["seed"] * 100 + i,)) for i in range(job["threads"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"errors": errors, "reads": reads[0]}


def main() -> int:
    job = json.loads(sys.argv[1])
    if job.get("no_fallocate"):  # a filesystem without fallocate: bytes land only as written

        def refuse(fd: int, offset: int, length: int) -> None:
            raise OSError(95, "Operation not supported")

        os.posix_fallocate = refuse
    try:
        cache = ShardCache(job["dir"], job["cap"], timeout_s=job.get("timeout_s", 30.0))
    except OSError as exc:
        print(json.dumps({"error": type(exc).__name__, "errno": exc.errno, "message": str(exc)}))
        return 0
    kind = job["job"]
    result: dict[str, Any] = {}
    if kind == "hammer":
        result = hammer(job, cache)
    elif kind == "once":
        wait_for(job["start"])
        for name, size in job["shards"].items():
            path = cache.get(name, size, None, make_fetch(name, size, job["log"], pause_s=0.2))
            with open(path, "rb") as f:
                if f.read() != content(name, size):
                    result.setdefault("errors", []).append(name)
    elif kind == "stall":
        name, size = job["name"], job["size"]
        cache.get(name, size, None, make_fetch(name, size, job["log"], stall=job["ready"]))
    elif kind == "pin":
        for name, size in job["shards"].items():
            cache.get(name, size, None, make_fetch(name, size, job["log"]))
            cache.pin(name)
        with open(job["ready"], "w"):
            pass
        time.sleep(3600)
    elif kind == "lease":
        for name, size in job["shards"].items():
            if not cache.lease(name, size, None, make_fetch(name, size, job["log"]), spare_bytes=0):
                raise RuntimeError(f"lease of {name} did not fit")
        with open(job["ready"], "w"):
            pass
        time.sleep(3600)
    elif kind == "get":
        name, size = job["name"], job["size"]
        try:
            cache.get(name, size, None, make_fetch(name, size, job["log"]))
        except OSError as exc:
            result = {"error": type(exc).__name__, "errno": exc.errno, "message": str(exc)}
    fetches = open(job["log"]).read().count("\n") if os.path.exists(job["log"]) else 0
    result.update(peak=cache.peak, downloads=cache.downloads, evictions=cache.evictions, fetches=fetches)
    print(json.dumps(result))
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
