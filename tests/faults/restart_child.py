"""Child-process side of the worker-restart tests: `python restart_child.py '<json>'`.

Runs one loader epoch (or several) without faults, then the same loader configuration with
workers dying at planted sample indices, and prints one JSON line: both runs' batches,
the error (if any), the restart warnings, and what was left behind.

Deaths are planted at (sample index, occurrence) pairs: the occurrence-th fetch of that
index dies (marker files count fetches across processes), so a replacement worker that
fetches the same sample again does not die. With `deaths: k`, the child picks k distinct
batches of the uninterrupted run with a seeded RNG and one sample in each; `always` makes
every fetch of the `at` indices die (the two-deaths-in-a-row cases).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import random
import signal
import sys
import warnings
from typing import Any

import numpy as np

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the repo root: tests.support

from tests.support.leakcheck import Snapshot

import stoker


def die(kind: str) -> None:
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigsegv":
        ctypes.string_at(0)
    if kind == "exit":
        os._exit(7)
    raise AssertionError(f"unknown death {kind}")


class Deadly(stoker.Dataset):
    """Sample i is [i, i, i, i] (`draw`: [i, r, r, r] with r from numpy's global RNG)."""

    def __init__(self, n: int, kind: str, at: list[list[int]], marks: str, always: bool, draw: bool) -> None:
        self.n, self.kind, self.marks, self.always, self.draw = n, kind, marks, always, draw
        self.at = {(i, k) for i, k in at}
        self.indices = {i for i, _ in at}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i in self.indices and (self.always or (i, self._count_fetch(i)) in self.at):
            die(self.kind)
        if self.draw:
            return np.array([i, *np.random.randint(0, 2**31, size=3)], np.int64)
        return np.full(4, i, np.int64)

    def _count_fetch(self, i: int) -> int:
        """How many fetches of sample i came before this one, in any process."""
        k = 0
        while True:
            try:
                os.close(os.open(os.path.join(self.marks, f"fetch-{i}-{k}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return k
            except FileExistsError:
                k += 1


class Stream(stoker.IterableDataset):
    def __init__(self, n: int, kind: str, at: list[int]) -> None:
        self.n, self.kind, self.at = n, kind, {i for i, _ in at}

    def __iter__(self) -> Any:
        info = stoker.get_worker_info()
        assert info is not None
        for i in range(info.id, self.n, info.num_workers):
            if i in self.at:
                die(self.kind)
            yield np.full(4, i, np.int64)


def epochs(loader: Any, count: int, out: dict[str, Any]) -> list[list[list[int]]]:
    seen: list[list[list[int]]] = []
    try:
        for _ in range(count):
            seen.append([])
            for batch in loader:
                seen[-1].append(np.asarray(batch).tolist())
    except Exception as exc:
        out["error"] = type(exc).__name__
        out["message"] = str(exc)
        out["is_worker_died"] = isinstance(exc, stoker.WorkerDiedError)
        out["error_batch"] = getattr(exc, "batch", None)
    return seen


def pick_deaths(reference: list[list[list[list[int]]]], count: int, seed: int) -> list[list[int]]:
    """`count` distinct batches of the reference run, one sample of each (distinct samples),
    as [index, occurrence]: a sample's occurrence in epoch e is e."""
    rng = random.Random(seed)
    where = [(e, b) for e, epoch in enumerate(reference) for b in range(len(epoch))]
    chosen: list[list[int]] = []
    used: set[int] = set()
    for e, b in rng.sample(where, len(where)):
        sample = reference[e][b][rng.randrange(len(reference[e][b]))][0]
        if sample in used:
            continue
        used.add(sample)
        chosen.append([sample, e])
        if len(chosen) == count:
            break
    return chosen


def run(spec: dict[str, Any]) -> dict[str, Any]:
    method = spec["method"]
    if method == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
    if method in ("spawn", "forkserver"):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    n = spec.get("n", 48)
    kwargs: dict[str, Any] = {
        "batch_size": spec.get("batch_size", 3),
        "num_workers": spec.get("num_workers", 3),
        "multiprocessing_context": method,
        "persistent_workers": spec.get("persistent", False),
        "in_order": spec.get("in_order", True),
    }
    if spec.get("iterable"):
        make = lambda at: Stream(n, spec["kind"], at)  # noqa: E731
    else:
        kwargs["shuffle"] = True
        make = lambda at: Deadly(n, spec["kind"], at, spec["marks"], spec.get("always", False), spec.get("draw", False))  # noqa: E731
    out: dict[str, Any] = {"error": None}
    count = spec.get("epochs", 1)
    before = Snapshot()
    at = spec.get("at", [])
    if not spec.get("iterable"):
        reference = stoker.DataLoader(make([]), generator=spec["seed"], **kwargs)
        out["reference"] = epochs(reference, count, {})
        del reference
        if "deaths" in spec:
            at = pick_deaths(out["reference"], spec["deaths"], spec["death_seed"])
    out["at"] = at
    faulty = stoker.DataLoader(make(at), generator=spec["seed"], max_worker_restarts=spec["restarts"], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["batches"] = epochs(faulty, count, out)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, stoker.WorkerRestartWarning)]
    del faulty
    gc.collect()
    out["leaks"] = before.wait_clean(timeout=10)
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
