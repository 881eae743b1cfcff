"""Every method and attribute stoker calls on a dataset or sampler it did not make: the one list.

A dataset or sampler takes part in a stoker feature by defining the names below; nothing has
to be inherited or registered. Each protocol is one role; the call sites import it (and ask
`follows(obj, Protocol)`, or call `upcoming_of`) so that a name stoker reads is declared here
and nowhere else. docs/design/hooks.md lists them for dataset authors: who calls each, when,
in which process, and what it must return.

Roles:

- `FetchesAhead` / `MayFetchAhead`: told each batch's indices as the loader's sampler draws
  them, ahead of dispatch (downloads ahead of the batches); `stoker_fetches_ahead()` lets an
  instance say it has nothing to fetch, so that its sampler is read one batch at a time.
- `DescribesStream`: what a loader state saved over it must agree on (the state's config).
- `ReportsToDoctor`: the lines `stoker doctor` prints for it.
- `KnowsLengths`, `KnowsStreamLengths`, `NamesDocuments`, `HasField`: the token counts and
  the documents' names that mixing and packing read without reading the tokens.
- `HasShards`, `LocatesRows`: a sharded dataset's shard boundaries (shard-aware orders) and
  a packed stream's row lookup (packed in the loader's process before workers start).
- `ResumableSampler`, `OrdersRankShares`, `SetsEpoch`: how a sampler is resumed at a batch
  without replaying the batches before it, and how its epoch is kept.
- `Stateful`: torchdata's `state_dict()` / `load_state_dict(state)`, on a user's sampler or
  an IterableDataset's replica.

This module imports nothing of stoker (only the standard library, and numpy for annotations):
every layer may import it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class FetchesAhead(Protocol):
    """A map-style dataset told each batch's indices as the loader's sampler draws them, ahead
    of their dispatch (`stoker.shards.ShardedDataset` downloads their shards).

    Called in the loader's process (the one that iterates), on the iterating thread, once per
    batch in the order drawn; never in a worker. Read from the dataset's class, so that a
    wrapper's `__getattr__` forwarding to another object is never taken for it.
    """

    def stoker_upcoming(self, indices: list[int], behind: int) -> bool:
        """Hear of a batch drawn ahead.

        Args:
            indices: The batch's indices (one index for a loader without batching).
            behind: How many drawn batches may still be unread by the workers.

        Returns:
            True to have the sampler drawn further ahead, False to wait until a batch is
            dispatched.
        """
        ...


@runtime_checkable
class MayFetchAhead(FetchesAhead, Protocol):
    """A `FetchesAhead` dataset whose instances decide whether they fetch ahead: a wrapper (a mix, a
    packing) that fetches ahead only when what it wraps does. Asked once per iterator, before the
    first batch is drawn; False means the sampler is read one batch at a time, as for a
    dataset without `stoker_upcoming`."""

    def stoker_fetches_ahead(self) -> bool:
        """Whether this instance has anything to fetch ahead (its `stoker_upcoming` is worth calling)."""
        ...


def upcoming_of(dataset: Any) -> Callable[[list[int], int], bool] | None:
    """The dataset's bound `stoker_upcoming` when it fetches ahead, else None.

    Read from the class (a wrapper's `__getattr__` is never consulted); a class that defines
    `stoker_fetches_ahead` is asked whether this instance fetches ahead.

    Args:
        dataset: Any dataset.
    """
    if getattr(type(dataset), "stoker_upcoming", None) is None:
        return None
    asks = getattr(type(dataset), "stoker_fetches_ahead", None)
    if asks is not None and not asks(dataset):
        return None
    hook: Callable[[list[int], int], bool] = dataset.stoker_upcoming
    return hook


@runtime_checkable
class DescribesStream(Protocol):
    """A dataset or sampler that says what a loader state saved over it must agree on.

    Called in the loader's process by `DataLoader.state_dict()` and `load_state_dict()` (the
    state's `config`, under `stream.` for the dataset and `sampler.` for the sampler), and by a
    mix or packing describing what it wraps. The dict must be plain JSON (str keys; numbers,
    str, bools, None, lists, dicts) and the same in every process for the same arguments.
    """

    def stoker_describe(self) -> dict[str, Any]:
        """The description: a flat dict; any key that differs refuses a saved state."""
        ...


@runtime_checkable
class ReportsToDoctor(Protocol):
    """A dataset that adds lines of its own to `stoker doctor`'s report (a mix's achieved
    shares, a packing's utilisation). Called once, in the doctor's process, after the
    measurement; an exception becomes a line of the report."""

    def stoker_doctor_lines(self) -> list[str]:
        """The lines to print (each a str, no newline)."""
        ...


@runtime_checkable
class KnowsLengths(Protocol):
    """A dataset of token documents that knows each document's length without reading it:
    `lengths[i]` is `len(ds[i])` (a 1-D integer numpy array, one entry per document).

    Read by mixing (`weigh="tokens"`, shares of tokens) and packing (the rows are packed from
    lengths alone), in whichever process makes a row. A document longer than its entry is an
    error when its row is made (ValueError naming it); one shorter, too.
    """

    lengths: np.ndarray


@runtime_checkable
class KnowsStreamLengths(Protocol):
    """A stream addressed by position (a `MixedDataset`) that gives the token counts of the
    documents at a range of its positions; `PackedDataset` packs such a stream as it is (not
    cycled). Called where a row's window is packed: the loader's process and workers."""

    def stoker_lengths(self, start: int, stop: int) -> np.ndarray:
        """The int64 lengths of the documents at positions [start, stop)."""
        ...


@runtime_checkable
class NamesDocuments(Protocol):
    """A stream that names a position's document in error messages (its source and sample)."""

    def describe_document(self, position: int) -> str:
        """Words naming the document at `position`, e.g. "the document at mix position 7 (source 1, sample 3)"."""
        ...


@runtime_checkable
class HasField(Protocol):
    """A stream of mappings whose documents' tokens are under the key `field` (None: the
    samples are the documents); a `PackedDataset` over a `MixedDataset` reads the mix's."""

    field: str | None


@runtime_checkable
class HasShards(Protocol):
    """A dataset stored in shards: `shard_starts[k]` is the first sample of shard k (a 1-D
    integer array, increasing, starting at 0). `ShardedSampler` and a mix's sharded source
    order samples so that each shard is read in one stretch."""

    shard_starts: np.ndarray


@runtime_checkable
class LocatesRows(Protocol):
    """A packed stream whose rows are found through a table built window after window.
    `StreamSampler` calls `locate(first_row)` in the loader's process when an epoch's indices
    are drawn, before workers fork, so that forked workers inherit the table."""

    def locate(self, row: int) -> tuple[int, int]:
        """The (window, row within the window) of `row`."""
        ...


@runtime_checkable
class ResumableSampler(Protocol):
    """A sampler that starts an epoch at a batch without drawing the ones before it. A loader
    resuming at batch k calls `_iter_from(k)` instead of iterating and skipping k items; every
    stoker sampler and `BatchSampler` over one defines it."""

    def _iter_from(self, skip: int) -> Iterator[Any]:
        """The epoch's indices (or index batches) from item `skip` on, the epoch's draw made now."""
        ...


@runtime_checkable
class OrdersRankShares(Protocol):
    """A `RankShareSampler` subclass (`DistributedSampler`, `ShardedSampler`, `StreamSampler`):
    `_order()` is the whole epoch's order before ranks take their shares, which resume and the
    elastic path (another world size) slice."""

    def _order(self) -> list[int]:
        """The epoch's global order of indices."""
        ...


@runtime_checkable
class SetsEpoch(Protocol):
    """A sampler whose order depends on the epoch it was told (`DistributedSampler`'s
    convention). A resume calls `set_epoch` with the state's epoch; the loader does not
    dispatch the next epoch before `iter()` asks for it (set_epoch must come first)."""

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch `epoch`'s order."""
        ...


@runtime_checkable
class KeepsEpoch(SetsEpoch, Protocol):
    """A `SetsEpoch` sampler that says which epoch it is in: a loader state records `epoch`."""

    epoch: int


@runtime_checkable
class Stateful(Protocol):
    """torchdata's Stateful: `state_dict()` with no argument and `load_state_dict(state)` with
    one (checked by signature: a method of that name with another signature is the object's own,
    and stoker never calls it). On a user's sampler its state is recorded after each batch is
    drawn (loader's process); on an IterableDataset replica it is read in its worker."""

    def state_dict(self) -> dict[str, Any]:
        """The state: any value pickle can hold (stoker hands it back as it was returned).

        Returns:
            The object's state now.
        """
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back a state `state_dict()` returned.

        Args:
            state: What `state_dict()` returned, equal and of the same types.
        """
        ...


def follows(obj: object, protocol: type) -> bool:
    """Whether `obj` has every member `protocol` (one of this module's) declares.

    The same test on every Python: 3.12 made `isinstance` with a runtime protocol read
    attributes statically, so an object that forwards through `__getattr__` (a wrapper) would
    follow a protocol on 3.11 and not on 3.12; `hasattr` reads them as stoker always has.

    Args:
        obj: The object asked of (a dataset, a sampler).
        protocol: A `typing.Protocol` class of this module.
    """
    return all(hasattr(obj, name) for name in _members(protocol))


@functools.cache
def _members(protocol: type) -> tuple[str, ...]:
    names: dict[str, None] = {}
    for cls in protocol.__mro__:
        if cls in (Protocol, Generic, object) or not getattr(cls, "_is_protocol", False):
            continue
        for name in (*inspect.get_annotations(cls), *(k for k, v in vars(cls).items() if callable(v))):
            if not (name.startswith("__") and name.endswith("__")):
                names[name] = None
    return tuple(names)
