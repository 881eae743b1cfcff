"""The forkserver's guarded preload: imported only inside multiprocessing's forkserver, as the
first of the modules stoker asks it to preload (`forkserver.prepare_forkserver`).

multiprocessing's server imports its preload list itself and skips only an ImportError:
any other exception, or a SystemExit (a module that parses `sys.argv` at import sees the
server's `['-c']`), ends the server, and then no forkserver worker can start. So stoker's
part of the list follows this module, and this module imports it instead, then ends the
server's loop (it truncates the list the server is iterating, found in the server's frame):

- each module is imported under the main process's `sys.argv` (the entry after this
  module's name carries it), so that a module parsing it at import reads what it read in
  the main process, and what the workers inherit matches what they would have imported;
- a module that raises anything but an ImportError (skipped silently, as multiprocessing
  does) is skipped with one RuntimeWarning naming it; a worker that runs the main script
  then imports it itself, as it would without the preload.

Where the server's frame is not found (another Python's forkserver), this module does
nothing and the server goes on with the list as multiprocessing does: the argv entry is not
a module's name, and is skipped as an ImportError.
"""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from types import FrameType
from typing import Any

from .forkserver import ARGV_PREFIX


def _server_list() -> list[Any] | None:
    """The preload list multiprocessing's forkserver is iterating, if it is importing us."""
    server = sys.modules.get("multiprocessing.forkserver")
    code = getattr(getattr(server, "main", None), "__code__", None)
    if code is None:
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is None:
        return None
    preload = frame.f_locals.get("preload")
    return preload if isinstance(preload, list) and __name__ in preload else None


def _preload(entries: list[str]) -> None:
    argv = [json.loads(e[len(ARGV_PREFIX) :]) for e in entries if e.startswith(ARGV_PREFIX)]
    saved = sys.argv
    if argv:
        sys.argv = list(argv[-1])
    try:
        for name in entries:
            if name.startswith(ARGV_PREFIX):
                continue
            try:
                importlib.import_module(name)
            except ImportError:
                pass
            except (Exception, SystemExit) as exc:
                warnings.warn(
                    f"stoker: the forkserver could not preload module {name!r} and skipped it "
                    f"({type(exc).__name__}: {exc}); forkserver workers import it themselves",
                    RuntimeWarning,
                    stacklevel=1,
                )
    finally:
        sys.argv = saved


def _run() -> None:
    preload = _server_list()
    if preload is None:
        return
    at = preload.index(__name__)
    ours = [str(entry) for entry in preload[at + 1 :]]
    del preload[at + 1 :]  # the server's loop ends with this module
    _preload(ours)


_run()
