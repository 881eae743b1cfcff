"""Fetchers: turn a task's index into a collated batch. Shared by every engine.

Each fetch runs inside a `seeding.FetchScope`, which the fetcher moves from sample to
sample, so that `stoker.sample_seed()` / `stoker.sample_rng()` called by the dataset
derive from (base seed, epoch, sample index) — or, for a dataset that fetches whole batches
with `__getitems__`, and in the collate_fn, from (base seed, epoch, batch position).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from .._data.datasets import StackDataset, Subset
from .protocol import ReplicaBatch
from .replica import Record, Resume, take
from .resume import is_stateful
from .seeding import BATCH, ITEM, SAMPLE, FetchScope, batch_key, enter, leave
from .stats import clock


class EndOfStream(Exception):
    """The iterable dataset replica has no further batch this epoch; `record` is its state at
    the stream's end (None when it was reported already, or the replica keeps no record)."""

    def __init__(self, record: Record | None = None) -> None:
        super().__init__()
        self.record = record


def _pass_through(dataset: Any) -> list[Any] | None:
    """The datasets that `dataset.__getitems__` hands a batch on to, when it is stoker's or
    torch's own Subset or StackDataset (whose `__getitems__` only passes a batch through);
    None for any other `__getitems__`."""
    method = getattr(type(dataset), "__getitems__", None)
    if method is None:
        return None
    subsets: list[Any] = [Subset.__getitems__]
    stacks: list[Any] = [StackDataset.__getitems__]
    torch_data = sys.modules.get("torch.utils.data")
    if torch_data is not None:
        subsets.append(getattr(getattr(torch_data, "Subset", None), "__getitems__", None))
        stacks.append(getattr(getattr(torch_data, "StackDataset", None), "__getitems__", None))
    if method in subsets:
        return [dataset.dataset]
    if method in stacks:
        inner = dataset.datasets
        return list(inner.values()) if isinstance(inner, dict) else list(inner)
    return None


def fetches_batches(dataset: Any, depth: int = 0) -> bool:
    """Whether fetching a batch of `dataset` through its `__getitems__` reaches a
    `__getitems__` of the user's: a Subset or StackDataset of per-sample datasets is
    fetched per sample instead (same samples), so that each sample gets its own seed."""
    if not callable(getattr(dataset, "__getitems__", None)):
        return False
    inner = _pass_through(dataset)
    if inner is None or depth > 100:
        return True
    return any(fetches_batches(d, depth + 1) for d in inner)


class MapFetcher:
    """Fetches samples of a map-style dataset by index and collates them."""

    def __init__(
        self,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Callable[[Any], Any],
        base_seed: int = 0,
        timed: bool = False,
        rank: int = 0,
        resume: Resume | None = None,
    ) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.base_seed = base_seed
        self.rank = rank
        self.timed = timed
        self.timing: tuple[int, float, float] = (0, 0.0, 0.0)  # the last fetch's (samples, fetch_s, collate_s)
        self._getitems = getattr(dataset, "__getitems__", None) if auto_collation and fetches_batches(dataset) else None
        # a Stateful dataset reports its state with every batch: a fetch cannot be replayed
        # without the indices of the batches before it, so no batch goes without a snapshot
        self.stateful = is_stateful(dataset)
        self._resume = resume if self.stateful else None  # its state, to load before the first fetch
        # the loader's own dataset (num_workers=0): nothing is fetched ahead of the consumer, so
        # its state is asked for when the loader's state is (`snapshot_now`), not per batch
        self.live = False

    def reset(self) -> None:
        """A new epoch; map-style fetching keeps no state of its own."""

    def restore_now(self) -> None:
        """Put the resumed dataset's state back now rather than at the first fetch (the
        loader's own dataset, with num_workers=0: the state holds even if no fetch follows)."""
        resume, self._resume = self._resume, None
        if resume is not None and resume.dataset is not None:
            self.dataset.load_state_dict(resume.dataset_state())

    def fetch(self, index: Any, epoch: int = 0, batch: int = 0) -> Any:
        if not self.stateful:
            return self._fetch(index, epoch, batch)
        if self._resume is not None:
            resume, self._resume = self._resume, None
            if resume.dataset is not None:
                self.dataset.load_state_dict(resume.dataset_state())
        made = self._fetch(index, epoch, batch)
        return ReplicaBatch(made, Record(False) if self.live else take(self.dataset, None, 0))

    def snapshot_now(self) -> Record | None:
        """The dataset's state now, as a record (`live` replicas), or None without a state."""
        if not self.stateful or self._resume is not None:
            return None
        return take(self.dataset, None, 0)

    def _fetch(self, index: Any, epoch: int, batch: int) -> Any:
        batch = batch_key(batch, self.rank)
        scope = FetchScope(self.base_seed, epoch)
        previous = enter(scope)
        timed = self.timed
        start = clock() if timed else 0.0
        try:
            if not self.auto_collation:
                scope.at(SAMPLE, index)
                sample = self.dataset[index]
                scope.at(BATCH, batch)
                fetched = clock() if timed else 0.0
                made = self.collate_fn(sample)
                if timed:
                    self.timing = (1, fetched - start, clock() - fetched)
                return made
            if self._getitems is not None:
                scope.at(BATCH, batch)
                samples = self._getitems(index)
            else:
                dataset = self.dataset
                samples = []
                append = samples.append
                scope.tag = SAMPLE
                for i in index:
                    scope.key = i  # this sample's seed, made only if asked for
                    scope.made = None
                    append(dataset[i])
                scope.at(BATCH, batch)
            fetched = clock() if timed else 0.0
            made = self.collate_fn(samples)
            if timed:
                self.timing = (len(samples), fetched - start, clock() - fetched)
            return made
        finally:
            leave(previous)


class IterableFetcher:
    """Draws samples from one replica of an iterable dataset and collates them.

    The replica's iterator is created at the first fetch of each epoch, so an exception in
    the dataset's `__iter__` is reported against the batch that needed it.
    """

    def __init__(
        self,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Callable[[Any], Any],
        drop_last: bool,
        base_seed: int = 0,
        worker_id: int = 0,
        resume: Resume | None = None,
        timed: bool = False,
        rank: int = 0,
        snapshot_every: int = 1,
    ) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.base_seed = base_seed
        # what this replica's item seeds are keyed by: ranks share the base seed, and their
        # replicas make different items
        self.worker_id: Any = worker_id if rank == 0 else (worker_id, rank)
        self.rank = rank
        self.timed = timed
        self.timing: tuple[int, float, float] = (0, 0.0, 0.0)  # the last fetch's (samples, fetch_s, collate_s)
        self._iterator: Iterator[Any] | None = None
        self._ended = False
        self._reported_end = False
        self._drawn = 0  # items the replica made this epoch: the key of the next one's seed
        # the objects whose state a snapshot takes: the dataset, and its iterator when that is
        # another object (`_stateful_iterator`, once made); any other dataset is a stream
        # without state, whatever methods it has, replayed on a resume
        self._stateful_dataset = dataset if is_stateful(dataset) else None
        self._stateful_iter: Any = None
        self._snapshot_every = snapshot_every
        self._batches = 0  # batches made this epoch: every `snapshot_every`-th takes a snapshot
        self._resume = resume  # where a resumed replica continues, put back before its first fetch
        # the loader's own dataset (num_workers=0): nothing is drawn ahead of the consumer, so
        # its state is asked for when the loader's state is (`snapshot_now`), not per batch
        self.live = False

    @property
    def stateful(self) -> bool:
        """The replica's dataset or iterator keeps a state (else a resume replays it)."""
        return self._stateful_dataset is not None or self._stateful_iter is not None

    def restore_now(self) -> None:
        """Put the resumed dataset's own state back now rather than at the first fetch (the
        loader's own dataset, with num_workers=0: the state holds even if no fetch follows);
        its iterator's state and the replay wait for the first fetch."""
        resume = self._resume
        if resume is not None and resume.dataset is not None and self._stateful_dataset is not None:
            self._stateful_dataset.load_state_dict(resume.dataset_state())
            self._resume = replace(resume, dataset=None)

    def reset(self) -> None:
        """Start a new epoch: the next fetch iterates the dataset afresh (a resumed replica
        that fetched nothing in its resumed epoch starts it from the dataset's state alone)."""
        if self._resume is not None:
            self._resume = Resume(self._resume.dataset, None, 0, 0, False)
        self._iterator = None
        self._stateful_iter = None
        self._ended = False
        self._reported_end = False
        self._drawn = 0
        self._batches = 0

    def fetch(self, count: int | None, epoch: int = 0, batch: int = 0) -> Any:
        if self._ended:
            raise EndOfStream(self._end_record())
        scope = FetchScope(self.base_seed, epoch)
        previous = enter(scope)
        try:
            made = self._fetch(scope, count, batch_key(batch, self.rank))
        except EndOfStream:
            raise EndOfStream(self._end_record()) from None
        finally:
            leave(previous)
        self._batches += 1
        if self._ended:  # the stream ended inside this batch: its state now is its end's
            return ReplicaBatch(made, self._end_record())
        every = self._snapshot_every
        if self.stateful and every and not self.live and self._batches % every == 0:
            return ReplicaBatch(made, take(self._stateful_dataset, self._stateful_iter, self._drawn))
        return ReplicaBatch(made, Record(False, drawn=self._drawn))

    def snapshot_now(self) -> Record | None:
        """The replica's state now, as a record (`live` replicas); None when there is nothing
        newer than what the loader keeps: no state, its epoch not begun or ended, or a resume
        not yet put back."""
        if not self.stateful or self._iterator is None or self._ended or self._resume is not None:
            return None
        return take(self._stateful_dataset, self._stateful_iter, self._drawn)

    def _end_record(self) -> Record | None:
        """The state at the stream's end, once per epoch (always taken, as torchdata does)."""
        if self._reported_end:
            return None
        self._reported_end = True
        return take(self._stateful_dataset, self._stateful_iter, self._drawn, ended=True)

    def _start(self, scope: FetchScope) -> None:
        """Make the epoch's iterator; a resumed replica's states are loaded around `iter()`
        (the dataset's before, the iterator's after, as torchdata orders them) and the items
        drawn since its snapshot are drawn again and dropped."""
        resume, self._resume = self._resume, None
        if resume is not None and resume.dataset is not None and self._stateful_dataset is not None:
            self._stateful_dataset.load_state_dict(resume.dataset_state())
        if resume is not None and resume.ended:  # the dataset is as its stream left it
            self._drawn = resume.drawn
            self._ended = True
            self._reported_end = True  # the loader keeps that end already
            raise EndOfStream
        self._iterator = iterator = iter(self.dataset)
        if iterator is not self.dataset and is_stateful(iterator):
            self._stateful_iter = iterator
            if resume is not None and resume.iterator is not None:
                iterator.load_state_dict(resume.iterator_state())
        if resume is None:
            return
        drawn = resume.drawn - resume.replay
        scope.tag = ITEM
        try:
            while drawn < resume.drawn:
                scope.key = (self.worker_id, drawn)  # as when the item was first made
                scope.made = None
                next(iterator)
                drawn += 1
        except StopIteration:
            self._ended = True
            raise EndOfStream from None
        finally:
            self._drawn = drawn

    def _fetch(self, scope: FetchScope, count: int | None, batch: int) -> Any:
        worker_id = self.worker_id
        start = clock() if self.timed else 0.0
        if self._iterator is None:
            # A replica whose __iter__ raises reports it once and is then exhausted for the
            # epoch; calling __iter__ again for every later task would repeat the error.
            self._ended = True
            scope.at(ITEM, (worker_id,))
            self._start(scope)
            self._ended = False
        iterator = self._iterator
        assert iterator is not None
        if not self.auto_collation:
            scope.at(ITEM, (worker_id, self._drawn))
            try:
                sample = next(iterator)
            except StopIteration:
                self._ended = True
                raise EndOfStream from None
            self._drawn += 1
            scope.at(BATCH, batch)
            return self._collate(sample, 1, start)
        assert count is not None
        samples: list[Any] = []
        append = samples.append
        scope.tag = ITEM
        drawn = self._drawn
        try:
            for _ in range(count):
                scope.key = (worker_id, drawn)  # this item's seed, made only if asked for
                scope.made = None
                append(next(iterator))
                drawn += 1
        except StopIteration:
            self._ended = True
            if not samples or self.drop_last:
                raise EndOfStream from None
        finally:
            self._drawn = drawn
        scope.at(BATCH, batch)
        return self._collate(samples, len(samples), start)

    def _collate(self, samples: Any, count: int, start: float) -> Any:
        if not self.timed:
            return self.collate_fn(samples)
        fetched = clock()
        made = self.collate_fn(samples)
        self.timing = (count, fetched - start, clock() - fetched)
        return made


def make_fetcher(
    dataset_kind: str,
    dataset: Any,
    auto_collation: bool,
    collate_fn: Callable[[Any], Any],
    drop_last: bool,
    base_seed: int = 0,
    worker_id: int = 0,
    resume: Resume | None = None,
    timed: bool = False,
    rank: int = 0,
    snapshot_every: int = 1,
) -> MapFetcher | IterableFetcher:
    """The fetcher for a dataset kind ("map" or "iterable"); `base_seed` and `worker_id`
    (and an iterable replica's training `rank`) are what `sample_seed()` / `sample_rng()`
    derive from (see seeding); `resume` is where the replica continues (see replica);
    `timed` keeps each fetch's `timing`; an iterable replica's state is taken every
    `snapshot_every` batches (0: only at its stream's end)."""
    if dataset_kind == "map":
        return MapFetcher(dataset, auto_collation, collate_fn, base_seed, timed, rank, resume)
    return IterableFetcher(
        dataset, auto_collation, collate_fn, drop_last, base_seed, worker_id, resume, timed, rank, snapshot_every
    )
