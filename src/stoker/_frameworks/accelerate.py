"""stoker loaders under Hugging Face accelerate: accelerate shards them, stoker runs them.

`accelerator.prepare(loader)` rebuilds a DataLoader around one process's shard (a
`BatchSamplerShard`, or an `IterableDatasetShard`) and wraps it (`DataLoaderShard`,
`DataLoaderDispatcher`, `SkipDataLoader`), building the loader inside as a plain
`torch.utils.data.DataLoader` from the original's attributes. For a stoker loader that would
silently drop stoker (its speed, restarts, statistics, resume), so this module puts a stoker
loader built from the same arguments in its place, with the original's stoker-only options:

```
accelerator.prepare(stoker loader) ──▶ accelerate: shard, wrap, build torch's DataLoader
                                    ──▶ here: wrapper.base_dataloader = stoker DataLoader(same arguments)
```

Everything accelerate does around the loader stays accelerate's: the shard, device placement,
`GradientState` (`sync_gradients` at the end of each epoch, `gather_for_metrics` dropping the
padding), `skip_first_batches`, and the per-batch `state_dict()` its wrapper keeps (stoker's
exact resume point).

It is installed with `stoker.torch` (`install`): `Accelerator.prepare_data_loader` and
`skip_first_batches` are wrapped when accelerate is imported (at once if it already is;
otherwise by a one-shot import hook), so changing the import is enough. Torch loaders are left
to accelerate unless `adopt(accelerator)` asked for them too (the Hugging Face Trainer builds
its own torch loaders: `adopt(trainer)`). If this accelerate lacks what the wrapping relies on,
nothing is wrapped and one warning says that stoker loaders will be rebuilt as torch's.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

ACCELERATOR_MODULE = "accelerate.accelerator"
OPTIONS = ("thread_pool", "max_worker_restarts", "seed_each_batch", "stats", "progress")
_WRAPPED = "_stoker_wrapped"
_ADOPTED = "_stoker_options"


# --------------------------------------------------------------------- the rebuild
def _stoker_loader_class() -> Any:
    from .._core.torch_loader import DataLoader

    return DataLoader


def options_of(loader: Any) -> dict[str, Any]:
    """The stoker-only options of a stoker loader, as keyword arguments."""
    return {
        "thread_pool": loader.thread_pool,
        "max_worker_restarts": loader.max_worker_restarts,
        "seed_each_batch": loader.seed_each_batch,
        "stats": loader.stats_enabled,
        "progress": loader.progress,
    }


def rebuild(made: Any, options: dict[str, Any]) -> Any:
    """A stoker DataLoader with the arguments accelerate gave the torch DataLoader `made`,
    plus stoker's `options`."""
    import torch.utils.data as tud

    from .._data import torch_collate

    collate_fn = made.collate_fn
    if collate_fn is tud.default_collate:  # the same batches, made by stoker's own
        collate_fn = torch_collate.default_collate
    elif collate_fn is tud.default_convert:
        collate_fn = torch_collate.default_convert
    kwargs: dict[str, Any] = {
        "dataset": made.dataset,
        "num_workers": made.num_workers,
        "collate_fn": collate_fn,
        "pin_memory": made.pin_memory,
        "timeout": made.timeout,
        "worker_init_fn": made.worker_init_fn,
        "multiprocessing_context": made.multiprocessing_context,
        "generator": made.generator,
        "persistent_workers": made.persistent_workers,
        "pin_memory_device": made.pin_memory_device,
        "in_order": getattr(made, "in_order", True),
    }
    if made.num_workers > 0:
        kwargs["prefetch_factor"] = made.prefetch_factor
    if isinstance(made.dataset, tud.IterableDataset):
        kwargs.update(batch_size=made.batch_size, drop_last=made.drop_last)
    elif made.batch_sampler is not None:
        kwargs.update(batch_sampler=made.batch_sampler)
    else:  # a sampler that yields whole batches (batch_size=None)
        kwargs.update(sampler=made.sampler, batch_size=None)
    return _stoker_loader_class()(**kwargs, **options)


def keep_stoker(prepared: Any, options: dict[str, Any]) -> Any:
    """`prepared` (what accelerate returned) with stoker running inside it."""
    import torch.utils.data as tud

    base = getattr(prepared, "base_dataloader", None) if "base_dataloader" in vars(prepared) else None
    if base is None:
        if type(prepared) is tud.DataLoader:  # skip_first_batches of an unprepared loader
            return rebuild(prepared, options)
        return prepared  # not a wrapper this module knows (an XLA one, say): accelerate's
    if type(base) is not tud.DataLoader:  # already stoker's, or torchdata's StatefulDataLoader
        return prepared
    new = rebuild(base, options)
    prepared.base_dataloader = new
    prepared.dl_state_dict = new.state_dict()  # what the wrapper's state_dict() gives until a batch
    return prepared


def _source_options(loader: Any, accelerator: Any) -> dict[str, Any] | None:
    """The stoker options to keep for `loader` (a stoker loader, a wrapper around one, or a
    torch loader an adopted accelerator prepares), or None: leave it to accelerate."""
    stoker_class = _stoker_loader_class()
    base = vars(loader).get("base_dataloader") if hasattr(loader, "__dict__") else None
    for candidate in (loader, base):  # a wrapper answers isinstance as its base loader
        if candidate is not None and isinstance(candidate, stoker_class):
            return options_of(candidate)
    adopted = getattr(accelerator, _ADOPTED, None) if accelerator is not None else None
    if adopted is not None:
        import torch.utils.data as tud

        if type(loader) is tud.DataLoader or (base is not None and type(base) is tud.DataLoader):
            return dict(adopted)
    return None


# --------------------------------------------------------------------- the wrapping
def _patch(accelerator_module: ModuleType) -> None:
    """Wrap accelerate's prepare_data_loader and skip_first_batches (once)."""
    accelerator_class = getattr(accelerator_module, "Accelerator", None)
    data_loader = sys.modules.get("accelerate.data_loader")
    original_skip = getattr(data_loader, "skip_first_batches", None)
    prepare = getattr(accelerator_class, "prepare_data_loader", None)
    if accelerator_class is None or data_loader is None or original_skip is None or prepare is None:
        warnings.warn(
            "this version of accelerate lacks Accelerator.prepare_data_loader or "
            "accelerate.data_loader.skip_first_batches; stoker loaders given to accelerator.prepare "
            "will be rebuilt as torch DataLoaders (sharded correctly, without stoker)",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    if getattr(prepare, _WRAPPED, False):
        return

    @functools.wraps(prepare)
    def prepare_data_loader(self: Any, data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        options = _source_options(data_loader, self)
        prepared = prepare(self, data_loader, *args, **kwargs)
        if options is None or prepared is data_loader:
            return prepared
        return keep_stoker(prepared, options)

    @functools.wraps(original_skip)
    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        options = _source_options(dataloader, None)
        skipped = original_skip(dataloader, num_batches=num_batches)
        return skipped if options is None else keep_stoker(skipped, options)

    setattr(prepare_data_loader, _WRAPPED, True)
    setattr(skip_first_batches, _WRAPPED, True)
    accelerator_class.prepare_data_loader = prepare_data_loader
    # the function is bound by name where accelerate (and the Trainer) import it
    for name in ("accelerate.data_loader", ACCELERATOR_MODULE, "accelerate", "transformers.trainer"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "skip_first_batches", None) is original_skip:
            setattr(module, "skip_first_batches", skip_first_batches)  # noqa: B010


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _patch(module)


class _WhenImported(importlib.abc.MetaPathFinder):
    """A one-shot finder: when accelerate's accelerator module is imported, patch it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != ACCELERATOR_MODULE:
            return None
        _remove_hook()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchAfterExec(spec.loader)
        return spec


_hook: _WhenImported | None = None


def _remove_hook() -> None:
    global _hook
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None


def install() -> None:
    """Wrap accelerate now if it is imported, else when it is; never imports it."""
    global _hook
    module = sys.modules.get(ACCELERATOR_MODULE)
    if module is not None:
        _patch(module)
    elif _hook is None:
        _hook = _WhenImported()
        sys.meta_path.insert(0, _hook)


def adopt(target: Any, **options: Any) -> Any:
    """Make `target`'s loaders stoker's: `target` is an `accelerate.Accelerator` (its
    `prepare` turns every torch DataLoader into a stoker one built from the same arguments,
    sharded as accelerate shards it) or a `transformers.Trainer` (its accelerator, so the
    loaders the Trainer builds are stoker's). `options`: stoker's own DataLoader options
    (thread_pool, max_worker_restarts, seed_each_batch, stats, progress). Returns `target`."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"adopt() got unknown stoker option(s) {unknown}; it accepts {list(OPTIONS)}")
    accelerate = sys.modules.get(ACCELERATOR_MODULE)
    accelerator_class = getattr(accelerate, "Accelerator", None)
    accelerator = target
    if accelerator_class is None or not isinstance(target, accelerator_class):
        accelerator = getattr(target, "accelerator", None)
        trainer = sys.modules.get("transformers.trainer")
        trainer_class = getattr(trainer, "Trainer", None)
        if accelerator_class is None or trainer_class is None or not isinstance(target, trainer_class) \
                or not isinstance(accelerator, accelerator_class):
            raise TypeError(
                "adopt() takes an accelerate.Accelerator or a transformers.Trainer, "
                f"got {type(target).__module__}.{type(target).__qualname__}"
            )
    install()
    setattr(accelerator, _ADOPTED, dict(options))
    return target
