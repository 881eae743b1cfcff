"""How a worker process dies with the main process.

The engine decides the policy once, in the main process (`ParentWatch.for_start_method`);
the worker arms it first thing (`ParentWatch.arm`) and gets back the check its loop runs
between tasks.

The goal: however the main process ends, SIGKILL included, no worker outlives it, even one
that is deep inside a long `__getitem__`. The worker's loop checks between tasks, which is
not enough for a busy worker, so `arm` sets up three layers:

1. Kernel-level deaths, which need nothing from the worker (a worker stuck in a C call
   that holds the GIL dies too):

   - PR_SET_PDEATHSIG(SIGKILL), where it is safe. Linux sends it when the *thread* that
     forked the worker exits, not the process. Under fork and spawn that thread is the main
     process's thread that started the workers: safe only when it is the main thread (it
     lives as long as the process). Under forkserver it is the forkserver's only thread,
     and the server exits when its "alive" pipe reaches EOF, that is when the main process
     and every client holding the pipe's write end are gone. multiprocessing gives that
     write end to every forkserver child, so a worker first closes its own copy (it never
     uses it: a forkserver child that starts processes starts a server of its own) and
     the server, then PDEATHSIG, follow the main process at once.
   - SIGIO on EOF of multiprocessing's parent sentinel. Every worker, under all three
     start methods, holds the read end of a pipe whose write end the main process keeps
     until the worker has exited (`multiprocessing.parent_process().sentinel`). With
     O_ASYNC and F_SETOWN on it, Linux sends the worker SIGIO when the last write end
     closes; SIGIO's default action ends the process. Armed only while SIGIO has its
     default disposition (a fork worker may inherit a handler of the main process's).

2. A watchdog daemon thread that blocks on a pidfd of the main process (Linux >= 5.3) and
   calls `os._exit(ORPHANED_EXIT)` once it is readable; where pidfd_open is unavailable it
   polls every WATCH_POLL_S. The pid is checked after opening, so a pid reused between the
   main process's death and the open is not mistaken for it: under fork and spawn we are
   the main process's child (`os.getppid()` changes the moment it dies); under forkserver
   the main process's start time (/proc/<pid>/stat), recorded in ParentWatch, must match.
   The thread is a daemon blocked in a system call: it never keeps the worker from
   exiting, and it only acts once the main process is gone.

3. The loop's own check between tasks (the returned callable), for when neither of the
   above could be set up.

The one limit left: a worker stuck in a C call that holds the GIL (its watchdog cannot run)
dies only when the call returns if, when the main process dies, both kernel-level deaths
are held back: PDEATHSIG, because it was not set (started from a thread other than the main
one under fork or spawn) or because the forkserver lives on (another process, say one
forked from the main process, still holds the write end of its alive pipe); and SIGIO,
because the worker handles SIGIO, or because another process forked from the main process
after the worker started (not a stoker worker: those die the same way, the last-forked
first) still holds the write end of the worker's sentinel pipe. In short: a process forked
from the main process, outliving it, can keep such a worker alive until its call returns.
Off Linux only the watchdog (polling) and the loop's check remain.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

_PR_SET_PDEATHSIG = 1
_LINUX = sys.platform.startswith("linux")
WATCH_POLL_S = 0.1  # how often the watchdog polls when it has no pidfd to block on
ORPHANED_EXIT = 1  # the exit status of a worker the watchdog ends


@dataclass(frozen=True)
class ParentWatch:
    """The main process a worker must not outlive, and how it watches it."""

    main_pid: int
    start_method: str
    pdeathsig: bool  # PR_SET_PDEATHSIG is safe: it fires when the *thread* that forked us exits
    main_started: int | None = None  # the main process's start time (clock ticks since boot), to tell a reused pid

    @classmethod
    def for_start_method(cls, start_method: str) -> ParentWatch:
        """The policy for workers started now, from the calling thread."""
        # under forkserver our parent is the server's single thread, which exits with main
        pdeathsig = start_method == "forkserver" or threading.current_thread() is threading.main_thread()
        pid = os.getpid()
        return cls(pid, start_method, pdeathsig, _start_time(pid))

    def arm(self) -> Callable[[], bool] | None:
        """In the worker: arrange to die with the main process. Returns the liveness check
        for the worker loop, or None when the main process is already gone."""
        if self.pdeathsig:
            _die_with_parent()
        # after PDEATHSIG: the server cannot have seen EOF before it was set, we held the pipe
        _drop_forkserver_alive_fd()
        _die_on_sentinel_eof(self.main_pid)
        main = _MainProcess(self)
        if not main.alive():  # it died before we were armed: nothing above will fire
            main.close()
            return None
        try:
            threading.Thread(target=main.watch, name="stoker-parent-watch", daemon=True).start()
        except RuntimeError:  # no thread to spare: the kernel's deaths and the loop's check remain
            pass
        return main.alive


class _MainProcess:
    """The main process as seen from a worker."""

    def __init__(self, watch: ParentWatch) -> None:
        self.pid = watch.main_pid
        self.started = watch.main_started
        self.child = watch.start_method != "forkserver"  # under fork and spawn we are its child
        self.pidfd: int | None = None
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd_open (old kernel, not Linux) or already gone
            pass
        # the pid may have been reused before the open; checked by alive(), after it

    def alive(self) -> bool:
        if self.child:
            return os.getppid() == self.pid
        return _running(self.pid, self.started)

    def watch(self) -> None:
        """The watchdog thread: wait for the main process to end, then end this worker."""
        if self.pidfd is not None:
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            with contextlib.suppress(OSError):
                poller.poll()  # readable once the main process has exited (POLLNVAL if closed under us)
        while self.alive():  # confirms the pidfd's news, or polls when there is no pidfd
            time.sleep(WATCH_POLL_S)
        os._exit(ORPHANED_EXIT)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that started it exits."""
    if not _LINUX:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _drop_forkserver_alive_fd() -> None:
    """Close this process's copy of the write end of the main process's forkserver "alive"
    pipe (inherited by forkserver and fork workers), so that the server's life does not
    depend on ours. multiprocessing in a worker does not use it: it starts a server of its
    own (under forkserver) or cannot use its parent's at all (under fork)."""
    module = sys.modules.get("multiprocessing.forkserver")
    server = getattr(module, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if not isinstance(fd, int):
        return
    server._forkserver_alive_fd = None  # type: ignore[union-attr]
    with contextlib.suppress(OSError):
        os.close(fd)


def _die_on_sentinel_eof(main_pid: int) -> None:
    """Have Linux send us SIGIO, whose default action ends the process, when the main
    process's end of our parent sentinel pipe closes: when the main process dies."""
    if not _LINUX:
        return
    import fcntl
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None or parent.pid != main_pid:
        return
    if signal.getsignal(signal.SIGIO) != signal.SIG_DFL:
        return  # someone handles SIGIO here: it would not end us, and it is not ours to change
    try:
        fd = parent.sentinel
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    except (ValueError, OSError):
        pass


def _stat(pid: int) -> list[str] | None:
    """Fields 3 onwards of /proc/<pid>/stat (state, ppid, ...), or None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].decode("ascii", "replace").split()  # comm may hold spaces


def _start_time(pid: int, fields: list[str] | None = None) -> int | None:
    """When the process started, in clock ticks since boot (field 22), or None."""
    fields = _stat(pid) if fields is None else fields
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _running(pid: int, started: int | None) -> bool:
    """Whether `pid` is still the (not yet exited) process that started at `started`."""
    if started is not None:
        fields = _stat(pid)
        if fields is not None:
            return fields[0] not in ("Z", "X") and _start_time(pid, fields) == started
        if os.path.isdir("/proc/self"):
            return False  # /proc works, the process is gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
