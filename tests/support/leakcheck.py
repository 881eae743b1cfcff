"""What a test may not leave behind: child processes, threads, pipes/sockets, /dev/shm entries
(its own processes' only: see `_ours`)."""

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


def _shm_keys(pids: Iterable[int]) -> set[tuple[int, int]]:
    """The (device, inode) of each /dev/shm file that these processes have open or mapped,
    deleted or not (matched by inode, not name: glibc's sem_open maps a temporary file that it
    then renames)."""
    keys = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            for line in maps.splitlines():
                if "/dev/shm/" in line:
                    _, _, _, dev, inode = line.split(maxsplit=5)[:5]
                    major, minor = dev.split(":")
                    keys.add((os.makedev(int(major, 16), int(minor, 16)), int(inode)))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                        st = os.stat(f"/proc/{pid}/fd/{fd}")
                        keys.add((st.st_dev, st.st_ino))
                except OSError:  # closed meanwhile
                    continue
        except (OSError, ValueError):  # gone, or not ours to read
            continue
    return keys


def _tree(pids: Iterable[int]) -> set[int]:
    """These processes and their descendants, those alive now."""
    tree = set()
    for pid in pids:
        try:
            process = psutil.Process(pid)
            tree.update([pid, *(p.pid for p in process.children(recursive=True))])
        except psutil.Error:
            continue
    return tree


def _ours(names: set[str], pids: Iterable[int]) -> set[str]:
    """Those of these /dev/shm entries that the processes `pids` (and their descendants) made,
    as far as can be told: an entry one of them has open or mapped, or one whose name carries
    one of their pids (torch's `torch_<pid>_...` files). /dev/shm is the machine's and names no
    maker: other programs (other test sessions, Grain's workers, multiprocessing's resource
    trackers unlinking later) make and remove entries there meanwhile, and an entry no process
    holds, with no pid in its name (multiprocessing's `psm_*` and `sem.mp-*`), cannot be tied
    to one of ours, so it is not judged; stoker itself names nothing there (memfd slots)."""
    tree = _tree(pids)
    numbers = {str(pid) for pid in tree | set(pids)}
    ours = {name for name in names if _named_pid(name) in numbers}
    rest = names - ours
    if not rest:
        return ours
    held = _shm_keys(tree)
    for name in rest:
        try:
            st = os.stat(f"/dev/shm/{name}")
        except OSError:  # removed meanwhile
            continue
        if (st.st_dev, st.st_ino) in held:
            ours.add(name)
    return ours


def _named_pid(name: str) -> str | None:
    """The pid a /dev/shm entry's name says made it (torch's `torch_<pid>_...`), if any."""
    parts = name.split("_")
    if len(parts) > 2 and parts[0] == "torch" and parts[1].isdigit():
        return parts[1]
    return None


def shm_left(before: set[str], pids: Iterable[int]) -> list[str]:
    """The /dev/shm entries made since `before` (a listing) that are the leftovers of the
    test's processes (`pids`: its children and their workers, alive or not) as far as can be
    told (see `_ours`): one that a live one of them (or a descendant) holds, or whose name
    carries one of their pids."""
    return sorted(_ours(_shm() - before, pids))


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
            shm = _ours(shm, [os.getpid()])
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
