"""What a test may not leave behind: child processes, threads, pipes/sockets, /dev/shm entries."""

from __future__ import annotations

import gc
import os
import threading
import time

import psutil

SETTLE_S = 8.0


def _fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(("pipe:", "socket:", "anon_inode:", "/memfd:", "/dev/shm")):
            out[int(name)] = target
    return out


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


class Snapshot:
    def __init__(self) -> None:
        self.threads = {t.ident for t in threading.enumerate()}
        self.fds = _fds()
        self.shm = _shm()
        self.children = {p.pid for p in psutil.Process().children(recursive=True)}

    def leaks(self) -> list[str]:
        problems = []
        children = [p for p in psutil.Process().children(recursive=True) if p.pid not in self.children]
        live = []
        for p in children:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    live.append(p)
            except psutil.NoSuchProcess:
                pass
        if live:
            problems.append(f"child processes left: {[(p.pid, p.name()) for p in live]}")
        threads = [t for t in threading.enumerate() if t.ident not in self.threads and t.is_alive()]
        if threads:
            problems.append(f"threads left: {[t.name for t in threads]}")
        fds = {fd: t for fd, t in _fds().items() if self.fds.get(fd) != t}
        if fds:
            problems.append(f"file descriptors left: {fds}")
        shm = _shm() - self.shm
        if shm:
            problems.append(f"/dev/shm entries left: {sorted(shm)}")
        return problems

    def wait_clean(self, timeout: float = SETTLE_S, allow: str | None = None) -> list[str]:
        """Problems left once things settle; `allow` names what may stay (e.g. a live loader's
        "stoker-slot" descriptors)."""
        deadline = time.monotonic() + timeout
        while True:
            gc.collect()
            problems = [p for p in self.leaks() if allow is None or allow not in p]
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.05)
