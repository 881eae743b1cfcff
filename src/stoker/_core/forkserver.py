"""Preparing the forkserver that forkserver workers are forked from.

A loader with forkserver workers has the server import, once, what every worker would import
on its own: stoker's worker modules, the dataset's and the collate function's modules, and
what the main script imported at its top (a forkserver worker runs the main script again).

The server imports them through `preload` (its guard): under the main process's `sys.argv`,
and skipping with a warning any module that raises, so that none can take the server down.
The list multiprocessing keeps is the user's own entries, then `GUARD`, the argv entry and
stoker's modules.
"""

from __future__ import annotations

import json
import sys
from types import ModuleType
from typing import Any

WORKER_MODULES = ("stoker._core.worker", "stoker._core.arena")
GUARD = "stoker._core.preload"
ARGV_PREFIX = "stoker-argv:"  # the list entry after GUARD: the main process's sys.argv


def prepare_forkserver(dataset: Any, collate_fn: Any = None, start: bool = False) -> None:
    """Have the forkserver import what every worker imports (stoker's worker modules, the
    dataset's and the collate function's modules: `stoker.torch`'s collate brings torch) once,
    so that each worker forked from it starts with them, and (`start`) start it now, so that
    those imports overlap with the caller's own set-up.

    The preload only applies to a server not yet running; modules already listed (by the
    user, or multiprocessing's default `__main__`) are kept before stoker's and imported by
    the server as multiprocessing does. Stoker's are imported by the guard module (see
    `preload`): under this process's `sys.argv`, and one that raises is skipped with a
    warning naming it, so that the server stays up and the workers start."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    current = list(getattr(server, "_preload_modules", None) or ["__main__"])
    user, ours = current, []
    if GUARD in current:  # an earlier call's list: after the guard, stoker's own
        at = current.index(GUARD)
        user = current[:at]
        ours = [m for m in current[at + 1 :] if not m.startswith(ARGV_PREFIX)]
    wanted = [*ours, *WORKER_MODULES]
    for module in (getattr(type(dataset), "__module__", None), getattr(collate_fn, "__module__", None)):
        if isinstance(module, str) and module not in ("__main__", "builtins"):
            wanted.append(module)
    wanted.extend(main_imports())
    argv = ARGV_PREFIX + json.dumps([str(a) for a in getattr(sys, "argv", None) or []])
    modules = [*user, GUARD, argv, *(m for m in dict.fromkeys(wanted) if m not in user)]
    if modules != current:
        forkserver.set_forkserver_preload(modules)
    if start:
        forkserver.ensure_running()


def main_imports() -> list[str]:
    """The modules the main script took at its top (modules it imported, and those of the
    classes and functions it imported from them), all already loaded here.

    A forkserver worker runs the main script again, as a spawn worker does: multiprocessing's
    preload of `__main__` never reaches the server (it passes the script's path under a key
    the server does not read), so a training script that imports torch at its top costs each
    worker torch's import (~0.8 s of CPU). With these preloaded by the server, the worker's
    run of the script finds them imported."""
    main = sys.modules.get("__main__")
    if main is None or not (getattr(main, "__file__", None) or getattr(main, "__spec__", None)):
        return []  # interactive: nothing is run again
    names = []
    for value in list(vars(main).values()):
        try:
            name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
        except Exception:  # an object whose attributes raise: not a module's name
            continue
        if (
            isinstance(name, str)
            and name in sys.modules
            and name not in ("__main__", "__mp_main__", "builtins")
            and not name.startswith("_")
        ):
            names.append(name)
    return list(dict.fromkeys(names))
