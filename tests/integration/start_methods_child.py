"""Run by test_start_methods.py in a fresh interpreter: makes `method` the default start
method (`multiprocessing.set_start_method`, as Python 3.14 does with forkserver on Linux),
then runs loaders that name no `multiprocessing_context`. Prints one line, `RESULT <json>`.

    python start_methods_child.py <method>
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import multiprocessing.forkserver
import os
import re
import sys
import threading
import time
from typing import Any

import numpy as np

import stoker

N = 30


class Rows(stoker.Dataset):
    """Sample i: [i, the pid that read it, that process's parent]."""

    def __init__(self, fail_at: int = -1) -> None:
        self.fail_at = fail_at

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> np.ndarray:
        if index == self.fail_at:
            raise ValueError(f"sample {index} is broken")
        return np.array([index, os.getpid(), os.getppid()], dtype=np.int64)


def _epochs(loader: Any, count: int, rows: list[np.ndarray]) -> list[list[int]]:
    epochs = []
    for _ in range(count):
        batches = list(loader)
        rows += batches
        epochs.append(sorted(int(i) for batch in batches for i in batch[:, 0]))
    return epochs


def _gone(pids: set[int], timeout: float = 10.0) -> list[int]:
    """Those of `pids` still running (not zombies) after `timeout` seconds, polled."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(pid)
            except OSError:
                pass
        if not alive or time.monotonic() > deadline:
            return sorted(alive)
        time.sleep(0.05)


def main(method: str) -> dict[str, Any]:
    multiprocessing.set_start_method(method)
    out: dict[str, Any] = {"default": multiprocessing.get_start_method(), "epochs": {}}
    rows: list[np.ndarray] = []
    for persistent in (False, True):
        loader = stoker.DataLoader(
            Rows(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent, generator=0
        )
        out["epochs"][str(persistent)] = _epochs(loader, 2, rows)
        del loader
    seen = np.concatenate(rows)
    workers = set(seen[:, 1].tolist())
    out["workers"] = len(workers)
    out["read_in_main"] = bool(os.getpid() in workers)
    out["parents"] = sorted({"main" if ppid == os.getpid() else "other" for ppid in seen[:, 2].tolist()})
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    forkserver_pid = getattr(server, "_forkserver_pid", None)
    out["parent_is_forkserver"] = forkserver_pid is not None and set(seen[:, 2].tolist()) == {forkserver_pid}
    failing = stoker.DataLoader(Rows(fail_at=7), batch_size=4, num_workers=2)
    try:
        list(failing)
        out["error"] = None
    except Exception as exc:
        out["error"] = [type(exc).__name__, str(exc)]
        workers |= {int(pid) for pid in re.findall(r"\(pid (\d+)\)", str(exc))}
    del failing
    gc.collect()
    out["left_running"] = _gone(workers)
    out["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("stoker"))
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
