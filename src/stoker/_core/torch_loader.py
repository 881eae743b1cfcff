"""stoker.torch's `DataLoader`: stoker's loader, and a `torch.utils.data.DataLoader` to
everything that asks.

Training frameworks decide what to do with a loader by `isinstance(loader, DataLoader)` and
by its attributes: Lightning injects a `DistributedSampler` and re-creates the loader with
`type(loader)(**arguments)`, accelerate rebuilds it around a rank's shard. So this class
subclasses torch's (whose `__init__` it never runs: every attribute torch's has is set by
stoker's `__init__`), builds torch's own `BatchSampler` by default and reports torch's
`_DatasetKind`.
"""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

import torch.utils.data as _td
from torch.utils.data.dataloader import _DatasetKind, _InfiniteConstantSampler

from .._data import torch_kinds as _kinds
from .._data.torch_collate import default_collate, default_convert
from . import loader as _loader
from .resume import why_not_stateful

T_co = TypeVar("T_co", covariant=True)


class DataLoader(_loader.DataLoader[T_co], _td.DataLoader[T_co]):  # type: ignore[misc]
    __doc__ = _loader.DataLoader.__doc__
    _flavour = "torch"
    _random_sampler_cls = _kinds.RandomSampler
    _sequential_sampler_cls = _kinds.SequentialSampler

    # Lightning records the arguments a loader was made with by wrapping the `__init__` of
    # each DataLoader subclass that defines one (and re-creates the loader from them); so it
    # is defined here, and stoker's own arguments (stats, max_worker_restarts, ...) survive
    __init__ = _loader.DataLoader.__init__

    @staticmethod
    def _kind_of(iterable: bool) -> Any:
        return _DatasetKind.Iterable if iterable else _DatasetKind.Map

    @staticmethod
    def _shuffles_itself(dataset: Any, shuffle: bool) -> bool:
        # torch hands the flag to the pipe's shufflers (and refuses it for other streams)
        if not isinstance(dataset, _td.IterDataPipe):
            return False
        _td.graph_settings.apply_shuffle_settings(dataset, shuffle=shuffle)
        return True

    @staticmethod
    def _infinite_sampler() -> Any:
        return _InfiniteConstantSampler()

    @staticmethod
    def _batch_sampler(sampler: Any, batch_size: int, drop_last: bool, last_batch: str | None) -> Any:
        # torch's own class, as torch's loader makes it: frameworks treat exactly that class
        # as "the loader's own batching" and re-create the loader around a new sampler
        if last_batch == "rollover":
            return _kinds.BatchSampler(sampler, batch_size, drop_last, last_batch=last_batch)
        return _td.BatchSampler(sampler, batch_size, drop_last)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` (see `stoker.DataLoader.load_state_dict`). A state
        that an older stoker saved for a stream without state (`stream_without_state`, which
        stoker now replays instead) restarts that stream, with a `UserWarning` saying why.

        Args:
            state: What `state_dict()` returned.

        Raises:
            ValueError: when the state is from another configuration, or is a
                stream-without-state state given to a loader whose dataset is another type
                that can save its position; nothing is applied.
        """
        if isinstance(state, dict) and "stream_without_state" in state:
            name = type(self.dataset).__name__
            reason = why_not_stateful(self.dataset) if self._iterable else None
            # a Stateful stream of the same type saved none when its state_dict() failed
            same_stream = self._iterable and state["stream_without_state"] == name
            if reason is None and not same_stream:
                raise ValueError(
                    f"this DataLoader state is of a stream that could not save its position "
                    f"({state['stream_without_state']}); this loader reads {name}, "
                    "which can: the state was not applied"
                )
            warnings.warn(
                f"{name} cannot save its position ({state.get('reason') or reason}), so this "
                "DataLoader restarts it from its beginning",
                UserWarning,
                stacklevel=2,
            )
            return
        super().load_state_dict(state)

    @staticmethod
    def _default_collate() -> Any:
        return default_collate

    @staticmethod
    def _default_convert() -> Any:
        return default_convert


# torchdata's `StatefulDataLoader`, by its name: `from stoker.torch import StatefulDataLoader`
# replaces `from torchdata.stateful_dataloader import StatefulDataLoader`. It is this flavour's
# DataLoader (whose state_dict()/load_state_dict() and snapshot_every_n_steps are torchdata's)
# under the class name code written for torchdata looks for (docs/reference/torch.md).
class StatefulDataLoader(DataLoader[T_co]):
    __doc__ = _loader.DataLoader.__doc__
