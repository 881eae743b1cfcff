"""What a test may not leave behind: child processes, threads, pipes/sockets, /dev/shm entries."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterable

import psutil

SETTLE_S = 8.0
KINDS = ("processes", "threads", "fds", "shm")  # the keys of Snapshot.found()


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


def _used_elsewhere(names: set[str]) -> set[str]:
    """Those of these /dev/shm entries that a process other than this one and its descendants
    has open or mapped (matched by inode: glibc's sem_open maps a temporary file that it then
    renames). /dev/shm is the machine's: other processes (other test sessions on a shared
    machine) make entries of their own, e.g. multiprocessing's sem.mp-* semaphores, which
    its spawn and forkserver contexts keep until the lock is collected."""
    files = {}
    for name in names:
        try:
            st = os.stat(f"/dev/shm/{name}")
        except OSError:
            continue
        files[st.st_dev, st.st_ino] = name
    ours = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    used = set()
    for pid in os.listdir("/proc"):
        if not files or not pid.isdigit() or int(pid) in ours:
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            keys = []
            for line in maps.splitlines():
                if "/dev/shm/" in line:
                    _, _, _, dev, inode = line.split(maxsplit=5)[:5]
                    major, minor = dev.split(":")
                    keys.append((os.makedev(int(major, 16), int(minor, 16)), int(inode)))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    keys.append((st.st_dev, st.st_ino))
        except (OSError, ValueError):  # gone, or not ours to read
            continue
        for key in keys:
            name = files.pop(key, None)
            if name is not None:
                used.add(name)
    return used


def shm_left(before: set[str], pids: Iterable[int]) -> list[str]:
    """The /dev/shm entries made since `before` (a listing) that may be the leftovers of the
    test's processes (`pids`: its children and their workers, alive or not): /dev/shm is the
    machine's, and other programs make and remove entries there meanwhile. An entry another
    process has open or mapped is theirs; so is one whose name carries another process's pid
    (torch's `torch_<pid>_...` files), as far as the name says.
    """
    ours = {str(pid) for pid in pids}
    found = _shm() - before
    found -= _used_elsewhere(found)
    return sorted(name for name in found if not _names_another_pid(name, ours))


def _names_another_pid(name: str, ours: set[str]) -> bool:
    parts = name.split("_")
    return len(parts) > 2 and parts[0] == "torch" and parts[1].isdigit() and parts[1] not in ours


def _harness_thread(thread: threading.Thread) -> bool:
    """pytest-timeout's timer (timeout_method = "thread"): the harness's, not the test's."""
    return isinstance(thread, threading.Timer) and getattr(thread.function, "__module__", "") == "pytest_timeout"


def _describe(process: psutil.Process) -> tuple[int, str]:
    try:
        command = " ".join(process.cmdline())[:120] or process.name()
    except psutil.Error:
        command = "?"
    return process.pid, command


class Snapshot:
    def __init__(self) -> None:
        self.threads = {t.ident for t in threading.enumerate()}
        self.fds = _fds()
        self.shm = _shm()
        self.children = {p.pid for p in psutil.Process().children(recursive=True)}

    def found(self, allow: str | None = None) -> dict[str, str]:
        """What is there now and was not at the snapshot, by kind (see KINDS): a description
        of each kind with something left. `allow`: descriptors whose link name contains it,
        and other kinds whose description does, are not counted."""
        problems = {}
        children = [p for p in psutil.Process().children(recursive=True) if p.pid not in self.children]
        live = []
        for p in children:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    live.append(p)
            except psutil.NoSuchProcess:
                pass
        if live:
            problems["processes"] = f"child processes left: {[_describe(p) for p in live]}"
        threads = [
            t for t in threading.enumerate() if t.ident not in self.threads and t.is_alive() and not _harness_thread(t)
        ]
        if threads:
            problems["threads"] = f"threads left: {[t.name for t in threads]}"
        fds = {fd: t for fd, t in _fds().items() if self.fds.get(fd) != t and (allow is None or allow not in t)}
        if fds:
            problems["fds"] = f"file descriptors left: {fds}"
        shm = _shm() - self.shm
        if shm:
            shm -= _used_elsewhere(shm)
        if shm:
            problems["shm"] = f"/dev/shm entries left: {sorted(shm)}"
        if allow is not None:
            problems = {kind: p for kind, p in problems.items() if kind == "fds" or allow not in p}
        return problems

    def leaks(self) -> list[str]:
        return list(self.found().values())

    def wait_clean(
        self, timeout: float = SETTLE_S, allow: str | None = None, kinds: Iterable[str] = KINDS
    ) -> list[str]:
        """Problems left once things settle (polled: returns as soon as nothing is left);
        `allow` names what may stay (e.g. a live loader's "stoker-slot" descriptors),
        `kinds` which of KINDS are looked at."""
        kinds = set(kinds)
        deadline = time.monotonic() + timeout

        def problems() -> list[str]:
            return [p for kind, p in self.found(allow).items() if kind in kinds]

        while True:
            if not problems():  # cheap; a collection costs tens of ms once torch is loaded
                return []
            gc.collect()  # what only a reference cycle keeps alive goes now
            left = problems()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.02)
