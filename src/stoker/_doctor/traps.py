"""The doctor's traps, each with its evidence and its fix: Python object containers in the
dataset (copy-on-read under fork), global RNGs drawn in __getitem__, a small /dev/shm, CUDA
initialised before fork, more workers than CPUs."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .measure import Row
from .memory import MB
from .probe import Profile, _fetch_items
from .target import Target

PYTHON_OBJECTS_TRAP = 10_000  # containers with at least this many Python objects are a trap


@dataclass
class Container:
    """A container of many Python objects found on the dataset."""

    path: str
    type: str
    objects: int
    approx_mb: float


def _count_objects(value: Any) -> tuple[int, int]:
    """(Python objects, approximate bytes) in a list/tuple/dict/object array, estimated from
    its first elements."""
    if isinstance(value, np.ndarray):
        items: Sequence[Any] = value.ravel()[:100].tolist()
        n = int(value.size)
    elif isinstance(value, dict):
        items = [x for kv in list(value.items())[:50] for x in kv]
        n = 2 * len(value)
    else:
        items = list(value[:100])
        n = len(value)
    per = []
    for item in items:
        if isinstance(item, (list, tuple)):
            per.append((1 + len(item), sys.getsizeof(item) + sum(sys.getsizeof(x) for x in item)))
        elif isinstance(item, dict):
            per.append((1 + 2 * len(item), sys.getsizeof(item)))
        else:
            per.append((1, sys.getsizeof(item)))
    if not per:
        return n, sys.getsizeof(value)
    count = sum(p[0] for p in per) / len(per)
    size = sum(p[1] for p in per) / len(per)
    return int(n * count), int(sys.getsizeof(value) + n * size)


def _wraps_data(value: Any) -> bool:
    """An attribute worth looking into: an object with attributes of its own that can be
    indexed (another dataset, a table of records)."""
    return hasattr(value, "__getitem__") and hasattr(value, "__len__") and hasattr(value, "__dict__")


def python_containers(dataset: Any, threshold: int = PYTHON_OBJECTS_TRAP) -> list[Container]:
    """Lists, tuples, dicts and object arrays of >= `threshold` Python objects among the
    dataset's attributes, and those of the datasets it wraps (`.dataset`, `.datasets`)."""
    found: list[Container] = []
    seen: set[int] = set()

    def walk(obj: Any, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        try:
            attributes = dict(vars(obj))
        except TypeError:
            attributes = {s: getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)}
        for name, value in attributes.items():
            where = f"{path}.{name}"
            is_objects = isinstance(value, np.ndarray) and value.dtype == object
            if isinstance(value, (list, tuple, dict)) or is_objects:
                if (value.size if is_objects else len(value)) >= threshold / 10:
                    objects, size = _count_objects(value)
                    if objects >= threshold:
                        kind = "object array" if is_objects else type(value).__name__
                        found.append(Container(where, kind, objects, size / MB))
                if name == "datasets" and isinstance(value, (list, tuple)):
                    for k, inner in enumerate(value[:64]):
                        walk(inner, f"{where}[{k}]", depth + 1)
            elif name == "dataset" or _wraps_data(value):
                walk(value, where, depth + 1)

    walk(dataset, "dataset", 0)
    return found


def global_rng_states() -> dict[str, Any]:
    """The states of Python's, numpy's and (if imported) torch's global RNGs."""
    states: dict[str, Any] = {"random": random.getstate(), "numpy": np.random.get_state()}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_rng_state"):
        states["torch"] = torch.get_rng_state()
    return states


def changed_rngs(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the global RNGs whose state differs."""
    changed = []
    if before["random"] != after["random"]:
        changed.append("random")
    b, a = before["numpy"], after["numpy"]
    if b[0] != a[0] or not np.array_equal(b[1], a[1]) or tuple(b[2:]) != tuple(a[2:]):
        changed.append("numpy.random")
    if "torch" in before and "torch" in after and not bool((before["torch"] == after["torch"]).all()):
        changed.append("torch")
    return changed


def restore_rngs(states: dict[str, Any]) -> None:
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch = sys.modules.get("torch")
    if "torch" in states and torch is not None:
        torch.set_rng_state(states["torch"])


def rngs_drawn_in_fetch(target: Target) -> list[str]:
    """Fetch a few items in this process and say which global RNGs they drew from (the
    states are put back afterwards)."""
    before = global_rng_states()
    try:
        _fetch_items(target, 0.5, 3)
        return changed_rngs(before, global_rng_states())
    finally:
        restore_rngs(before)


@dataclass
class Trap:
    name: str
    message: str


def find_traps(
    target: Target,
    rows: Sequence[Row],
    chosen: Row | None,
    profile: Profile | None,
    rngs: list[str],
    containers: list[Container],
    cpus: int,
) -> list[Trap]:
    """The traps, each with its evidence and its fix."""
    traps: list[Trap] = []
    method = target.start_method()
    if containers:
        listed = ", ".join(f"{c.path} ({c.type}, {c.objects:,} objects, ~{c.approx_mb:.1f} MB)" for c in containers)
        growth = [
            f"+{r.uss_growth_mb:.1f} MB at {r.config.num_workers} process(es)"
            for r in rows
            if r.config.kind == "processes" and r.uss_growth_mb is not None
        ]
        if method == "fork":
            evidence = (
                "each worker process writes the reference counts of the objects it touches, so under fork "
                "their pages are copied into every worker (copy-on-read); USS growth per worker during "
                "this run: "
                + ("; ".join(growth) if growth else "n/a")
                + " (it keeps growing until each worker has touched them all)"
            )
        else:
            evidence = f"under {method} each worker holds its own unpickled copy of them"
        traps.append(
            Trap(
                "python-objects",
                f"Python objects in the dataset: {listed}; {evidence}. Fix: hold them in "
                "stoker.SharedList(...) (one shared buffer, no per-object refcounts; str, bytes, int, "
                "float and tuples of them), or keep them in numpy arrays (labels as an int array, "
                "variable-length items as one flat array plus offsets).",
            )
        )
    if rngs and not target.seed_each_batch:
        traps.append(
            Trap(
                "global-rng",
                f"__getitem__ draws from the global RNG of {', '.join(rngs)} (its state changed when a "
                "sample was fetched here), so augmentations depend on which worker fetched a sample and "
                "change with num_workers. Fix: DataLoader(..., seed_each_batch=True), or draw from "
                "stoker.sample_rng() in __getitem__.",
            )
        )
    if chosen is not None and profile is not None and profile.batch_bytes and chosen.config.kind == "processes":
        try:
            stat = os.statvfs("/dev/shm")
            shm = stat.f_frsize * stat.f_blocks
        except OSError:
            shm = None
        flight = profile.batch_bytes * (chosen.config.prefetch_factor or 2) * chosen.config.num_workers
        if shm is not None and shm < flight:
            traps.append(
                Trap(
                    "dev-shm",
                    f"/dev/shm holds {shm / MB:.0f} MB but the recommended setting keeps {flight / MB:.0f} MB of "
                    f"batches in flight ({profile.batch_bytes / MB:.1f} MB x prefetch {chosen.config.prefetch_factor} "
                    f"x {chosen.config.num_workers} workers). stoker's arena uses memfd memory and is not limited "
                    "by it, but torch.utils.data and other loaders fail there with a bus error. Fix: a larger "
                    "/dev/shm (docker run --shm-size), or stoker.",
                )
            )
    torch = sys.modules.get("torch")
    cuda_up = False
    if torch is not None and hasattr(torch, "cuda"):
        try:
            cuda_up = bool(torch.cuda.is_initialized())
        except Exception:
            cuda_up = False
    if cuda_up and method == "fork":
        traps.append(
            Trap(
                "cuda-fork",
                "CUDA was initialised in this process before worker processes are forked (start method "
                "fork): a forked worker that touches CUDA fails or hangs. Fix: keep CUDA out of the dataset "
                "and the factory (move batches to the device in the training loop), or "
                "multiprocessing_context='forkserver' / 'spawn'.",
            )
        )
    if target.current is not None and target.current.num_workers > cpus:
        traps.append(
            Trap(
                "too-many-workers",
                f"your setting asks for num_workers={target.current.num_workers} but this process may use "
                f"{cpus} CPUs (os.sched_getaffinity): the workers compete for them. Fix: num_workers <= {cpus}.",
            )
        )
    return traps
