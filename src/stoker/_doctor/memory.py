"""The doctor's view of worker processes: a process's descendants, their memory (USS and PSS from
/proc/<pid>/smaps_rollup, less the shared-memory batch slots), and multiprocessing's helper
processes started before the sweep so that they are not counted as workers."""

from __future__ import annotations

import os
from collections.abc import Iterable

MB = 1 << 20


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    if not tasks:
        try:
            import psutil

            return {p.pid for p in psutil.Process(pid).children()}
        except Exception:
            return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return found


def descendants(pid: int | None = None) -> set[int]:
    """All processes below `pid` (this process by default)."""
    todo = [os.getpid() if pid is None else pid]
    seen: set[int] = set()
    while todo:
        for child in _children(todo.pop()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


SHARED_MAPPINGS = ("/memfd:", "/dev/shm/", "/dev/zero", "/SYSV")  # batch transport, not the worker's own


def _shared_part(pid: int) -> tuple[int, int]:
    """(private, PSS) bytes of the process's shared-memory mappings (memfd, /dev/shm): the
    loader's batch slots, which a worker writes and the main process reads; (0, 0) when
    /proc/<pid>/smaps cannot be read."""
    private = pss = 0
    shared = False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if not head[0].endswith(":"):  # a mapping's first line: address perms offset dev inode [name]
                    shared = len(head) > 5 and head[5].startswith(SHARED_MAPPINGS)
                elif shared and head[0] in ("Private_Clean:", "Private_Dirty:"):
                    private += int(head[1]) * 1024
                elif shared and head[0] == "Pss:":
                    pss += int(head[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return private, pss


def smaps_memory(pid: int) -> tuple[int, int] | None:
    """(USS, PSS) of a process in bytes from /proc/<pid>/smaps_rollup, less its
    shared-memory batch slots (see `_shared_part`); None if unreadable."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                    fields[parts[0][:-1]] = int(parts[1]) * 1024
    except OSError:
        return None
    if "Pss" not in fields:
        return None
    private, pss = _shared_part(pid)
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0) - private
    return max(uss, 0), max(fields["Pss"] - pss, 0)


def _mean_memory(pids: Iterable[int]) -> tuple[float, float] | None:
    """Mean (USS, PSS) in MB over these processes; None if none could be read."""
    readings = [m for m in (smaps_memory(p) for p in pids) if m is not None]
    if not readings:
        return None
    return (
        sum(r[0] for r in readings) / len(readings) / MB,
        sum(r[1] for r in readings) / len(readings) / MB,
    )


def _start_helpers(method: str) -> None:
    """Start multiprocessing's helper processes (forkserver, resource tracker) before the
    sweep, so that they are not mistaken for a configuration's workers."""
    if method == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
    if method in ("spawn", "forkserver"):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
