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

A loader whose sampler already gives each rank its share (stoker's `ShardedSampler` or
`StreamSampler`, any loader's) would lose part of it to accelerate's `BatchSamplerShard`, which
shards whatever it gets: `keep_share` makes that shard a pass-through, so each rank reads its
share exactly as without accelerate; where accelerate splits batches across ranks itself
(`split_batches`, `dispatch_batches`) it cannot, and every rank warns naming the setting.

With `DataLoaderConfiguration(use_stateful_dataloader=True)` accelerate builds torchdata's
`StatefulDataLoader` instead of torch's; a stoker loader then becomes stoker's
`StatefulDataLoader` (torchdata's `snapshot_every_n_steps` kept), so the wrapper's per-batch
`state_dict()`, `save_state` and `load_state` go through stoker, as they do in the plain case.

Everything accelerate does around the loader stays accelerate's: the shard, device placement,
`GradientState` (`sync_gradients` at the end of each epoch, `gather_for_metrics` dropping the
padding), `skip_first_batches`, and the per-batch `state_dict()` its wrapper keeps (stoker's
exact resume point). The wrapper is marked as holding a stateful loader, as accelerate marks one
around torchdata's StatefulDataLoader, so `accelerator.save_state` / `load_state` carry that
point too; a stream whose position cannot be saved gets no state, as torch's loader has none.

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
_PASSTHROUGH = "_stoker_passthrough"  # marks a BatchSamplerShard keep_share opened


# --------------------------------------------------------------------- the rebuild
def _stoker_loader_class(stateful: bool = False) -> Any:
    """stoker.torch's DataLoader, or its StatefulDataLoader for a loader accelerate built as
    torchdata's (`stateful`)."""
    from .._core.torch_loader import DataLoader, StatefulDataLoader

    return StatefulDataLoader if stateful else DataLoader


def _torchdata_loader(loader: Any) -> bool:
    """Whether `loader` is exactly torchdata's StatefulDataLoader (what accelerate builds with
    `use_stateful_dataloader=True`); torchdata is never imported here."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    return module is not None and type(loader) is getattr(module, "StatefulDataLoader", None)


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
    plus stoker's `options`; stoker's StatefulDataLoader where `made` is torchdata's."""
    import torch.utils.data as tud

    from .._data import torch_collate

    collate_fn = made.collate_fn
    if collate_fn is tud.default_collate:  # the same batches, made by stoker's own
        collate_fn = torch_collate.default_collate
    elif collate_fn is tud.default_convert:
        collate_fn = torch_collate.default_convert
    kwargs: dict[str, Any] = {
        "dataset": made.dataset,
        "num_workers": made.num_workers,  # an `Auto` when the original asked for "auto": asked again
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
    stateful = _torchdata_loader(made)
    if stateful:
        kwargs["snapshot_every_n_steps"] = made.snapshot_every_n_steps
    if isinstance(made.dataset, tud.IterableDataset):
        kwargs.update(batch_size=made.batch_size, drop_last=made.drop_last)
    elif made.batch_sampler is not None:
        opened = _opened(made.batch_sampler)
        if opened is not made.batch_sampler and _plain_batches(opened):
            # the loader's own batching, as the user's loader had it (its state then records
            # the batch size an elastic resume counts with)
            kwargs.update(sampler=opened.sampler, batch_size=opened.batch_size, drop_last=opened.drop_last)
        else:
            kwargs.update(batch_sampler=opened)
    else:  # a sampler that yields whole batches (batch_size=None)
        kwargs.update(sampler=_opened(made.sampler), batch_size=None)
    return _stoker_loader_class(stateful)(**kwargs, **options)


def _opened(batch_sampler: Any) -> Any:
    """The batch sampler inside a shard that `keep_share` made a pass-through (stoker's loader
    then skips a resumed epoch's batches without drawing them), else `batch_sampler`."""
    return batch_sampler.batch_sampler if getattr(batch_sampler, _PASSTHROUGH, False) else batch_sampler


def _plain_batches(batch_sampler: Any) -> bool:
    """Whether `batch_sampler` is torch's or stoker's own BatchSampler, batching as a loader's
    `batch_size` and `drop_last` do."""
    import torch.utils.data as tud

    from .._data import samplers, torch_kinds

    kinds = (tud.BatchSampler, samplers.BatchSampler, torch_kinds.BatchSampler)
    return type(batch_sampler) in kinds and getattr(batch_sampler, "last_batch", "keep") in ("keep", "discard")


# --------------------------------------------------------------------- rank shares
def _rank_share(index_sampler: Any) -> tuple[Any, list[Any]]:
    """The stoker sampler of one rank's share (a `RankShareSampler`) that `index_sampler`
    draws from, through accelerate's wrappers (`BatchSamplerShard`, `SkipBatchSampler`) and a
    `BatchSampler`, or None; and the `BatchSamplerShard`s met on the way."""
    from .._data.distributed import RankShareSampler

    shards: list[Any] = []
    part = index_sampler
    for _ in range(8):  # a few wrappers deep at most
        if part is None or isinstance(part, RankShareSampler):
            return part, shards
        if all(hasattr(part, name) for name in ("batch_sampler", "num_processes", "process_index")):
            shards.append(part)
        inner = getattr(part, "batch_sampler", None)
        part = inner if inner is not None else getattr(part, "sampler", None)
    return None, shards


def _warn_kept_not(setting: str, share: Any) -> None:
    warnings.warn(
        f"this DataLoader's {type(share).__name__} already gives each rank its share, and accelerate's "
        f"{setting}=True splits every batch across the ranks again, so each rank trains on part of "
        f"its share only; keep the share whole with {setting}=False (DataLoaderConfiguration("
        f"{setting}=False) given to the Accelerator, or in the Trainer's accelerator_config)",
        UserWarning,
        stacklevel=4,
    )


def keep_share(prepared: Any) -> None:
    """Give each rank the share its sampler gives it, in its order, when `prepared` (what
    accelerate made of a loader) wraps a loader whose sampler is stoker's `ShardedSampler` or
    `StreamSampler`: accelerate's `BatchSamplerShard` becomes a pass-through (one process, its
    batches as they come, the last one as short as it is). `gather_for_metrics` then keeps
    every gathered sample: accelerate's count of the samples to cut off the last batch assumes
    its own shard, and a sampler's padding (`drop_last=False`) is spread over the ranks.
    Warns when accelerate splits batches itself (`split_batches`, `dispatch_batches`)."""
    base = vars(prepared).get("base_dataloader") if hasattr(prepared, "__dict__") else None
    if base is None:
        return
    share, shards = _rank_share(base.batch_sampler if base.batch_sampler is not None else base.sampler)
    if share is None:
        return
    dispatcher = getattr(sys.modules.get("accelerate.data_loader"), "DataLoaderDispatcher", None)
    if dispatcher is not None and isinstance(type(prepared), type) and issubclass(type(prepared), dispatcher):
        _warn_kept_not("dispatch_batches", share)
        return
    if any(getattr(shard, "split_batches", False) and shard.num_processes > 1 for shard in shards):
        _warn_kept_not("split_batches", share)
        return
    for shard in shards:
        shard.num_processes, shard.process_index, shard.even_batches = 1, 0, False
        setattr(shard, _PASSTHROUGH, True)
        inner = getattr(shard.batch_sampler, "sampler", None)
        if inner is not None and not hasattr(shard, "sampler"):
            # accelerate's set_epoch looks two levels deep for a sampler: through the
            # SkipBatchSampler of skip_first_batches, this is the second
            shard.sampler = inner
    prepared._drop_last = True  # no remainder: gather_for_metrics cuts nothing


def keep_stoker(prepared: Any, options: dict[str, Any]) -> Any:
    """`prepared` (what accelerate returned) with stoker running inside it."""
    import torch.utils.data as tud

    base = vars(prepared).get("base_dataloader") if hasattr(prepared, "__dict__") else None
    if base is None:
        if type(prepared) is tud.DataLoader:  # skip_first_batches of an unprepared loader
            return _rebuilt_or(prepared, prepared, options)
        return prepared  # not a wrapper this module knows (an XLA one, say): accelerate's
    if type(base) is not tud.DataLoader and not _torchdata_loader(base):
        return prepared  # already stoker's, or a loader this module does not know
    new = _rebuilt_or(base, None, options)
    if new is None:
        return prepared
    prepared.base_dataloader = new
    try:
        # what the wrapper's state_dict() gives until its first batch (it refreshes it per
        # batch): taken without drawing the next epoch, which the user did not ask for here
        prepared.dl_state_dict = new._first_state()
    except TypeError:
        # a stream that cannot save its position: no state, as with torch's loader (the
        # wrapper would otherwise ask for it at every batch, and fail)
        vars(prepared).pop("dl_state_dict", None)
        prepared._update_state_dict = _no_state
    else:
        # accelerator.save_state / load_state then carry stoker's position, as they carry a
        # torchdata StatefulDataLoader's (that flag is all they look at)
        prepared.use_stateful_dataloader = True
    return prepared


def _no_state() -> None:
    """The per-batch state refresh of a wrapper whose stoker loader has no state."""


def _rebuilt_or(made: Any, fallback: Any, options: dict[str, Any]) -> Any:
    """`rebuild(made, options)`, or `fallback` with a warning if stoker refuses the arguments
    this accelerate gave torch's DataLoader."""
    try:
        return rebuild(made, options)
    except (TypeError, ValueError, AttributeError) as exc:
        warnings.warn(
            f"stoker could not rebuild the DataLoader accelerate made ({type(exc).__name__}: {exc}); "
            "this loader runs as accelerate's torch DataLoader, without stoker",
            RuntimeWarning,
            stacklevel=4,
        )
        return fallback


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
_warned = False


def _warn_unpatched(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"{reason}; stoker loaders given to accelerator.prepare will be rebuilt as torch "
            "DataLoaders by this version of accelerate (sharded correctly, without stoker), "
            "and a loader with stoker's ShardedSampler or StreamSampler is sharded again, so "
            "each rank reads only part of its share",
            RuntimeWarning,
            stacklevel=3,
        )


def _patch(accelerator_module: ModuleType) -> None:
    """Wrap accelerate's prepare_data_loader and skip_first_batches (once)."""
    accelerator_class = getattr(accelerator_module, "Accelerator", None)
    data_loader = sys.modules.get("accelerate.data_loader")
    original_skip = getattr(data_loader, "skip_first_batches", None)
    prepare = getattr(accelerator_class, "prepare_data_loader", None)
    method_skip = getattr(accelerator_class, "skip_first_batches", None)
    if accelerator_class is None or original_skip is None or prepare is None or method_skip is None:
        _warn_unpatched(
            "this version of accelerate lacks Accelerator.prepare_data_loader, "
            "Accelerator.skip_first_batches or accelerate.data_loader.skip_first_batches"
        )
        return
    if getattr(prepare, _WRAPPED, False):
        return

    @functools.wraps(prepare)
    def prepare_data_loader(self: Any, data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        options = _source_options(data_loader, self)
        prepared = prepare(self, data_loader, *args, **kwargs)
        if prepared is data_loader:  # prepared before
            return prepared
        keep_share(prepared)
        return prepared if options is None else keep_stoker(prepared, options)

    @functools.wraps(original_skip)
    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        options = _source_options(dataloader, None)
        skipped = original_skip(dataloader, num_batches=num_batches)
        keep_share(skipped)
        return skipped if options is None else keep_stoker(skipped, options)

    @functools.wraps(method_skip)
    def accelerator_skip_first_batches(self: Any, dataloader: Any, num_batches: int = 0) -> Any:
        # the module function (wrapped above) keeps stoker loaders; this adds an adopted
        # accelerator's torch loaders
        options = _source_options(dataloader, self)
        skipped = method_skip(self, dataloader, num_batches=num_batches)
        keep_share(skipped)
        return skipped if options is None else keep_stoker(skipped, options)

    for function in (prepare_data_loader, skip_first_batches, accelerator_skip_first_batches):
        setattr(function, _WRAPPED, True)
    accelerator_class.prepare_data_loader = prepare_data_loader
    accelerator_class.skip_first_batches = accelerator_skip_first_batches
    # the function is bound by name where accelerate (and the Trainer) import it; modules
    # imported later take it from accelerate.data_loader or accelerate, wrapped by then
    for name in ("accelerate.data_loader", ACCELERATOR_MODULE, "accelerate", "transformers.trainer"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "skip_first_batches", None) is original_skip:
            setattr(module, "skip_first_batches", skip_first_batches)  # noqa: B010


class _PatchAfterExec(importlib.abc.Loader):
    """The real loader of accelerate.accelerator, then `_patch`; it hands the module back
    to the real loader (its `__loader__` and `__spec__.loader`) once executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        if name == "_loader":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        self._loader.exec_module(module)
        try:
            _patch(module)
        except Exception as exc:  # never fail the user's `import accelerate` for stoker's sake
            _warn_unpatched(f"stoker could not wrap accelerate ({type(exc).__name__}: {exc})")


class _WhenImported(importlib.abc.MetaPathFinder):
    """A one-shot finder: when accelerate's accelerator module is imported, it asks the
    other finders for its spec and wraps the spec's loader so that `_patch` runs right after
    the module executes; then it is gone from sys.meta_path."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != ACCELERATOR_MODULE:
            return None
        _remove_hook()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            _warn_unpatched("accelerate.accelerator comes from a loader stoker cannot follow")
            return spec  # imported unwrapped, as found
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
    """Make the loaders of an accelerate `Accelerator` or a transformers `Trainer` stoker's.

    From then on, the accelerator's `prepare` turns every torch DataLoader it is given into
    a `stoker.torch.DataLoader` built from the same arguments (plus `options`) and sharded
    as accelerate shards it; for a Trainer, its accelerator does so with the loaders the
    Trainer builds. The user guide page "Lightning, accelerate, the Trainer" shows it in use.

    Args:
        target: An `accelerate.Accelerator`, or a `transformers.Trainer` (whose accelerator
            is adopted).
        **options: stoker's own DataLoader arguments to give the loaders it builds:
            `thread_pool`, `max_worker_restarts`, `seed_each_batch`, `stats`, `progress`.

    Returns:
        `target` itself.

    Raises:
        TypeError: when `target` is neither an Accelerator nor a Trainer (accelerate, or
            transformers, not imported counts as neither), or an option is not one of those
            above.
    """
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
        if (
            accelerator_class is None
            or trainer_class is None
            or not isinstance(target, trainer_class)
            or not isinstance(accelerator, accelerator_class)
        ):
            raise TypeError(
                "adopt() takes an accelerate.Accelerator or a transformers.Trainer, "
                f"got {type(target).__module__}.{type(target).__qualname__}"
            )
    install()
    setattr(accelerator, _ADOPTED, dict(options))
    return target
