"""The JAX tier: stoker.jax's loader with real JAX on 8 CPU devices.

XLA_FLAGS is set here, at import, before anything initialises JAX's backend (which reads it
once); the backend is then started (and a sharded transfer and a jitted op run once) before
the first test, so that the threads JAX keeps for the rest of the process are not taken for a
test's leftovers by the leak check. Every module here is skipped, unimported, when JAX is not
installed or its backend was started elsewhere with fewer devices.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

DEVICES = 8
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")


def _started_before() -> bool:
    """Whether JAX's backend was started before this conftest set XLA_FLAGS (private API,
    read only for the skip's reason)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def _skip_reason() -> str | None:
    if importlib.util.find_spec("jax") is None:
        return "the JAX tier needs jax: pip install 'stoker[jax]'"
    early = _started_before()
    import jax

    found = jax.local_device_count()
    if found >= DEVICES:
        return None
    if early:
        why = "its backend was started before tests/jax_face/conftest.py set XLA_FLAGS (run tests/jax_face in a session of its own)"
    else:
        why = f"XLA_FLAGS is {os.environ.get('XLA_FLAGS')!r} (unset it, or give --xla_force_host_platform_device_count={DEVICES})"
    return f"the JAX tier needs {DEVICES} CPU devices, but JAX has {found}: {why}"


def _warm_up() -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((DEVICES,), ("data",))
    placed = jax.device_put(np.arange(4 * DEVICES, dtype=np.float32), NamedSharding(mesh, PartitionSpec("data")))
    jax.jit(lambda a: a * 2)(placed).block_until_ready()


SKIP_REASON = _skip_reason()
if SKIP_REASON is None:
    _warm_up()
else:

    class _SkippedModule(pytest.Module):
        """A test module of this tier, reported as skipped without being imported."""

        def collect(self) -> Any:
            pytest.skip(SKIP_REASON)

    def pytest_pycollect_makemodule(module_path: Any, parent: Any) -> Any:
        return _SkippedModule.from_parent(parent, path=module_path)
