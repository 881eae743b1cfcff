"""How a worker process dies with the main process.

The engine decides the policy once, in the main process (`ParentWatch.for_start_method`);
the worker arms it first thing (`ParentWatch.arm`) and gets back the check its loop runs
between tasks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ParentWatch:
    """The main process a worker must not outlive, and how it watches it."""

    main_pid: int
    start_method: str
    pdeathsig: bool  # PR_SET_PDEATHSIG is safe: it fires when the *thread* that forked us exits

    @classmethod
    def for_start_method(cls, start_method: str) -> ParentWatch:
        """The policy for workers started now, from the calling thread."""
        pdeathsig = threading.current_thread() is threading.main_thread() and start_method != "forkserver"
        return cls(os.getpid(), start_method, pdeathsig)

    def arm(self) -> Callable[[], bool] | None:
        """In the worker: arrange to die with the main process. Returns the liveness check
        for the worker loop, or None when the main process is already gone."""
        if self.pdeathsig:
            _die_with_parent()
        if self.start_method == "forkserver":  # our parent is the server, which exits with main
            parent = os.getppid()
        else:
            parent = self.main_pid
            if os.getppid() != parent:
                return None
        return lambda: os.getppid() == parent


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that started it exits."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
