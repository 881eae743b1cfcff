"""`stoker doctor MODULE:FACTORY`: is the data loader the bottleneck, and how should it be set?

The factory returns a dataset or a DataLoader (stoker's, stoker.torch's or torch's). The
doctor measures, within a time budget planned up front:

    profile      dataset[i] in this process over a spread of indices, collate, batch bytes
    headroom     the rate of a "free" loader: a few cached batches replayed to a consumer
    sweep        num_workers 0..usable CPUs x processes/threads, then prefetch factors at
                 the best count: steady-state samples/s, time to first batch, and per
                 worker process USS/PSS (/proc/<pid>/smaps_rollup) after the first batch
                 and at the end of the run
    readiness    with --step-ms: the recommended configuration behind a consumer that
                 sleeps one model step per batch; the fraction of time it did not wait
    traps        Python object containers under fork, global RNGs drawn in __getitem__,
                 a small /dev/shm, CUDA initialised before fork, more workers than CPUs

Every configuration runs through stoker (`stoker.torch.DataLoader` for torch loaders and
torch tensors, `stoker.DataLoader` otherwise) with an endless copy of the user's sampler, so
that no epoch boundary lands inside a measuring window; each iterator is closed before the
next configuration starts, so no worker outlives its row. The parts are separate: loading
the target (`load_target`, `Target`), measuring (`profile_fetch`, `replay_rate`,
`measure_config`, `measure_readiness`), choosing (`choose`), the traps (`find_traps`) and
rendering (`render`, `plot`, `to_json`); `run` plans the budget and ties them together.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import importlib.util
import json
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._core import seeding
from .._core.loader import start_method_of, usable_cpus
from .._core.stats import array_bytes
from .._data.datasets import is_iterable_dataset

# ------------------------------------------------------------------------- constants
MIN_WINDOW_S = 0.3  # a steady-state window shorter than this measures noise
NEAR_BEST = 0.03  # a cheaper configuration within 3 % of the fastest is preferred
PYTHON_OBJECTS_TRAP = 10_000  # containers with at least this many Python objects are a trap
PROFILE_SAMPLES = 256  # at most this many dataset[i] calls in the main-process profile
REPLAY_BATCHES = 8  # cached batches the headroom replay cycles through
READINESS_TARGET = 0.95
REPEATS = 3  # windows planned for measuring the best rows again
CONTENDERS = 3  # how many of the fastest rows are measured again
MB = 1 << 20


class DoctorError(Exception):
    """A problem with the target (import, factory, returned object): one line, exit 2."""


class MeasureError(Exception):
    """The dataset failed while the doctor measured it (one line, naming the sample)."""


# ------------------------------------------------------------------------- the target
@dataclass(frozen=True)
class Config:
    """One loader configuration of the sweep."""

    num_workers: int
    thread_pool: bool = False
    prefetch_factor: int | None = None

    def __post_init__(self) -> None:
        if self.num_workers == 0:  # normalise: threads and prefetch mean nothing at 0 workers
            object.__setattr__(self, "thread_pool", False)
            object.__setattr__(self, "prefetch_factor", None)
        elif self.prefetch_factor is None:
            object.__setattr__(self, "prefetch_factor", 2)

    @property
    def kind(self) -> str:
        return "main" if self.num_workers == 0 else ("threads" if self.thread_pool else "processes")

    def cost(self) -> tuple[int, int, int]:
        """Sort key, cheapest first: fewer workers, threads before processes, smaller prefetch."""
        return (self.num_workers, 1 if self.kind == "processes" else 0, self.prefetch_factor or 0)

    def arguments(self) -> str:
        """The DataLoader arguments, as the recommend line prints them."""
        return (
            f"num_workers={self.num_workers}, thread_pool={self.thread_pool}, "
            f"prefetch_factor={self.prefetch_factor}"
        )


class _Endless:
    """Iterates the user's sampler (or batch sampler) again and again: a measuring window
    never meets an epoch's end. Its length is only there for code that asks."""

    def __init__(self, source: Iterable[Any]) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Any]:
        while True:
            empty = True
            for item in self.source:
                empty = False
                yield item
            if empty:
                return

    def __len__(self) -> int:
        return 1 << 40


@dataclass
class Target:
    """What the factory gave, reduced to what the sweep varies and what it keeps."""

    spec: str
    source: str  # "dataset", "stoker.DataLoader", "stoker.torch.DataLoader", "torch.utils.data.DataLoader"
    dataset: Any
    iterable: bool
    flavour: str  # "numpy" (stoker.DataLoader) or "torch" (stoker.torch.DataLoader)
    batch_size: int | None
    sampler: Any = None
    batch_sampler: Any = None  # a user's batch sampler (then batch_size is None)
    collate_fn: Callable[[Any], Any] | None = None  # None: the flavour's default
    drop_last: bool = False
    worker_init_fn: Callable[[int], None] | None = None
    multiprocessing_context: Any = None
    seed_each_batch: bool = False
    in_order: bool = True
    current: Config | None = None  # the user's setting, when a loader was given
    auto: str | None = None  # the user's loader chooses its setting itself ("auto"): what it was given

    @property
    def shuffle(self) -> bool:
        return type(self.sampler).__name__ == "RandomSampler"

    def loader_class(self) -> Any:
        if self.flavour == "torch":
            from .. import torch as stoker_torch

            return stoker_torch.DataLoader
        from .. import DataLoader

        return DataLoader

    def make_loader(self, config: Config) -> Any:
        """A fresh stoker loader of this target in `config`, endless for map-style data."""
        kwargs: dict[str, Any] = {
            "num_workers": config.num_workers,
            "collate_fn": self.collate_fn,
            "worker_init_fn": self.worker_init_fn,
            "in_order": self.in_order,
            "seed_each_batch": self.seed_each_batch,
        }
        if config.num_workers:
            kwargs.update(prefetch_factor=config.prefetch_factor, thread_pool=config.thread_pool)
        if config.kind == "processes":  # a loader refuses a start method it would not use
            kwargs.update(multiprocessing_context=self.multiprocessing_context)
        if self.iterable:
            kwargs.update(batch_size=self.batch_size, drop_last=self.drop_last)
        elif self.batch_sampler is not None:
            kwargs.update(batch_sampler=_Endless(self.batch_sampler))
        else:
            sampler = self.sampler if self.sampler is not None else range(len(self.dataset))
            kwargs.update(batch_size=self.batch_size, drop_last=self.drop_last, sampler=_Endless(sampler))
        with warnings.catch_warnings():  # "more workers than CPUs" is reported as a trap
            warnings.simplefilter("ignore")
            return self.loader_class()(self.dataset, **kwargs)

    def start_method(self) -> str:
        return start_method_of(self.multiprocessing_context)


def _import(module_part: str) -> Any:
    """The module named by a dotted name (the current directory on sys.path, as `python -m`
    has it) or by a path to a .py file (its directory on sys.path, so that spawn workers
    can import it again by its name)."""
    if module_part.endswith(".py") or os.sep in module_part:
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise DoctorError(f"cannot import {module_part}: no such file")
        name = os.path.splitext(os.path.basename(path))[0]
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise DoctorError(f"cannot import {module_part}: not a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(module_part)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def load_target(spec: str) -> Any:
    """Import MODULE, call FACTORY and return what it made. Raises DoctorError (one line)."""
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        raise DoctorError(f"expected MODULE:FACTORY (e.g. examples/image_pipeline.py:make_loader), got {spec!r}")
    try:
        module = _import(module_part)
    except DoctorError:
        raise
    except ImportError as exc:
        raise DoctorError(f"cannot import {module_part}: {_first_line(exc)}") from None
    except BaseException as exc:  # the module's own code failed (SystemExit too)
        raise DoctorError(f"cannot import {module_part}: {type(exc).__name__}: {_first_line(exc)}") from None
    if not hasattr(module, name):
        raise DoctorError(f"{spec}: module {module_part} has no attribute {name!r}")
    factory = getattr(module, name)
    if _kind_of(factory) is not None and not isinstance(factory, type):
        return factory  # a dataset or loader object itself: take it as it is
    if not callable(factory):
        raise DoctorError(f"{spec}: {name} is a {type(factory).__name__}, not a callable factory")
    try:
        made = factory()
    except BaseException as exc:
        raise DoctorError(f"{spec} raised {type(exc).__name__}: {_first_line(exc)}") from None
    if _kind_of(made) is None:
        raise DoctorError(
            f"{spec} returned {type(made).__name__} ({made!r:.40}), which is neither a map-style "
            "dataset (__getitem__ and __len__), an IterableDataset nor a DataLoader"
        )
    return made


def _kind_of(obj: Any) -> str | None:
    """'loader', 'torch-loader', 'iterable', 'map' or None."""
    from .._core.loader import DataLoader

    if isinstance(obj, type):
        return None
    if isinstance(obj, DataLoader):
        return "loader"
    torch_data = sys.modules.get("torch.utils.data")
    if torch_data is not None and isinstance(obj, torch_data.DataLoader):
        return "torch-loader"
    if is_iterable_dataset(obj):
        return "iterable"
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__"):
        return "map"
    return None


def _default_collates() -> set[int]:
    """ids of the collate functions that a loader picks itself (given back to it as None)."""
    from .._data import collate

    ids = {id(collate.default_collate), id(collate.default_convert)}
    torch_data = sys.modules.get("torch.utils.data")
    if torch_data is not None:
        from .._data import torch_collate

        ids |= {id(torch_collate.default_collate), id(torch_collate.default_convert)}
        ids |= {id(torch_data.default_collate), id(torch_data.default_convert)}
    return ids


def _has_tensors(sample: Any, depth: int = 0) -> bool:
    if type(sample).__module__.startswith("torch") and hasattr(sample, "element_size"):
        return True
    if depth > 4:
        return False
    if isinstance(sample, dict):
        return any(_has_tensors(v, depth + 1) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return any(_has_tensors(v, depth + 1) for v in sample[:16])
    return False


def describe_target(spec: str, obj: Any, batch_size: int) -> Target:
    """The Target for what the factory returned; a bare dataset gets `batch_size`."""
    kind = _kind_of(obj)
    if kind in ("map", "iterable"):
        flavour = "numpy"
        if "torch" in sys.modules and kind == "map" and len(obj):
            scope = seeding.enter(seeding.FetchScope(base_seed=0, epoch=0, tag=seeding.SAMPLE))
            try:
                if _has_tensors(obj[0]):
                    flavour = "torch"
            except Exception:
                pass  # the profile fetches again and reports the error
            finally:
                seeding.leave(scope)
        return Target(spec, "dataset", obj, kind == "iterable", flavour, batch_size)
    defaults = _default_collates()
    collate_fn = None if id(obj.collate_fn) in defaults else obj.collate_fn
    if kind == "loader":
        flavour = getattr(type(obj), "_flavour", "numpy")
        source = "stoker.torch.DataLoader" if flavour == "torch" else "stoker.DataLoader"
    else:
        flavour, source = "torch", "torch.utils.data.DataLoader"
    # num_workers="auto" or prefetch_factor="auto": the loader chooses at iter(), so there is
    # no fixed setting to measure as the current one
    current = None
    workers, prefetch = obj.num_workers, obj.prefetch_factor
    if isinstance(workers, int) and (workers == 0 or isinstance(prefetch, int)):
        current = Config(workers, bool(getattr(obj, "thread_pool", False)), prefetch if workers else None)
    dataset = obj.dataset
    iterable = is_iterable_dataset(dataset)
    user_batches = obj.batch_size is None and obj.batch_sampler is not None
    return Target(
        spec,
        source,
        dataset,
        iterable,
        flavour,
        None if user_batches else obj.batch_size,
        sampler=None if iterable else obj.sampler,
        batch_sampler=obj.batch_sampler if user_batches else None,
        collate_fn=collate_fn,
        drop_last=bool(obj.drop_last),
        worker_init_fn=obj.worker_init_fn,
        multiprocessing_context=obj.multiprocessing_context,
        seed_each_batch=bool(getattr(obj, "seed_each_batch", False)),
        in_order=bool(getattr(obj, "in_order", True)),
        current=current,
        auto=None if current is not None else f"num_workers={workers!r}, prefetch_factor={prefetch!r}",
    )


# ------------------------------------------------------------------------- batches
def touch(batch: Any) -> int:
    """Walk a batch as a consumer does before using it: read every leaf's shape. Returns
    the number of leaves."""
    if isinstance(batch, dict):
        return sum(touch(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(touch(v) for v in batch)
    getattr(batch, "shape", None)
    return 1


def batch_len(batch: Any, default: int) -> int:
    """Samples in a batch: the leading dimension of its first array leaf, else `default`."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else default
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and batch:
        if all(not hasattr(v, "shape") and not isinstance(v, (list, tuple, dict)) for v in batch):
            return len(batch)
        return batch_len(batch[0], default)
    return default


# ------------------------------------------------------------------------- profile
@dataclass
class Profile:
    """Per-sample fetch time in this process, collate time and bytes per batch."""

    samples: int
    fetch_median_ms: float
    fetch_p90_ms: float
    fetch_p10_ms: float
    fetch_max_ms: float
    collate_ms: float | None
    batch_bytes: int | None
    batch_size: int
    batches: list[Any] = field(default_factory=list, repr=False)  # for the headroom replay

    @property
    def spread(self) -> float:
        return self.fetch_p90_ms / self.fetch_median_ms if self.fetch_median_ms > 0 else 1.0

    def one_process_rate(self) -> float | None:
        """Samples/s one process could make alone (fetch + collate), by these figures."""
        per_batch_ms = self.fetch_median_ms * self.batch_size + (self.collate_ms or 0.0)
        return self.batch_size * 1000 / per_batch_ms if per_batch_ms > 0 else None


def _spread_indices(n: int, count: int) -> list[int]:
    """Up to `count` indices spread over range(n), in a shuffled order (a fixed seed)."""
    if n <= 0:
        return []
    picked = np.unique(np.linspace(0, n - 1, min(n, count)).astype(np.int64))
    return [int(i) for i in np.random.default_rng(0).permutation(picked)]


def _fetch_items(target: Target, time_s: float, count: int) -> tuple[list[Any], list[float]]:
    """Fetch up to `count` samples in this process, as a loader's fetcher would (inside a
    fetch scope, so stoker.sample_rng() works); stops after `time_s` (at least one)."""
    samples: list[Any] = []
    times: list[float] = []
    end = time.perf_counter() + time_s
    scope = seeding.FetchScope(base_seed=0, epoch=0, tag=seeding.SAMPLE)
    previous = seeding.enter(scope)
    try:
        if target.iterable:
            scope.at(seeding.ITEM, (0,))
            stream = iter(target.dataset)
            for k in range(count):
                scope.at(seeding.ITEM, (0, k))
                start = time.perf_counter()
                try:
                    item = next(stream)
                except StopIteration:
                    break
                except Exception as exc:
                    what = f"{type(exc).__name__}: {_first_line(exc)}"
                    raise MeasureError(f"item {k} of iter(dataset) raised {what}") from exc
                times.append(time.perf_counter() - start)
                samples.append(item)
                if time.perf_counter() > end:
                    break
        else:
            for i in _spread_indices(len(target.dataset), count):
                scope.at(seeding.SAMPLE, i)
                start = time.perf_counter()
                try:
                    item = target.dataset[i]
                except Exception as exc:
                    raise MeasureError(f"dataset[{i}] raised {type(exc).__name__}: {_first_line(exc)}") from exc
                times.append(time.perf_counter() - start)
                samples.append(item)
                if time.perf_counter() > end:
                    break
    finally:
        seeding.leave(previous)
    return samples, times


def profile_fetch(target: Target, collate_fn: Callable[[Any], Any], time_s: float) -> Profile:
    """Time dataset[i] on a spread of indices, then collate a few batches from those samples
    (reused cyclically when fewer than a batch were fetched in time)."""
    samples, times = _fetch_items(target, time_s * 0.7, PROFILE_SAMPLES)
    if not samples:
        raise RuntimeError("the dataset gave no sample")
    ms = np.array(times) * 1000
    size = target.batch_size or 1
    if target.batch_sampler is not None:  # a user's batch sampler: its first batch's size
        size = len(next(iter(target.batch_sampler), [None]))
    batches: list[Any] = []
    collate_times: list[float] = []
    end = time.perf_counter() + max(time_s * 0.3, 0.05)
    scope = seeding.FetchScope(base_seed=0, epoch=0, tag=seeding.BATCH)
    previous = seeding.enter(scope)
    try:
        for b in range(REPLAY_BATCHES):
            group = [samples[(b * size + j) % len(samples)] for j in range(size)]
            scope.at(seeding.BATCH, b)
            start = time.perf_counter()
            batches.append(collate_fn(group))
            collate_times.append(time.perf_counter() - start)
            if time.perf_counter() > end:
                break
    finally:
        seeding.leave(previous)
    return Profile(
        samples=len(samples),
        fetch_median_ms=float(np.median(ms)),
        fetch_p90_ms=float(np.percentile(ms, 90)),
        fetch_p10_ms=float(np.percentile(ms, 10)),
        fetch_max_ms=float(ms.max()),
        collate_ms=float(np.median(collate_times)) * 1000 if collate_times else None,
        batch_bytes=array_bytes(batches[0]) if batches else None,
        batch_size=size,
        batches=batches,
    )


def replay_rate(batches: Sequence[Any], batch_size: int, time_s: float) -> float | None:
    """Samples/s of a free loader: cached batches handed to a consumer that touches each
    (the loop's own cost), for about `time_s`."""
    if not batches:
        return None
    count = 0
    start = time.perf_counter()
    end = start + time_s
    while True:
        for batch in batches:
            touch(batch)
        count += len(batches)
        now = time.perf_counter()
        if now >= end:
            return count * batch_size / (now - start)


# ------------------------------------------------------------------------- processes
def _children(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    if not tasks:
        try:
            import psutil

            return {p.pid for p in psutil.Process(pid).children()}
        except Exception:
            return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return found


def descendants(pid: int | None = None) -> set[int]:
    """All processes below `pid` (this process by default)."""
    todo = [os.getpid() if pid is None else pid]
    seen: set[int] = set()
    while todo:
        for child in _children(todo.pop()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


SHARED_MAPPINGS = ("/memfd:", "/dev/shm/", "/dev/zero", "/SYSV")  # batch transport, not the worker's own


def _shared_part(pid: int) -> tuple[int, int]:
    """(private, PSS) bytes of the process's shared-memory mappings (memfd, /dev/shm): the
    loader's batch slots, which a worker writes and the main process reads; (0, 0) when
    /proc/<pid>/smaps cannot be read."""
    private = pss = 0
    shared = False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if not head[0].endswith(":"):  # a mapping's first line: address perms offset dev inode [name]
                    shared = len(head) > 5 and head[5].startswith(SHARED_MAPPINGS)
                elif shared and head[0] in ("Private_Clean:", "Private_Dirty:"):
                    private += int(head[1]) * 1024
                elif shared and head[0] == "Pss:":
                    pss += int(head[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return private, pss


def smaps_memory(pid: int) -> tuple[int, int] | None:
    """(USS, PSS) of a process in bytes from /proc/<pid>/smaps_rollup, less its
    shared-memory batch slots (see `_shared_part`); None if unreadable."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                    fields[parts[0][:-1]] = int(parts[1]) * 1024
    except OSError:
        return None
    if "Pss" not in fields:
        return None
    private, pss = _shared_part(pid)
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0) - private
    return max(uss, 0), max(fields["Pss"] - pss, 0)


def _mean_memory(pids: Iterable[int]) -> tuple[float, float] | None:
    """Mean (USS, PSS) in MB over these processes; None if none could be read."""
    readings = [m for m in (smaps_memory(p) for p in pids) if m is not None]
    if not readings:
        return None
    return (
        sum(r[0] for r in readings) / len(readings) / MB,
        sum(r[1] for r in readings) / len(readings) / MB,
    )


def _start_helpers(method: str) -> None:
    """Start multiprocessing's helper processes (forkserver, resource tracker) before the
    sweep, so that they are not mistaken for a configuration's workers."""
    if method == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
    if method in ("spawn", "forkserver"):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()


# ------------------------------------------------------------------------- measuring
@dataclass
class Row:
    """One configuration's figures (None where not measured)."""

    config: Config
    samples_per_s: float | None = None
    first_batch_s: float | None = None
    batches: int = 0
    window_s: float = 0.0
    close_s: float | None = None
    workers_seen: int = 0
    uss_first_mb: float | None = None
    pss_first_mb: float | None = None
    uss_end_mb: float | None = None
    pss_end_mb: float | None = None
    current: bool = False
    note: str = ""
    rates: list[float] = field(default_factory=list)  # one per measurement; samples_per_s is their median
    restarted: bool = False  # new workers during the window (an iterable's epochs): no growth figure

    def merge(self, again: Row) -> None:
        """Count another measurement of the same configuration (a repeat on a noisy machine)."""
        if again.samples_per_s:
            self.rates.append(again.samples_per_s)
            self.samples_per_s = float(np.median(self.rates))
            self.batches += again.batches
            self.window_s += again.window_s

    @property
    def uss_growth_mb(self) -> float | None:
        if self.uss_first_mb is None or self.uss_end_mb is None or self.restarted:
            return None
        return self.uss_end_mb - self.uss_first_mb


def steady_rate(arrivals: Sequence[float], sizes: Sequence[int], skip: int) -> float | None:
    """Samples/s between batch `skip` and the last one. `arrivals[i]`: when batch i arrived
    (s, any origin); `sizes[i]`: its samples. The first batches are start-up (every worker
    began at once, the arena's slots are still being made), so the window starts at batch
    `skip`, or at a third of the batches when there are few. None with fewer than two."""
    last = len(arrivals) - 1
    if last < 1:
        return None
    start = min(skip, last // 3)
    span = arrivals[last] - arrivals[start]
    if span <= 0:
        return None
    return sum(sizes[start + 1 : last + 1]) / span


def measure_config(target: Target, config: Config, window_s: float) -> Row:
    """Run one configuration: time to its first batch, then a steady window of `window_s`
    with a consumer that touches each batch; worker memory after the first batch and at
    the end. The iterator is closed (workers joined) before this returns."""
    row = Row(config)
    default_size = target.batch_size or 1
    loader = target.make_loader(config)
    before = descendants()
    start = time.perf_counter()
    iterator = iter(loader)
    try:
        arrivals: list[float] = []
        sizes: list[int] = []
        try:
            batch = next(iterator)
        except StopIteration:
            row.note = "the dataset gave no batch"
            return row
        now = time.perf_counter()
        row.first_batch_s = now - start
        arrivals.append(now)
        sizes.append(batch_len(batch, default_size))
        touch(batch)
        del batch
        workers: set[int] = set()
        if config.kind == "processes":
            workers = descendants() - before
            row.workers_seen = len(workers)
            memory = _mean_memory(workers)
            if memory is not None:
                row.uss_first_mb, row.pss_first_mb = memory
        end = time.perf_counter() + window_s
        restarts = 0
        while time.perf_counter() < end:
            try:
                batch = next(iterator)
            except StopIteration:  # an iterable dataset's epoch ended: begin the next
                iterator.close()
                iterator = iter(loader)
                restarts += 1
                if workers:
                    workers = descendants() - before
                continue
            arrivals.append(time.perf_counter())
            sizes.append(batch_len(batch, default_size))
            touch(batch)
            del batch
        if workers:
            memory = _mean_memory(workers)
            if memory is not None:
                row.uss_end_mb, row.pss_end_mb = memory
        row.batches = len(arrivals)
        row.window_s = arrivals[-1] - arrivals[0]
        rate = steady_rate(arrivals, sizes, config.num_workers * (config.prefetch_factor or 1))
        if rate is None:  # a single batch in the window: count from iter()
            rate = sum(sizes) / (arrivals[-1] - start)
            row.note = "one batch only: rate includes start-up"
        if restarts:
            row.note = f"{restarts} epoch restart(s) inside the window, start-ups included"
            row.restarted = True
        row.samples_per_s = rate
        row.rates = [rate]
    finally:
        closing = time.perf_counter()
        iterator.close()
        del iterator, loader
        gc.collect()
        row.close_s = time.perf_counter() - closing
    return row


@dataclass
class Readiness:
    """How well the recommended configuration keeps a model of --step-ms fed."""

    step_ms: float
    needed_per_s: float
    expected: float
    workers_needed: int | None
    workers_needed_how: str
    recommended_expected: float | None = None
    measured: float | None = None
    measured_window_s: float | None = None
    wait_ms_per_batch: float | None = None
    config: Config | None = None


def measure_readiness(target: Target, config: Config, step_ms: float, window_s: float) -> tuple[float, float, float]:
    """Run `config` behind a consumer that sleeps `step_ms` per batch (a model step on an
    accelerator) for `window_s`, after a warm-up of num_workers + 1 batches (start-up is
    reported as the time to the first batch). Returns (readiness: the fraction of the time
    not spent waiting inside next(), the window, wait in ms per batch)."""
    loader = target.make_loader(config)
    iterator = iter(loader)
    try:
        for _ in range(config.num_workers + 2):
            touch(next(iterator))
            time.sleep(step_ms / 1000)
        waited = 0.0
        batches = 0
        start = time.perf_counter()
        end = start + window_s
        while time.perf_counter() < end:
            asked = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                iterator.close()
                iterator = iter(loader)
                continue
            waited += time.perf_counter() - asked
            batches += 1
            touch(batch)
            del batch
            time.sleep(step_ms / 1000)
        total = time.perf_counter() - start
    finally:
        iterator.close()
        del iterator, loader
        gc.collect()
    return 1 - waited / total, total, waited * 1000 / max(batches, 1)


def loop_rate(row: Row, step_ms: float | None, batch_size: int) -> float | None:
    """Samples/s a training loop gets from this row. Without a model step, the measured rate.
    With one, num_workers=0 loads in the loop's own thread, so each batch costs its loading
    time plus the step; worker threads and processes overlap the step, so their measured
    rate stands (the ranking is by what they can deliver)."""
    rate = row.samples_per_s
    if not rate or not step_ms or row.config.num_workers:
        return rate
    return batch_size / (batch_size / rate + step_ms / 1000)


def row_readiness(row: Row, step_ms: float, batch_size: int) -> float | None:
    """Expected fraction of the time a model of `step_ms` per batch does not wait for this
    row: min(1, rate / needed) for workers; step / (step + loading) for num_workers=0."""
    rate = row.samples_per_s
    if not rate:
        return None
    if row.config.num_workers == 0:
        load_ms = batch_size * 1000 / rate
        return step_ms / (step_ms + load_ms)
    return min(1.0, rate / (batch_size * 1000 / step_ms))


def expected_readiness(rows: Sequence[Row], batch_size: int, step_ms: float, cpus: int) -> Readiness:
    """Readiness of the best loader behind a model that takes `step_ms` per batch (min(1,
    best rate / needed rate)), and how many workers give READINESS_TARGET: the cheapest
    measured row that reaches it, else a linear extrapolation from one process worker."""
    needed = batch_size * 1000 / step_ms
    measured = sorted((r for r in rows if r.samples_per_s), key=lambda r: r.config.cost())
    best = max((loop_rate(r, step_ms, batch_size) or 0.0 for r in measured), default=0.0)
    expected = min(1.0, best / needed)
    for row in measured:
        if (row_readiness(row, step_ms, batch_size) or 0.0) >= READINESS_TARGET:
            return Readiness(step_ms, needed, expected, row.config.num_workers, f"measured: {row.config.arguments()}")
    one = [r for r in measured if r.config.num_workers == 1 and r.config.kind == "processes"]
    if one and one[0].samples_per_s:
        workers = math.ceil(READINESS_TARGET * needed / one[0].samples_per_s)
        how = f"extrapolated linearly from 1 process worker's {_rate(one[0].samples_per_s)} samples/s"
        if workers > cpus:
            how += f"; more than the {cpus} usable CPUs of this machine"
        return Readiness(step_ms, needed, expected, workers, how)
    return Readiness(step_ms, needed, expected, None, "cannot be estimated (no 1-worker figure)")


# ------------------------------------------------------------------------- choosing
def choose(
    rows: Sequence[Row], tolerance: float = NEAR_BEST, step_ms: float | None = None, batch_size: int = 1
) -> Row | None:
    """The fastest measured row, or the cheapest (fewer workers, threads over processes,
    smaller prefetch) among those within `tolerance` of it; rates as `loop_rate` counts them."""
    scored = [(r, loop_rate(r, step_ms, batch_size) or 0.0) for r in rows if r.samples_per_s]
    if not scored:
        return None
    best = max(rate for _, rate in scored)
    near = [r for r, rate in scored if rate >= (1 - tolerance) * best]
    return min(near, key=lambda r: r.config.cost())


def worker_counts(cpus: int) -> list[int]:
    """0..cpus, or 0, 1, 2, 4, 8, ... and cpus itself on larger machines."""
    if cpus <= 8:
        return list(range(cpus + 1))
    counts = [0, 1]
    while counts[-1] * 2 < cpus:
        counts.append(counts[-1] * 2)
    return [*counts, cpus]


def first_configs(target: Target, cpus: int) -> tuple[list[Config], list[str]]:
    """The worker-count sweep (processes, then threads) and the user's own setting if it is
    not among them; with notes on what is left out and why."""
    notes: list[str] = []
    counts = worker_counts(cpus)
    configs = [Config(n) for n in counts]
    if target.iterable:
        notes.append("iterable dataset: num_workers varied with processes only (each replica's stream as it is)")
    elif target.seed_each_batch:
        notes.append("thread workers not tried: the loader uses seed_each_batch=True, which thread_pool refuses")
    else:
        configs += [Config(n, thread_pool=True) for n in counts if n]
    if target.current is not None and target.current not in configs:
        configs.append(target.current)
    if target.auto is not None:
        notes.append(f"your loader has {target.auto}: it chooses at iter(), so no row is your current setting")
    return configs, notes


def prefetch_configs(best: Config, tried: Iterable[Config]) -> list[Config]:
    """Prefetch factors 2, 4, 8 at the best worker count and kind (none at 0 workers)."""
    if best.num_workers == 0:
        return []
    seen = set(tried)
    configs = [Config(best.num_workers, best.thread_pool, p) for p in (2, 4, 8)]
    return [c for c in configs if c not in seen]


# ------------------------------------------------------------------------- traps
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
                "this run: " + ("; ".join(growth) if growth else "n/a")
                + " (it keeps growing until each worker has touched them all)"
            )
        else:
            evidence = f"under {method} each worker holds its own unpickled copy of them"
        traps.append(Trap(
            "python-objects",
            f"Python objects in the dataset: {listed}; {evidence}. Fix: hold them in "
            "stoker.SharedList(...) (one shared buffer, no per-object refcounts; str, bytes, int, "
            "float and tuples of them), or keep them in numpy arrays (labels as an int array, "
            "variable-length items as one flat array plus offsets).",
        ))
    if rngs and not target.seed_each_batch:
        traps.append(Trap(
            "global-rng",
            f"__getitem__ draws from the global RNG of {', '.join(rngs)} (its state changed when a "
            "sample was fetched here), so augmentations depend on which worker fetched a sample and "
            "change with num_workers. Fix: DataLoader(..., seed_each_batch=True), or draw from "
            "stoker.sample_rng() in __getitem__.",
        ))
    if chosen is not None and profile is not None and profile.batch_bytes and chosen.config.kind == "processes":
        try:
            stat = os.statvfs("/dev/shm")
            shm = stat.f_frsize * stat.f_blocks
        except OSError:
            shm = None
        flight = profile.batch_bytes * (chosen.config.prefetch_factor or 2) * chosen.config.num_workers
        if shm is not None and shm < flight:
            traps.append(Trap(
                "dev-shm",
                f"/dev/shm holds {shm / MB:.0f} MB but the recommended setting keeps {flight / MB:.0f} MB of "
                f"batches in flight ({profile.batch_bytes / MB:.1f} MB x prefetch {chosen.config.prefetch_factor} "
                f"x {chosen.config.num_workers} workers). stoker's arena uses memfd memory and is not limited "
                "by it, but torch.utils.data and other loaders fail there with a bus error. Fix: a larger "
                "/dev/shm (docker run --shm-size), or stoker.",
            ))
    torch = sys.modules.get("torch")
    cuda_up = False
    if torch is not None and hasattr(torch, "cuda"):
        try:
            cuda_up = bool(torch.cuda.is_initialized())
        except Exception:
            cuda_up = False
    if cuda_up and method == "fork":
        traps.append(Trap(
            "cuda-fork",
            "CUDA was initialised in this process before worker processes are forked (start method "
            "fork): a forked worker that touches CUDA fails or hangs. Fix: keep CUDA out of the dataset "
            "and the factory (move batches to the device in the training loop), or "
            "multiprocessing_context='forkserver' / 'spawn'.",
        ))
    if target.current is not None and target.current.num_workers > cpus:
        traps.append(Trap(
            "too-many-workers",
            f"your setting asks for num_workers={target.current.num_workers} but this process may use "
            f"{cpus} CPUs (os.sched_getaffinity): the workers compete for them. Fix: num_workers <= {cpus}.",
        ))
    return traps


# ------------------------------------------------------------------------- the run
@dataclass
class Report:
    """Everything the doctor found; `to_json` writes it."""

    spec: str
    source: str
    measured_with: str
    dataset: str
    dataset_len: int | None
    batch_size: int
    shuffle: bool
    cpus: int
    start_method: str
    budget_s: float
    current: Config | None
    step_ms: float | None = None
    profile: Profile | None = None
    rows: list[Row] = field(default_factory=list)
    recommended: Row | None = None
    free_rate: float | None = None
    readiness: Readiness | None = None
    traps: list[Trap] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    containers: list[Container] = field(default_factory=list)
    load_average: tuple[float | None, float | None] = (None, None)  # 1-minute, before and after the run
    elapsed_s: float = 0.0

    def best(self) -> Row | None:
        measured = [r for r in self.rows if r.samples_per_s]
        return max(measured, key=lambda r: r.samples_per_s or 0.0) if measured else None

    def row(self, config: Config | None) -> Row | None:
        for r in self.rows:
            if config is not None and r.config == config and r.samples_per_s:
                return r
        return None


def _load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _say(message: str) -> None:
    print(f"doctor: {message}", file=sys.stderr, flush=True)


class _Sweep:
    """Runs configurations into a report's rows until `end` (perf_counter seconds), sizing
    each window from the time left and what is still to come."""

    def __init__(self, target: Target, report: Report, end: float) -> None:
        self.target = target
        self.report = report
        self.end = end
        # seconds a configuration costs besides its window (start-up, first batch, close),
        # per worker-weight: a first guess (spawn and forkserver workers import the user's
        # modules again), then what was measured
        spawned = report.start_method != "fork"
        self.overhead = {"main": 0.05, "threads": 0.1, "processes": 1.5 if spawned else 0.3}

    def cost_s(self, config: Config) -> float:
        return self.overhead[config.kind] * (1 + 0.2 * config.num_workers)

    def fits(self, config: Config) -> bool:
        return self.end - time.perf_counter() >= self.cost_s(config) + MIN_WINDOW_S

    def measure(self, config: Config, still_to_come: int) -> Row | None:
        """Measure `config` in a window of its share of the time left (`still_to_come`:
        configurations after it); None, with a note, when it does not fit."""
        label = f"num_workers={config.num_workers} {config.kind}" + (
            f" prefetch_factor={config.prefetch_factor}" if config.num_workers else ""
        )
        if not self.fits(config) and self.report.rows:  # the first one runs anyway: a table of none says nothing
            needs = self.cost_s(config) + MIN_WINDOW_S
            self.report.notes.append(f"skipped {label}: no time left in the budget (needs ~{needs:.1f} s)")
            _say(f"{label}: skipped, no time left")
            return None
        left = self.end - time.perf_counter()
        window = max(left / (1 + still_to_come) - self.cost_s(config), MIN_WINDOW_S)
        row = measure_config(self.target, config, window)
        row.current = config == self.target.current
        spent = (row.first_batch_s or 0.0) + (row.close_s or 0.0)
        weight = 1 + 0.2 * config.num_workers
        self.overhead[config.kind] = max(self.overhead[config.kind] * 0.5, spent / weight)
        _say(
            f"{label}: {_rate(row.samples_per_s)} samples/s, first batch {_seconds(row.first_batch_s)}"
            + (f", USS {row.uss_first_mb:.0f} MB/worker" if row.uss_first_mb is not None else "")
        )
        return row

    def run(self, configs: Sequence[Config], later: int = 0) -> None:
        """Measure each configuration once, as new rows (`later`: how many will follow)."""
        for k, config in enumerate(configs):
            row = self.measure(config, len(configs) - k - 1 + later)
            if row is not None:
                self.report.rows.append(row)

    def repeat(self, step_ms: float | None) -> None:
        """With the time left, measure the CONTENDERS fastest rows again, in turn (fewest
        runs first), and keep each one's median: one window is noisy on a busy machine, and
        a lucky one should not decide alone."""
        while True:
            scored = [(r, loop_rate(r, step_ms, self.report.batch_size) or 0.0) for r in self.report.rows]
            top = [r for r, rate in sorted(scored, key=lambda x: -x[1])[:CONTENDERS] if rate > 0]
            contenders = sorted(top, key=lambda r: (len(r.rates), r.config.cost()))
            if len(contenders) < 2 or not self.fits(contenders[0].config):
                return
            row = contenders[0]
            again = self.measure(row.config, len(contenders) - 1)
            if again is None:
                return
            row.merge(again)


def run(
    target: Target,
    seconds: float,
    step_ms: float | None = None,
    started: float | None = None,
    reserve_s: float = 0.3,
    cpus: int | None = None,
) -> Report:
    """Measure `target` within `seconds` (counted from `started`, default now); `reserve_s`
    is kept back for what follows (rendering, a chart)."""
    started = time.perf_counter() if started is None else started
    deadline = started + seconds
    cpus = cpus or usable_cpus() or 1
    method = target.start_method()
    flavour = "stoker.torch.DataLoader" if target.flavour == "torch" else "stoker.DataLoader"
    try:
        length: int | None = len(target.dataset)
    except TypeError:
        length = None
    report = Report(
        target.spec, target.source, flavour, type(target.dataset).__name__, length, target.batch_size or 1,
        target.shuffle, cpus, method, seconds, target.current, step_ms=step_ms,
    )
    # The budget, planned up front: the profile ~6 %, the headroom ~2 %, the readiness run
    # ~12 % (with --step-ms), a little for closing down; the sweep has the rest.
    profile_s = min(max(0.06 * seconds, 0.2), 3.0)
    replay_s = min(max(0.02 * seconds, 0.1), 0.5)
    readiness_s = min(max(0.12 * seconds, 1.0), 8.0) if step_ms else 0.0
    teardown_s = reserve_s + 0.02 * seconds

    busy = _load_average()
    loading_s = time.perf_counter() - started
    if loading_s > 0.25 * seconds:
        report.notes.append(
            f"importing the module and calling the factory took {loading_s:.1f} s of the {seconds:g} s budget"
        )
    rngs = rngs_drawn_in_fetch(target)
    report.containers = python_containers(target.dataset)
    _say(f"profiling dataset[i] in this process (~{profile_s:.1f} s)")
    report.profile = profile_fetch(target, target.make_loader(Config(0)).collate_fn, profile_s)
    report.batch_size = report.profile.batch_size
    report.free_rate = replay_rate(report.profile.batches, report.batch_size, replay_s)
    report.profile.batches = []

    _start_helpers(method)
    configs, notes = first_configs(target, cpus)
    report.notes.extend(notes)
    sweep = _Sweep(target, report, deadline - teardown_s - (readiness_s + 0.3 if step_ms else 0.0))
    # after the worker sweep: prefetch factors at the best count, then repeats of the rows
    # within 10 % of the best (one window is noisy on a busy machine)
    later = (0 if target.iterable else 2) + REPEATS
    each = (sweep.end - time.perf_counter()) / (len(configs) + later)
    _say(
        f"budget {seconds:g} s: {len(configs)} configurations, then prefetch factors and repeats of the "
        f"best, ~{each:.1f} s each" + (f"; readiness run ~{readiness_s:.1f} s" if step_ms else "")
    )
    sweep.run(configs, later=later)
    first = choose(report.rows, step_ms=step_ms, batch_size=report.batch_size)
    if first is not None and not target.iterable:
        sweep.run(prefetch_configs(first.config, [r.config for r in report.rows]), later=REPEATS)
    sweep.repeat(step_ms)
    report.recommended = chosen = choose(report.rows, step_ms=step_ms, batch_size=report.batch_size)

    if step_ms and chosen is not None:
        report.readiness = readiness = expected_readiness(report.rows, report.batch_size, step_ms, cpus)
        readiness.recommended_expected = row_readiness(chosen, step_ms, report.batch_size)
        left = deadline - teardown_s - time.perf_counter() - sweep.cost_s(chosen.config)
        # the sweep may have overrun on a busy machine: a short window still answers, unless
        # the run is already well past its budget
        if left >= -0.1 * seconds:
            window = min(readiness_s, max(left, 0.5))
            _say(f"readiness: the recommended configuration behind a {step_ms:g} ms step for {window:.1f} s")
            readiness.measured, readiness.measured_window_s, readiness.wait_ms_per_batch = measure_readiness(
                target, chosen.config, step_ms, window
            )
            readiness.config = chosen.config
        else:
            report.notes.append("readiness not measured: no time left in the budget")
    report.traps = find_traps(target, report.rows, chosen, report.profile, rngs, report.containers, cpus)
    report.load_average = (busy, _load_average())
    if busy is not None and busy > 0.5 * cpus:
        report.notes.append(
            f"the machine was busy before the run (load average {busy:.2f} over the last minute on {cpus} "
            "CPUs): other work shares the CPUs with the workers, so the figures are noisy"
        )
    report.elapsed_s = time.perf_counter() - started
    return report


# ------------------------------------------------------------------------- rendering
def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:,.0f}"


def _seconds(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s")


def _mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def recommend_line(report: Report) -> str:
    """`recommend: num_workers=..., thread_pool=..., prefetch_factor=...` and its evidence."""
    chosen = report.recommended
    if chosen is None or not chosen.samples_per_s:
        return "recommend: nothing measured (no configuration fitted the budget)"
    rate = chosen.samples_per_s
    evidence = [f"{_rate(rate)} samples/s"]
    current = report.row(report.current)
    if report.current is not None:
        if current is not None and current.samples_per_s:
            evidence.append(
                f"{rate / current.samples_per_s:.2f}x your current setting ({report.current.arguments()}: "
                f"{_rate(current.samples_per_s)} samples/s)"
            )
        else:
            evidence.append(f"your current setting ({report.current.arguments()}) was not measured")
    zero = report.row(Config(0))
    if zero is not None and zero.samples_per_s and chosen.config.num_workers:
        evidence.append(f"{rate / zero.samples_per_s:.2f}x num_workers=0 ({_rate(zero.samples_per_s)} samples/s)")
        if report.step_ms:
            beside = loop_rate(zero, report.step_ms, report.batch_size)
            evidence.append(
                f"num_workers=0 loads inside the training loop, so beside a {report.step_ms:g} ms step it "
                f"would deliver {_rate(beside)} samples/s"
            )
    scored = [(r, loop_rate(r, report.step_ms, report.batch_size) or 0.0) for r in report.rows if r.samples_per_s]
    best, best_rate = max(scored, key=lambda x: x[1])
    chosen_rate = loop_rate(chosen, report.step_ms, report.batch_size) or 0.0
    if best is not chosen and best_rate:
        evidence.append(
            f"within {100 * (1 - chosen_rate / best_rate):.1f} % of the fastest "
            f"({best.config.arguments()}) and cheaper"
        )
    return f"recommend: {chosen.config.arguments()}  ({'; '.join(evidence)})"


def table(rows: Sequence[Row], recommended: Row | None) -> list[str]:
    """The configurations tried, one line each."""
    zero = next((r for r in rows if r.config.num_workers == 0 and r.samples_per_s), None)
    header = (
        f"  {'workers':>7}  {'kind':<9}  {'prefetch':>8}  {'samples/s':>9}  {'runs':>4}  {'vs 0':>5}  "
        f"{'1st batch':>9}  "
        f"{'USS MB/worker':>13}  {'PSS MB/worker':>13}  {'USS growth':>10}"
    )
    lines = [header]
    for r in rows:
        vs0 = f"{r.samples_per_s / zero.samples_per_s:.2f}x" if r.samples_per_s and zero and zero.samples_per_s else "-"
        if r.config.kind == "processes" and r.samples_per_s:
            uss = f"{_mb(r.uss_first_mb)}->{_mb(r.uss_end_mb)}"
            pss = f"{_mb(r.pss_first_mb)}->{_mb(r.pss_end_mb)}"
            growth = "n/a" if r.uss_growth_mb is None else f"{r.uss_growth_mb:+.1f}"
        else:
            uss = pss = growth = "-"
        marks = (" <- recommended" if r is recommended else "") + (" (current)" if r.current else "")
        if r.note:
            marks += f"  [{r.note}]"
        lines.append(
            f"  {r.config.num_workers:>7}  {r.config.kind:<9}  {r.config.prefetch_factor or '-':>8}  "
            f"{_rate(r.samples_per_s):>9}  {len(r.rates):>4}  {vs0:>5}  {_seconds(r.first_batch_s):>9}  "
            f"{uss:>13}  {pss:>13}  "
            f"{growth:>10}{marks}"
        )
    return lines


def render(report: Report) -> str:
    """The report as printed."""
    p = report.profile
    out = [f"stoker doctor {report.spec}"]
    given = report.source
    if report.current is not None:
        given += f" with {report.current.arguments()}"
    out.append(f"  given: {given}; measured with {report.measured_with}")
    length = f"{report.dataset_len:,} samples" if report.dataset_len is not None else "iterable"
    order = "shuffle" if report.shuffle else "in order"
    out.append(f"  dataset: {report.dataset}, {length}; batch_size {report.batch_size}, {order}")
    out.append(
        f"  machine: {report.cpus} usable CPUs, start method {report.start_method}; budget {report.budget_s:g} s"
    )
    out.append("")
    if p is not None:
        out.append(
            f"per sample, in this process ({p.samples} samples): median {p.fetch_median_ms:.3f} ms, "
            f"p90 {p.fetch_p90_ms:.3f} ms, spread p90/median {p.spread:.2f}x (p10 {p.fetch_p10_ms:.3f}, "
            f"max {p.fetch_max_ms:.3f} ms)"
        )
        collate = "-" if p.collate_ms is None else f"{p.collate_ms:.2f} ms"
        size = "-" if p.batch_bytes is None else f"{p.batch_bytes / MB:.2f} MB"
        alone = p.one_process_rate()
        out.append(
            f"per batch of {p.batch_size}: collate {collate}, {size}"
            + (f"; one process alone: ~{_rate(alone)} samples/s" if alone else "")
        )
        out.append("")
    out.append(
        "configurations (steady-state samples/s, start-up excluded, the median of `runs` windows; memory per "
        "worker process: USS and PSS from smaps_rollup less the shared-memory batch slots, after the first "
        "batch -> at the end):"
    )
    out.extend(table(report.rows, report.recommended))
    out.append("")
    out.append(recommend_line(report))
    best = report.best()
    if report.free_rate and best is not None and best.samples_per_s:
        out.append(
            f"headroom: a free loader (cached batches replayed, each leaf's shape read) delivers "
            f"{_rate(report.free_rate)} samples/s; the best configuration {_rate(best.samples_per_s)}: "
            f"the loader delivers {100 * best.samples_per_s / report.free_rate:.2g} % of what a free loader would"
        )
    r = report.readiness
    if r is not None:
        line = (
            f"readiness at --step-ms {r.step_ms:g}: the model takes {_rate(r.needed_per_s)} samples/s "
            f"({report.batch_size} per {r.step_ms:g} ms); expected min(1, best/needed) = {r.expected:.2f}"
        )
        if r.recommended_expected is not None:
            line += f", {r.recommended_expected:.2f} for the recommended setting"
        if r.workers_needed is not None:
            line += f"; readiness >= {READINESS_TARGET} needs num_workers={r.workers_needed} ({r.workers_needed_how})"
        else:
            line += f"; workers for readiness >= {READINESS_TARGET}: {r.workers_needed_how}"
        out.append(line)
        if r.measured is not None and r.config is not None:
            out.append(
                f"readiness measured: {r.config.arguments()} behind a consumer sleeping {r.step_ms:g} ms per "
                f"batch for {r.measured_window_s:.1f} s: not waiting in next() {100 * r.measured:.1f} % of the "
                f"time ({r.wait_ms_per_batch:.2f} ms wait per batch)"
            )
    if report.traps:
        out.extend(f"trap: {t.message}" for t in report.traps)
    else:
        out.append("traps: none found")
    out.extend(f"note: {n}" for n in report.notes)
    out.append(f"({report.elapsed_s:.1f} s)")
    return "\n".join(out)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "batches"}
        if isinstance(value, Row):
            out["uss_growth_mb"] = value.uss_growth_mb
            out["kind"] = value.config.kind
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_json(report: Report) -> dict[str, Any]:
    """All figures as JSON-able data."""
    data: dict[str, Any] = _plain(report)
    best = report.best()
    data["best"] = _plain(best) if best is not None else None
    data["recommendation"] = {
        "line": recommend_line(report),
        **(_plain(report.recommended.config) if report.recommended else {}),
        "samples_per_s": report.recommended.samples_per_s if report.recommended else None,
    }
    data["headroom"] = {
        "free_loader_samples_per_s": report.free_rate,
        "best_samples_per_s": best.samples_per_s if best else None,
        "ratio": (best.samples_per_s / report.free_rate) if best and best.samples_per_s and report.free_rate else None,
    }
    del data["recommended"]
    return data


def _short(config: Config) -> str:
    """A chart label: '0', '2p pf2' (2 processes, prefetch 2), '1t pf4' (threads)."""
    if config.num_workers == 0:
        return "0"
    return f"{config.num_workers}{'t' if config.thread_pool else 'p'} pf{config.prefetch_factor}"


def plot(report: Report, path: str) -> bool:
    """A chart of samples/s per configuration and memory per worker; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report.rows if r.samples_per_s]
    labels = [_short(r.config) for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    colours = ["#d95f02" if r is report.recommended else ("#7570b3" if r.current else "#1b9e77") for r in rows]
    left.bar(range(len(rows)), [r.samples_per_s or 0 for r in rows], color=colours)
    left.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    left.set_ylabel("samples/s (steady state)")
    left.set_xlabel("workers (p: processes, t: threads), pf: prefetch_factor", fontsize=8)
    left.set_title("throughput per configuration (orange: recommended, purple: current)", fontsize=9)
    if report.free_rate and report.readiness is not None:
        left.axhline(report.readiness.needed_per_s, color="grey", ls="--", lw=1)
        need = report.readiness.needed_per_s
        left.text(0, need, f" model at {report.readiness.step_ms:g} ms/step", fontsize=7, va="bottom")
    procs = [r for r in rows if r.config.kind == "processes" and r.uss_first_mb is not None]
    if procs:
        x = np.arange(len(procs))
        width = 0.27
        right.bar(x - width, [r.uss_first_mb or 0 for r in procs], width, label="USS after 1st batch")
        right.bar(x, [r.uss_end_mb or 0 for r in procs], width, label="USS at end")
        right.bar(x + width, [r.pss_end_mb or 0 for r in procs], width, label="PSS at end")
        right.set_xticks(x, [_short(r.config) for r in procs], fontsize=8)
        right.set_ylabel("MB per worker process")
        right.legend(fontsize=7)
    else:
        right.text(0.5, 0.5, "no process-worker memory figures", ha="center", va="center")
    right.set_title("memory per worker process", fontsize=9)
    fig.suptitle(f"stoker doctor {report.spec}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def save_json(report: Report, path: str) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_json(report), f, indent=2, default=str)
