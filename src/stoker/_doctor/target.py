"""The doctor's target: importing MODULE:FACTORY (`load_target`), what it gave reduced to what the
sweep varies (`describe_target`, `Target`), one loader configuration (`Config`), and the endless
sampler that keeps an epoch's end out of every measuring window."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .._core import seeding
from .._core.auto import Auto
from .._core.loader import start_method_of
from .._data.datasets import is_iterable_dataset
from .errors import DoctorError


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
        return f"num_workers={self.num_workers}, thread_pool={self.thread_pool}, prefetch_factor={self.prefetch_factor}"


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
    asked = ("auto" if isinstance(workers, Auto) else workers, "auto" if isinstance(prefetch, Auto) else prefetch)
    if "auto" not in asked and (workers == 0 or isinstance(prefetch, int)):
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
        auto=None if current is not None else f"num_workers={asked[0]!r}, prefetch_factor={asked[1]!r}",
    )
