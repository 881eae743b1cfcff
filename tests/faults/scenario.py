"""Child-process side of the fault tests: `python scenario.py '<json>'`.

Runs one DataLoader with a fault planted somewhere, prints one JSON line describing what
the loop saw (batches, error type and message, how long after the fault the error came)
and what was left behind once the loader was dropped. The parent test runs this with a
hard timeout, so a hang shows up as a timeout rather than a stuck test session.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the repo root: tests.support

from tests.support.leakcheck import Snapshot

import stoker

FAULT_AT = 5  # the sample index (map-style) or item number (iterable) that faults
SLOW_S = 0.5


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
        time.sleep(float(os.environ.get("SCENARIO_HANG_S", "1000")))
        return
    if kind == "garbage":
        return
    raise AssertionError(f"unknown fault {kind}")


class Faulty(stoker.Dataset):
    """`slow_at`: that sample takes SLOW_S, so the fault at FAULT_AT (another worker's) may
    happen before it is delivered."""

    def __init__(self, kind: str, place: str, stamp: str, n: int = 12, slow_at: int | None = None) -> None:
        self.kind, self.place, self.stamp, self.n, self.slow_at = kind, place, stamp, n, slow_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.slow_at:
            time.sleep(SLOW_S)
        if self.place == "getitem" and i == FAULT_AT:
            fault(self.kind, self.stamp)
        return np.full(4, i, np.int64)


class FaultyStream(stoker.IterableDataset):
    """Worker 0's replica faults in __iter__ (place 'iter') or at item FAULT_AT ('next')."""

    def __init__(self, kind: str, place: str, stamp: str, n: int = 12) -> None:
        self.kind, self.place, self.stamp, self.n = kind, place, stamp, n

    def __iter__(self) -> Any:
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


def run(spec: dict[str, Any]) -> dict[str, Any]:
    kind, place, engine = spec["kind"], spec["place"], spec["engine"]
    stamp = spec["stamp"]
    method = None if engine == "threads" else engine
    _prestart(method)
    before = Snapshot()
    kwargs: dict[str, Any] = {"batch_size": 1, "num_workers": 2, "timeout": spec.get("timeout", 0)}
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
