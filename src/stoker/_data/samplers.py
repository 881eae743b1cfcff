"""Samplers: which sample indices an epoch visits, and how they are grouped into batches.

Random samplers draw an epoch's whole order at their iterator's first step (as torch does),
so the order of an epoch is fixed by the state of their `RandomSource` at that moment and
"skip the first k indices" resumes an epoch exactly. `BatchSampler` adds MXNet's
`last_batch='rollover'`: the leftover indices of one epoch open the next.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, Generic, TypeVar

import numpy as np

from .._base.hooks import ResumableSampler, follows
from .rng import GeneratorLike, RandomSource

T_co = TypeVar("T_co", covariant=True)

LAST_BATCH_CHOICES = ("keep", "discard", "rollover")


def _positive_int(value: Any, name: str) -> None:
    # torch's own check: a ValueError whatever is wrong, and the value not repr'd
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} should be a positive integer value, but got {name}={value}")


class Sampler(Generic[T_co]):
    """Base class: an iterable over indices (or batches of indices) of a dataset.

    Subclasses define `__iter__`, and `__len__` where the length is known.

    Args:
        data_source: Accepted and ignored, as in torch (kept for subclasses that pass
            it on). Defaults to None.
    """

    def __init__(self, data_source: Sized | None = None) -> None:
        pass

    def __iter__(self) -> Iterator[T_co]:
        raise NotImplementedError(f"{type(self).__name__} must define __iter__")


class DrawsFromGenerator:
    """What the random samplers share: a `generator` attribute that reads back as given and,
    set (by the sampler's constructor, or by a framework: accelerate gives each rank one
    synchronised generator), starts a new `RandomSource` for the flavour's draws."""

    _flavour = "numpy"  # where generator=None draws: numpy's global RNG ("torch": torch's)
    _source: RandomSource

    @property
    def generator(self) -> GeneratorLike:
        """The generator the order is drawn from, as given; setting it starts a new source."""
        return self._source.generator

    @generator.setter
    def generator(self, generator: GeneratorLike) -> None:
        self._source = RandomSource(generator, type(self)._flavour)


class SequentialSampler(Sampler[int]):
    """Indices 0, 1, ..., len(data_source) - 1, in order.

    Args:
        data_source: The dataset (anything with a `__len__`), read for its length at
            each epoch.
    """

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def _iter_from(self, skip: int) -> Iterator[int]:
        return iter(range(skip, len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler(DrawsFromGenerator, Sampler[int]):
    """A random order of the dataset's indices; with `replacement`, `num_samples` draws.

    The epoch's order is drawn at its iterator's first step, as in torch.

    Args:
        data_source: The dataset (anything with a `__len__`).
        replacement: Draw `num_samples` indices independently (with repeats) instead of
            permuting. Defaults to False.
        num_samples: How many indices an epoch yields; None means `len(data_source)`.
            Without replacement, a number above the length yields whole permutations
            one after another. Defaults to None.
        generator: Where the order comes from: an int seed, a `numpy.random.Generator`, or a
            `torch.Generator` (then the sequence is torch's exactly, for the same seed).
            None seeds each epoch from the flavour's global RNG (numpy's; torch's in
            `stoker.torch`). Defaults to None.

    Raises:
        TypeError: when `replacement` is not a bool, or `generator` is of another kind.
        ValueError: when `num_samples` is not a positive int, when the dataset is empty
            and `num_samples` is None, or when an int seed is negative.
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: GeneratorLike = None,
    ) -> None:
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        if not isinstance(self.replacement, bool):
            raise TypeError(f"replacement should be a boolean value, but got replacement={self.replacement}")
        if num_samples is not None:
            _positive_int(num_samples, "num_samples")
        elif len(data_source) <= 0:
            raise ValueError(f"num_samples should be a positive integer value, but got num_samples={len(data_source)}")

    @property
    def num_samples(self) -> int:
        """The number of indices an epoch yields."""
        return len(self.data_source) if self._num_samples is None else int(self._num_samples)

    def __iter__(self) -> Iterator[int]:
        yield from self._order()

    def _iter_from(self, skip: int) -> Iterator[int]:
        return iter(self._order()[skip:])

    def _order(self) -> list[int]:
        n = len(self.data_source)
        draws = self._source.fresh_draws()
        if self.replacement:
            return draws.integers(n, self.num_samples)
        order: list[int] = []
        for _ in range(self.num_samples // n):
            order += draws.permutation(n)
        order += draws.permutation(n)[: self.num_samples % n]
        return order

    def __len__(self) -> int:
        return self.num_samples


class SubsetRandomSampler(DrawsFromGenerator, Sampler[int]):
    """The given indices in a random order, without replacement.

    Args:
        indices: The indices to permute; each epoch yields all of them once.
        generator: Where the order comes from: an int seed, a `numpy.random.Generator`, or a
            `torch.Generator` (then the sequence is torch's exactly, for the same seed).
            None draws from the flavour's global RNG (numpy's; torch's in
            `stoker.torch`). Defaults to None.

    Raises:
        TypeError: when `generator` is of another kind.
        ValueError: when an int seed is negative.
    """

    def __init__(self, indices: Sequence[int], generator: GeneratorLike = None) -> None:
        self.indices = indices
        self.generator = generator

    def __iter__(self) -> Iterator[int]:
        indices = self.indices
        order = self._source.draws().permutation(len(indices))
        yield from (indices[i] for i in order)

    def _iter_from(self, skip: int) -> Iterator[int]:
        indices = self.indices
        order = self._source.draws().permutation(len(indices))
        return (indices[i] for i in order[skip:])

    def __len__(self) -> int:
        return len(self.indices)


class WeightedRandomSampler(DrawsFromGenerator, Sampler[int]):
    """`num_samples` indices drawn with probability proportional to `weights`.

    Args:
        weights: One non-negative, finite weight per index (a sequence, an array or a
            tensor), not all zero; they need not sum to 1.
        num_samples: How many indices an epoch yields.
        replacement: Draw with replacement (an index may repeat). Without it, an index
            appears at most once. Defaults to True.
        generator: Where the draws come from: an int seed, a `numpy.random.Generator`, or a
            `torch.Generator` (then the sequence is torch's exactly, for the same seed).
            None draws from the flavour's global RNG (numpy's; torch's in
            `stoker.torch`). Defaults to None.

    Raises:
        ValueError: when `num_samples` is not a positive int, `replacement` is not a
            bool, `weights` is not 1-d, has a negative or non-finite value or sums to 0,
            or when `num_samples` exceeds the non-zero weights without replacement.
        TypeError: when `generator` is of another kind.
    """

    def __init__(
        self,
        weights: Sequence[float],
        num_samples: int,
        replacement: bool = True,
        generator: GeneratorLike = None,
    ) -> None:
        _positive_int(num_samples, "num_samples")
        if not isinstance(replacement, bool):
            raise ValueError(f"replacement should be a boolean value, but got replacement={replacement}")
        array = np.asarray(weights.numpy() if hasattr(weights, "numpy") else weights, dtype=np.float64)
        if array.ndim != 1:
            raise ValueError(f"weights should be a 1d sequence but given weights have shape {tuple(array.shape)}")
        if (array < 0).any() or not np.isfinite(array).all() or array.sum() <= 0:
            raise ValueError("weights should be finite, non-negative and not all zero")
        if not replacement and num_samples > np.count_nonzero(array):
            raise ValueError(
                f"num_samples={num_samples} cannot be drawn without replacement from "
                f"{np.count_nonzero(array)} non-zero weights"
            )
        self.weights = weights if type(self)._flavour == "torch" else array
        self._array = array
        self.num_samples = int(num_samples)
        self.replacement = replacement
        self.generator = generator

    def __iter__(self) -> Iterator[int]:
        yield from self._source.draws().multinomial(self._array, self.num_samples, self.replacement)

    def _iter_from(self, skip: int) -> Iterator[int]:
        return iter(self._source.draws().multinomial(self._array, self.num_samples, self.replacement)[skip:])

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler(Sampler[list[int]]):
    """Groups another sampler's indices into lists of `batch_size`.

    `last_batch` says what happens to a short final batch: 'keep' it (the default,
    `drop_last=False`), 'discard' it (`drop_last=True`), or 'rollover' (MXNet): carry its
    indices into the first batch of the next epoch.

    Args:
        sampler: The sampler (or any iterable of indices) to group.
        batch_size: The number of indices in a batch.
        drop_last: Drop the short final batch of an epoch; the same as
            `last_batch='discard'`. Defaults to False.
        last_batch: 'keep', 'discard' or 'rollover'; None means what `drop_last` says.
            Defaults to None.

    Raises:
        ValueError: when `batch_size` is not a positive int, `drop_last` is not a bool,
            `last_batch` is not one of the three, or `drop_last=True` comes with a
            `last_batch` other than 'discard'.
    """

    def __init__(
        self,
        sampler: Sampler[int] | Iterable[int],
        batch_size: int,
        drop_last: bool = False,
        *,
        last_batch: str | None = None,
    ) -> None:
        _positive_int(batch_size, "batch_size")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        if last_batch is None:
            last_batch = "discard" if drop_last else "keep"
        elif last_batch not in LAST_BATCH_CHOICES:
            raise ValueError(f"last_batch should be one of {LAST_BATCH_CHOICES}, but got last_batch={last_batch!r}")
        elif drop_last and last_batch != "discard":
            raise ValueError(
                f"drop_last=True contradicts last_batch={last_batch!r}; give one of them "
                "(drop_last=True is last_batch='discard')"
            )
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.last_batch = last_batch
        self.drop_last = last_batch == "discard"
        self._leftover: list[int] = []

    @property
    def rollover_indices(self) -> list[int]:
        """Indices carried into the next epoch's first batch (rollover only)."""
        return list(self._leftover)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state across epochs: the rollover indices.

        Returns:
            A dict with `rollover_indices`, the indices carried into the next epoch
            (empty unless `last_batch='rollover'`).
        """
        return {"rollover_indices": list(self._leftover)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned.

        Args:
            state: A dict from `state_dict`; a missing `rollover_indices` means none.
        """
        self._leftover = [int(i) for i in state.get("rollover_indices", [])]

    def _iter_from(self, skip: int) -> Iterator[list[int]]:
        """The batches from the skip-th on, the sampler's draw made now; the skipped indices
        are stepped over in C (or sliced off, for stoker's samplers), not batched."""
        size = self.batch_size
        carried: list[int] = []
        if self.last_batch == "rollover" and self._leftover:
            carried, self._leftover = self._leftover, []
        step = max(0, skip * size - len(carried)) if skip else 0
        if skip:
            carried = []
        sampler: Any = self.sampler
        if follows(sampler, ResumableSampler):
            indices = sampler._iter_from(step)
        else:
            indices = iter(self.sampler)
            next(itertools.islice(indices, step, step), None)
        return self._batches(indices, carried)

    def __iter__(self) -> Iterator[list[int]]:
        # a generator, as torch's: the sampler's iterator is made at the first step, after
        # the loader has drawn its base seed from a generator the two may share
        carried: list[int] = []
        if self.last_batch == "rollover" and self._leftover:
            carried, self._leftover = self._leftover, []
        yield from self._batches(iter(self.sampler), carried)

    def _batches(self, indices: Iterator[int], carried: list[int]) -> Iterator[list[int]]:
        size = self.batch_size
        if carried:
            batch = carried + list(itertools.islice(indices, size - len(carried)))
            if len(batch) < size:
                self._leftover = batch
                return
            yield batch
        while True:
            batch = list(itertools.islice(indices, size))  # C-speed chunking
            if len(batch) < size:
                break
            yield batch
        if batch:
            if self.last_batch == "keep":
                yield batch
            elif self.last_batch == "rollover":
                self._leftover = batch

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        if self.last_batch == "rollover":
            return (n + len(self._leftover)) // self.batch_size
        if self.drop_last:
            return n // self.batch_size
        return (n + self.batch_size - 1) // self.batch_size


class BatchesOf(BatchSampler):
    """stoker's view of another library's plain batch sampler (torch's `BatchSampler`): the
    same batches, read live from it (its sampler may be replaced after the loader is made),
    with stoker's skip-without-fetching for resume."""

    def __init__(self, batches: Any) -> None:
        self._of = batches
        self._leftover = []

    @property
    def sampler(self) -> Any:  # type: ignore[override]
        return self._of.sampler

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return int(self._of.batch_size)

    @property
    def drop_last(self) -> bool:  # type: ignore[override]
        return bool(self._of.drop_last)

    @property
    def last_batch(self) -> str:  # type: ignore[override]
        return "discard" if self._of.drop_last else "keep"


def native_index_sampler(index_sampler: Any) -> Any:
    """The index sampler stoker iterates for `index_sampler`: torch's own `BatchSampler`
    (exactly that class, whose batches are plain chunks of its sampler) as a `BatchesOf`
    view; anything else as it is."""
    torch_data = sys.modules.get("torch.utils.data")
    if torch_data is not None and type(index_sampler) is torch_data.BatchSampler:
        return BatchesOf(index_sampler)
    return index_sampler


class InfiniteConstantSampler(Sampler[None]):
    """Yields None forever: the index sampler of an IterableDataset."""

    def __iter__(self) -> Iterator[None]:
        while True:
            yield None
