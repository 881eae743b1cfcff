"""Preparing the forkserver that forkserver workers are forked from.

A loader with forkserver workers has the server import, once, what every worker would import
on its own: stoker's worker modules, the dataset's and the collate function's modules, and
what the main script imported at its top (a forkserver worker runs the main script again).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

WORKER_MODULES = ("stoker._core.worker", "stoker._core.arena")


def prepare_forkserver(dataset: Any, collate_fn: Any = None, start: bool = False) -> None:
    """Have the forkserver import what every worker imports (stoker's worker modules, the
    dataset's and the collate function's modules: `stoker.torch`'s collate brings torch) once,
    so that each worker forked from it starts with them, and (`start`) start it now, so that
    those imports overlap with the caller's own set-up.

    The preload only applies to a server not yet running; modules already listed (by the
    user, or multiprocessing's default `__main__`) are kept. A module that fails to import is
    skipped by the server, as multiprocessing does for every preload."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    current = list(getattr(server, "_preload_modules", None) or ["__main__"])
    wanted = [*WORKER_MODULES]
    for module in (getattr(type(dataset), "__module__", None), getattr(collate_fn, "__module__", None)):
        if isinstance(module, str) and module not in ("__main__", "builtins"):
            wanted.append(module)
    wanted.extend(main_imports())
    modules = list(dict.fromkeys([*current, *wanted]))
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
