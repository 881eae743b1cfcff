"""Child-process side of the fault tests: `python scenario.py '<json>'`.

Runs one DataLoader with a fault planted somewhere, prints one JSON line describing what
the loop saw (batches, error type and message, how long after the fault the error came)
and what was left behind once the loader was dropped. The parent test runs this with a
hard timeout, so a hang shows up as a timeout rather than a stuck test session.

Nothing here depends on how long something takes: the places the scenario needs a worker to
be are marked with files (the fault's stamp, written as it happens; one file per worker, at
its first sample) and waited for, each wait bounded generously (READY_S).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the repo root: tests.support

from tests.support.leakcheck import Snapshot

import stoker

FAULT_AT = 5  # the sample index (map-style) or item number (iterable) that faults
READY_S = 60.0  # a bound on a hang: how long a wait for a worker to get somewhere may take
# ends a hang in a thread worker (which cannot be killed) once its timeout has been reported; in
# a worker process (a copy of this module) it is never set: the process is killed at shutdown
RELEASE = threading.Event()


def wait_for(what: str, ready: Any) -> None:
    """Until `ready()`, polled, at most READY_S."""
    deadline = time.monotonic() + READY_S
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {READY_S} s")
        time.sleep(0.01)


def mark_started(stamp: str) -> None:
    """Note that this worker has fetched its first sample (it is running)."""
    info = stoker.get_worker_info()
    path = f"{stamp}.worker{info.id if info else 0}"
    if not os.path.exists(path):
        open(path, "w").close()


def dead(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie not yet reaped counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def wait_for_the_fault(stamp: str) -> None:
    """Until the planted fault has happened and, in a worker process that dies of it, that
    process is dead."""
    wait_for("the planted fault", lambda: os.path.exists(stamp))
    with open(stamp) as f:
        pid = json.load(f)["pid"]
    if pid != os.getpid():  # not a thread of ours
        wait_for(f"the faulty worker's death (pid {pid})", lambda: dead(pid))


def fault(kind: str, stamp: str) -> None:
    """Do the planted fault; record when, for the reporting-latency check."""
    if not os.path.exists(stamp):  # the first fault is the one being reported
        with open(stamp + ".tmp", "w") as f:
            f.write(json.dumps({"time": time.time(), "pid": os.getpid()}))
        os.replace(stamp + ".tmp", stamp)
    print(f"FAULT {kind} pid={os.getpid()}", file=sys.stderr, flush=True)
    if kind == "raise":
        raise ValueError(f"planted fault at {FAULT_AT}")
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigsegv":
        ctypes.string_at(0)  # a real segmentation fault, not a signal sent by hand
    if kind == "sigsegv_signal":
        os.kill(os.getpid(), signal.SIGSEGV)  # the same signal, sent by hand
    if kind == "exit":
        os._exit(7)
    if kind == "hang":
        RELEASE.wait(float(os.environ.get("SCENARIO_HANG_S", "1000")))
        return
    if kind == "garbage":
        return
    raise AssertionError(f"unknown fault {kind}")


class Faulty(stoker.Dataset):
    """`slow_at`: that sample is made only once the fault at FAULT_AT (another worker's) has
    happened, so the fault comes before it is delivered."""

    def __init__(self, kind: str, place: str, stamp: str, n: int = 12, slow_at: int | None = None) -> None:
        self.kind, self.place, self.stamp, self.n, self.slow_at = kind, place, stamp, n, slow_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        mark_started(self.stamp)
        if i == self.slow_at:
            wait_for_the_fault(self.stamp)
        if self.place == "getitem" and i == FAULT_AT:
            fault(self.kind, self.stamp)
        return np.full(4, i, np.int64)


class FaultyStream(stoker.IterableDataset):
    """Worker 0's replica faults in __iter__ (place 'iter') or at item FAULT_AT ('next')."""

    def __init__(self, kind: str, place: str, stamp: str, n: int = 12) -> None:
        self.kind, self.place, self.stamp, self.n = kind, place, stamp, n

    def __iter__(self) -> Any:
        mark_started(self.stamp)
        info = stoker.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if self.place == "iter" and worker == 0:
            fault(self.kind, self.stamp)
        return self._items(worker, workers)

    def _items(self, worker: int, workers: int) -> Any:
        for i in range(worker, self.n, workers):
            if self.place == "next" and i == FAULT_AT:
                fault(self.kind, self.stamp)
            yield np.full(4, i, np.int64)


class FaultyCollate:
    def __init__(self, kind: str, stamp: str) -> None:
        self.kind, self.stamp = kind, stamp

    def __call__(self, batch: list[Any]) -> Any:
        if any(int(b[0]) == FAULT_AT for b in batch):
            fault(self.kind, self.stamp)
        return stoker.default_collate(batch)


class FaultyInit:
    def __init__(self, kind: str, stamp: str) -> None:
        self.kind, self.stamp = kind, stamp

    def __call__(self, worker_id: int) -> None:
        if worker_id == 1:
            fault(self.kind, self.stamp)


def _prestart(method: str | None) -> None:
    """Start multiprocessing's own helper processes before the snapshot: they are not ours."""
    if method == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
    if method in ("spawn", "forkserver"):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()


def wait_for_the_hang(place: str, stamp: str) -> None:
    """Until the planted hang has begun and the other worker is running (it has fetched a
    sample), so that asking for batches from now on waits only for batches being made, and
    for the hung one."""
    hung = 0 if place == "iter" else 1  # worker 0's stream hangs in __iter__; worker 1 in the others
    wait_for("the planted hang", lambda: os.path.exists(stamp))
    wait_for(f"worker {1 - hung}'s start", lambda: os.path.exists(f"{stamp}.worker{1 - hung}"))


def run(spec: dict[str, Any]) -> dict[str, Any]:
    kind, place, engine = spec["kind"], spec["place"], spec["engine"]
    stamp = spec["stamp"]
    method = None if engine == "threads" else engine
    _prestart(method)
    before = Snapshot()
    kwargs: dict[str, Any] = {"batch_size": 1, "num_workers": 2, "timeout": spec.get("timeout", 0)}
    if kind == "hang":
        # each worker is given four samples at once, so worker 1 reaches sample 5 (its third)
        # before anything is asked of the loader
        kwargs["prefetch_factor"] = 4
    if engine == "threads":
        kwargs["thread_pool"] = True
    else:
        kwargs["multiprocessing_context"] = method
    if place in ("iter", "next"):
        dataset: Any = FaultyStream(kind, place, stamp)
    else:
        dataset = Faulty(kind, place, stamp, slow_at=spec.get("slow_at"))
    if place == "collate":
        kwargs["collate_fn"] = FaultyCollate(kind, stamp)
    if place == "init":
        kwargs["worker_init_fn"] = FaultyInit(kind, stamp)
    out: dict[str, Any] = {"batches": [], "error": None, "slow_at": spec.get("slow_at")}
    loader = stoker.DataLoader(dataset, **kwargs)
    iterator = iter(loader)
    if kind == "hang":
        wait_for_the_hang(place, stamp)
    try:
        for batch in iterator:
            out["batches"].append(int(batch[0][0]))
    except Exception as exc:
        out["error_at"] = time.time()
        out["error"] = type(exc).__name__
        out["message"] = str(exc)
        out["is_runtime_error"] = isinstance(exc, RuntimeError)
        out["is_worker_died"] = isinstance(exc, stoker.WorkerDiedError)
        out["has_remote_traceback"] = exc.__cause__ is not None and "Traceback" in str(exc.__cause__)
        try:
            next(iterator)
            out["after_error"] = "yielded"
        except StopIteration:
            out["after_error"] = "StopIteration"
        except Exception as again:
            out["after_error"] = type(again).__name__
    RELEASE.set()  # a hung thread worker may end now
    if os.path.exists(stamp):
        with open(stamp) as f:
            stamped = json.load(f)
        out["fault_at"], out["fault_pid"] = stamped["time"], stamped["pid"]
    del iterator, loader
    gc.collect()
    out["leaks"] = before.wait_clean(timeout=float(spec.get("settle", 8)))
    return out


if __name__ == "__main__":
    result = run(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
