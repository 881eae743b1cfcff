"""A loader's state in an Orbax checkpoint, saved and restored in the same `CheckpointManager`
step as the model, on every process:

```python
mngr.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave(state),
                                        loader=stoker.jax.CheckpointSave(loader)))
mngr.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(abstract),
                                           loader=stoker.jax.CheckpointRestore(loader)))
```

Each process writes its loader's `state_dict()` to `process_<i>-of-<n>.json` in the item's
directory (a state that holds a dataset's own non-JSON values: `.pkl`, pickled). A process
restores its own file; on another number of processes, process 0's file, which every process
holds alike (stoker's global batches); the loader refuses a state whose streams were each
process's own, saying why. Imported only when `stoker.jax`'s Orbax names are first used.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from typing import Any

try:
    import orbax.checkpoint as ocp
except ImportError as exc:  # pragma: no cover - exercised only without orbax
    raise ImportError("stoker.jax's CheckpointSave/CheckpointRestore need Orbax: pip install orbax-checkpoint") from exc

_FILE = re.compile(r"process_(\d+)-of-(\d+)\.(json|pkl)$")


def _process() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


def _json_exact(value: Any) -> bool:
    """Whether JSON gives `value` back equal and of the same types."""
    if value is None or type(value) in (str, int, bool):
        return True
    if type(value) is float:
        return value == value and value not in (float("inf"), float("-inf"))
    if type(value) is list:
        return all(_json_exact(item) for item in value)
    if type(value) is dict:
        return all(type(key) is str and _json_exact(item) for key, item in value.items())
    return False


def _check_loader(item: Any, what: str) -> Any:
    if not (callable(getattr(item, "state_dict", None)) and callable(getattr(item, "load_state_dict", None))):
        raise TypeError(
            f"{what} takes a loader with state_dict() and load_state_dict() (a stoker.jax.DataLoader), "
            f"but got {type(item).__name__}"
        )
    return item


class CheckpointHandler:
    """Orbax's handler for a stoker loader's state (see the module's docstring): registered
    for `CheckpointSave` and `CheckpointRestore`; Orbax makes and calls it."""

    def save(self, directory: Any, item: Any = None, args: Any = None) -> None:
        """Write this process's loader state into `directory`.

        Args:
            directory: The item's directory (an `etils.epath.Path`), made by Orbax.
            item: The loader (Orbax's older API). Defaults to None.
            args: A `CheckpointSave` holding the loader. Defaults to None.
        """
        loader = _check_loader(item if item is not None else args.item, "CheckpointSave")
        state = loader.state_dict()
        index, count = _process()
        if _json_exact(state):
            (directory / f"process_{index}-of-{count}.json").write_text(json.dumps(state))
        else:  # a dataset's own state that JSON would not give back as it was (tuples, int keys...)
            (directory / f"process_{index}-of-{count}.pkl").write_bytes(pickle.dumps(state, protocol=5))

    def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
        """Load this process's saved state (or process 0's, saved on another number of
        processes) into the loader, and return the loader.

        Args:
            directory: The item's directory in the checkpoint.
            item: The loader (Orbax's older API). Defaults to None.
            args: A `CheckpointRestore` holding the loader. Defaults to None.

        Raises:
            FileNotFoundError: when the directory holds no loader state, naming it.
            ValueError: when the loader refuses the state (see its `load_state_dict`).
        """
        loader = _check_loader(item if item is not None else args.item, "CheckpointRestore")
        index, count = _process()
        saved = {}
        for path in directory.iterdir():
            found = _FILE.search(path.name)
            if found:
                saved[(int(found.group(1)), int(found.group(2)))] = path
        if not saved:
            raise FileNotFoundError(f"{directory} holds no stoker loader state (process_<i>-of-<n>.json)")
        path = saved.get((index, count))
        if path is None:
            path = min(saved.items())[1]  # process 0's: the same global state in every process
        state = pickle.loads(path.read_bytes()) if path.name.endswith(".pkl") else json.loads(path.read_text())
        loader.load_state_dict(state)
        return loader

    def structure(self, directory: Any) -> None:
        """Orbax's interface; a loader state has no array structure."""
        return None

    def metadata(self, directory: Any) -> None:
        """Orbax's interface; nothing to report."""
        return None

    def finalize(self, directory: Any) -> None:
        """Orbax's interface; the files are complete when `save` returns."""

    def close(self) -> None:
        """Orbax's interface; nothing is held."""

    @classmethod
    def typestr(cls) -> str:
        """The name Orbax records for this handler."""
        return f"{cls.__module__}.{cls.__qualname__}"


@ocp.args.register_with_handler(CheckpointHandler, for_save=True)
@dataclasses.dataclass
class CheckpointSave(ocp.args.CheckpointArgs):
    """Save a loader's state in an Orbax checkpoint (`item`: the `stoker.jax.DataLoader`)."""

    item: Any


@ocp.args.register_with_handler(CheckpointHandler, for_restore=True)
@dataclasses.dataclass
class CheckpointRestore(ocp.args.CheckpointArgs):
    """Restore a loader's state from an Orbax checkpoint into `item` (the loader)."""

    item: Any
