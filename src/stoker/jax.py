"""The JAX face: `from stoker.jax import DataLoader` gives stoker's loader whose batches are
`jax.Array`s of the global batch on a device mesh (`sharding=`), placed ahead of the step
(`device_prefetch=`), resumable with Orbax (`CheckpointSave`/`CheckpointRestore`, beside the
model in the same `CheckpointManager` step). Imports no torch. Needs JAX
(`pip install 'stoker[jax]'`); Orbax's arguments need `orbax-checkpoint`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core.jax_place import import_jax as _import_jax

_import_jax()

from ._base.hooks import Stateful  # noqa: E402
from ._core.errors import WorkerDiedError, WorkerError  # noqa: E402
from ._core.jax_loader import DataLoader, JaxIterator  # noqa: E402
from ._core.seeding import sample_rng, sample_seed  # noqa: E402
from ._core.worker import WorkerInfo, get_worker_info  # noqa: E402

if TYPE_CHECKING:
    from ._frameworks.orbax import CheckpointHandler, CheckpointRestore, CheckpointSave

__all__ = [
    "CheckpointHandler",
    "CheckpointRestore",
    "CheckpointSave",
    "DataLoader",
    "JaxIterator",
    "Stateful",
    "WorkerDiedError",
    "WorkerError",
    "WorkerInfo",
    "get_worker_info",
    "sample_rng",
    "sample_seed",
]


def __getattr__(name: str) -> Any:
    # Orbax's classes are made when first asked for: orbax-checkpoint is imported only then
    if name in ("CheckpointHandler", "CheckpointSave", "CheckpointRestore"):
        from ._frameworks import orbax

        return getattr(orbax, name)
    raise AttributeError(f"module 'stoker.jax' has no attribute {name!r}")
