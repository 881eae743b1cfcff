"""Fetchers: turn a task's index into a collated batch. Shared by every engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class EndOfStream(Exception):
    """The iterable dataset replica has no further batch this epoch."""


class MapFetcher:
    """Fetches samples of a map-style dataset by index and collates them."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any]) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self._getitems = getattr(dataset, "__getitems__", None) if auto_collation else None

    def reset(self) -> None:
        """A new epoch; map-style fetching keeps no state."""

    def fetch(self, index: Any) -> Any:
        if not self.auto_collation:
            return self.collate_fn(self.dataset[index])
        if self._getitems is not None:
            samples = self._getitems(index)
        else:
            dataset = self.dataset
            samples = [dataset[i] for i in index]
        return self.collate_fn(samples)


class IterableFetcher:
    """Draws samples from one replica of an iterable dataset and collates them.

    The replica's iterator is created at the first fetch of each epoch, so an exception in
    the dataset's `__iter__` is reported against the batch that needed it.
    """

    def __init__(
        self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any], drop_last: bool
    ) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self._iterator: Iterator[Any] | None = None
        self._ended = False

    def reset(self) -> None:
        """Start a new epoch: the next fetch iterates the dataset afresh."""
        self._iterator = None
        self._ended = False

    def fetch(self, count: int | None) -> Any:
        if self._ended:
            raise EndOfStream
        if self._iterator is None:
            # A replica whose __iter__ raises reports it once and is then exhausted for the
            # epoch; calling __iter__ again for every later task would repeat the error.
            self._ended = True
            self._iterator = iter(self.dataset)
            self._ended = False
        iterator = self._iterator
        if not self.auto_collation:
            try:
                sample = next(iterator)
            except StopIteration:
                self._ended = True
                raise EndOfStream from None
            return self.collate_fn(sample)
        assert count is not None
        samples: list[Any] = []
        append = samples.append
        try:
            for _ in range(count):
                append(next(iterator))
        except StopIteration:
            self._ended = True
            if not samples or self.drop_last:
                raise EndOfStream from None
        return self.collate_fn(samples)


def make_fetcher(
    dataset_kind: str, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any], drop_last: bool
) -> MapFetcher | IterableFetcher:
    """The fetcher for a dataset kind ("map" or "iterable")."""
    if dataset_kind == "map":
        return MapFetcher(dataset, auto_collation, collate_fn)
    return IterableFetcher(dataset, auto_collation, collate_fn, drop_last)
