"""What a numpy batch becomes under `stoker.jax`: `jax.Array`s of the global batch, laid out
by a `jax.sharding.Sharding`, placed ahead of the step through `device.py`'s pipeline.

```
  sampler ── global batch i (indices) ──rows of this process──▶ workers ─▶ numpy batch (arena)
                                                                               │
             Layout.place: device_put / make_array_from_process_local_data ◀──┘ (asynchronous)
                                                                               │
  consumer ◀── jax batch i ◀── JaxCopier.ready        JaxCopier.release: wait for i's transfer,
                                                        then let the host batch (its slot) go
```

A `Layout` is decided once per loader: the sharding of rank >= 1 leaves (and the replicated one
of rank-0 leaves), and, for each global batch length, which rows of it this process's devices
hold. Rows are found from the sharding's addressable devices, never from device ids (ids are
not contiguous across processes). Nothing here sends anything between processes.

jax is imported by the functions that need it: this module is imported only by `stoker.jax`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .pin import WALK, map_batch


def import_jax() -> Any:
    """The jax module, or an ImportError saying how to install it."""
    try:
        import jax
    except ImportError as exc:  # pragma: no cover - exercised only without jax
        raise ImportError(
            "stoker.jax needs JAX; install it with `pip install 'stoker[jax]'`, or use `stoker` (numpy batches)"
        ) from exc
    return jax


def _is_array_leaf(obj: Any) -> bool:
    """A numpy array jax can hold (numbers and booleans), or a numpy scalar of one."""
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.dtype.kind in "biufc"
    return False


def default_sharding(jax: Any) -> Any:
    """The batch axis split over every device, in `jax.devices()`' order, of a 1-D mesh."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    return NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))


def _replicated(sharding: Any) -> Any:
    """A sharding that puts a whole array on every device `sharding` uses."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    devices = sorted(sharding.device_set, key=lambda d: (d.process_index, d.id))
    return NamedSharding(Mesh(np.array(devices), ("all",)), PartitionSpec())


def probe_shape(sharding: Any, rows: int | None = None) -> tuple[int, ...]:
    """A global shape that `sharding` can cut on every axis (its spec's rank, or 1): `rows` rows
    (None: a multiple of every cut's count), the other axes as long as the devices are many
    (any cut of an axis is a product of mesh axes, which divides the number of devices)."""
    spec = getattr(sharding, "spec", None)
    rank = max(len(spec), 1) if spec is not None else 1
    devices = len(sharding.device_set)
    return (devices * 1024 if rows is None else rows,) + (devices,) * (rank - 1)


def parts_of(index_map: Any) -> int:
    """How many distinct pieces of the first axis a devices-to-indices map holds."""
    return len({(s[0].start, s[0].stop) for s in index_map.values()})


@dataclass
class Layout:
    """How a global batch is laid out on the devices, and which of its rows this process loads.

    `own_rows` None: the rows of this process follow from the sharding (one JAX program over
    every process). Given as (index, count): the user named this process's place among `count`
    processes that each run JAX alone; it loads its even share of each global batch, placed on
    its own devices (the arrays are then this process's share, not the global batch).
    """

    sharding: Any
    multiprocess: bool
    own_rows: tuple[int, int] | None = None
    _rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    _replicated: Any = None
    _named: Any = None

    @property
    def parts(self) -> int:
        """How many pieces the batch axis is cut into (over every process)."""
        return parts_of(self.sharding.devices_indices_map(probe_shape(self.sharding)))

    @property
    def own_parts(self) -> int:
        """How many of those pieces this process's devices hold."""
        return parts_of(self.sharding.addressable_devices_indices_map(probe_shape(self.sharding)))

    def check_batch(self, rows: int, what: str = "batch_size") -> None:
        """A ValueError naming `what` when a global batch of `rows` rows cannot be cut evenly."""
        parts = self.parts
        if self.own_rows is not None:
            count = self.own_rows[1]
            if rows % count:
                raise ValueError(
                    f"{what} ({rows}) should be divisible by process_count ({count}): each process "
                    "loads an equal share of every global batch"
                )
            rows //= count
        if rows % parts:
            raise ValueError(
                f"{what} ({rows}{' rows per process' if self.own_rows else ''}) should be divisible by "
                f"the {parts} pieces the sharding cuts the batch axis into ({self.sharding}); choose a "
                "multiple, or drop_last=True when only the last batch is shorter"
            )

    def rows(self, length: int) -> tuple[int, int]:
        """The rows [start, stop) of a global batch of `length` rows that this process loads."""
        found = self._rows.get(length)
        if found is not None:
            return found
        if self.own_rows is not None:
            index, count = self.own_rows
            share = length // count
            found = (index * share, (index + 1) * share)
        elif not self.multiprocess:
            found = (0, length)
        else:
            self.check_batch(length, "a global batch's length")
            index_map = self.sharding.addressable_devices_indices_map(probe_shape(self.sharding, length))
            spans = sorted({(s[0].indices(length)[0], s[0].indices(length)[1]) for s in index_map.values()})
            start, stop = spans[0][0], spans[0][1]
            for begin, end in spans[1:]:
                if begin > stop:
                    raise ValueError(
                        f"the sharding {self.sharding} gives this process's devices rows that are not "
                        f"contiguous in the global batch ({spans}); stoker.jax loads one contiguous block "
                        "of rows per process: order the mesh's devices by process (jax.make_mesh does)"
                    )
                stop = max(stop, end)
            found = (start, stop)
        self._rows[length] = found
        return found

    def leaf_sharding(self, ndim: int) -> Any:
        """The sharding of a leaf of rank `ndim`: replicated for rank 0; a `NamedSharding`'s
        spec cut to the leaf's rank."""
        if ndim == 0:
            if self._replicated is None:
                self._replicated = _replicated(self.sharding)
            return self._replicated
        spec = getattr(self.sharding, "spec", None)
        if spec is None or len(spec) <= ndim:
            return self.sharding
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.sharding.mesh, PartitionSpec(*tuple(spec)[:ndim]))

    def place(self, batch: Any, global_rows: int | None) -> Any:
        """`batch` (this process's rows of a global batch of `global_rows` rows) with each
        numeric leaf a `jax.Array` of the global shape; transfers are started, not awaited.

        Raises:
            ValueError: when the leaves of rank >= 1 differ in their number of rows, naming them.
        """
        jax = import_jax()
        leaves: list[np.ndarray] = []
        paths: list[str] = []

        def collect(obj: Any, path: str) -> None:
            # the leaves in map_batch's order, with a path for the error message
            if _is_array_leaf(obj):
                leaves.append(np.asarray(obj))
                paths.append(path or "the batch")
            elif isinstance(obj, dict):
                for key, value in obj.items():
                    collect(value, f"{path}[{key!r}]")
            elif isinstance(obj, (list, tuple)):
                for i, value in enumerate(obj):
                    collect(value, f"{path}[{i}]")

        collect(batch, "")
        if not leaves:
            return batch
        lengths = {p: a.shape[0] for p, a in zip(paths, leaves) if a.ndim}
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"{p}: {n}" for p, n in lengths.items())
            raise ValueError(
                f"the leaves of a batch should have the same number of rows to be laid out as one global "
                f"batch, but got {shown}; check collate_fn (a leaf that is not per-sample can be made a "
                "rank-0 array, which is replicated)"
            )
        local = next(iter(lengths.values()), 0)
        total = local if global_rows is None else global_rows
        shardings = [self.leaf_sharding(a.ndim) for a in leaves]
        if self.multiprocess:
            placed = [
                jax.make_array_from_process_local_data(s, a, (total, *a.shape[1:]) if a.ndim else ())
                for s, a in zip(shardings, leaves)
            ]
        else:
            placed = jax.device_put(leaves, shardings)
        out = iter(placed)
        return map_batch(batch, lambda obj: next(out) if _is_array_leaf(obj) else WALK)


@dataclass
class JaxHandle:
    """A batch being placed: the host batch (kept until its transfers are done), the jax
    batch, and the loader's state right after the batch was drawn."""

    host: Any
    placed: Any
    state: Any


class JaxCopier:
    """`device.py`'s Copier for JAX: `start` places a batch (asynchronously), `ready` hands it
    over, `release` waits for its transfers and lets its host batch go. The host arrays are
    never handed to the consumer, so a batch in an arena slot is safe to place."""

    keeps_host_until_copied = True

    def __init__(self, layout: Layout, global_rows: Callable[[Any], int | None], delivered: Any) -> None:
        self.layout = layout
        self.global_rows = global_rows
        self.delivered = delivered  # its `state`: the loader's state after the batch last handed over

    def start(self, item: Any) -> JaxHandle:
        """Begin placing one (host batch, state) pair."""
        batch, state = item
        return JaxHandle(batch, self.layout.place(batch, self.global_rows(batch)), state)

    def ready(self, handle: JaxHandle) -> Any:
        """The jax batch, once its transfers are done (they began `device_prefetch` batches
        ago); its host batch is let go now, and its state becomes the one `state_dict()`
        reports."""
        placed, handle.placed, handle.host = handle.placed, None, None
        import_jax().block_until_ready(placed)
        self.delivered.state = handle.state
        return placed

    def release(self, handle: JaxHandle) -> None:
        """Drop what the handle still holds (a batch never handed over: its transfers are
        awaited first, so that its host memory is never reused under them)."""
        if handle.placed is not None:
            try:
                import_jax().block_until_ready(handle.placed)
            except RuntimeError:  # deleted arrays: nothing is reading the host batch
                pass
        handle.host = handle.placed = handle.state = None
