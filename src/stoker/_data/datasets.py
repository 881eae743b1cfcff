"""Datasets: map-style (`Dataset`: index -> sample) and iterable (`IterableDataset`)."""

from __future__ import annotations

import bisect
import itertools
import math
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeGuard, TypeVar

from .errors import DatasetTypeError, DatasetValueError
from .rng import GeneratorLike, RandomSource

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


class Dataset(Generic[T_co]):
    """A map-style dataset: `dataset[i]` is sample i.

    Subclasses define `__getitem__` (and usually `__len__`, which the default samplers
    need); `__getitems__(indices)` may fetch a whole batch at once, and the DataLoader
    calls it when it exists. `dataset + other` is a `ConcatDataset` of the two.
    """

    def __getitem__(self, index: Any) -> T_co:
        raise NotImplementedError("Subclasses of Dataset should implement __getitem__.")

    def __add__(self, other: Dataset[T_co]) -> ConcatDataset[T_co]:
        return ConcatDataset([self, other])


class IterableDataset(Dataset[T_co], Iterable[T_co]):
    """A dataset read as a stream: subclasses define `__iter__`.

    With workers, each worker iterates its own replica of the dataset: shard it with
    `get_worker_info()` (or `shard_for`) so that each sample is read once.
    `dataset + other` is a `ChainDataset` of the two.
    """

    def __iter__(self) -> Iterator[T_co]:
        raise NotImplementedError("Subclasses of IterableDataset should implement __iter__.")

    def __add__(self, other: Dataset[T_co]) -> ChainDataset[T_co]:  # type: ignore[override]
        return ChainDataset([self, other])


def is_iterable_dataset(obj: Any) -> TypeGuard[Iterable[Any]]:
    """True for stoker's IterableDataset and torch's (torch is not imported for this)."""
    if isinstance(obj, IterableDataset):
        return True
    torch_data = sys.modules.get("torch.utils.data")
    return torch_data is not None and isinstance(obj, torch_data.IterableDataset)


def _length(obj: Any) -> int:
    if hasattr(obj, "shape"):
        return int(obj.shape[0]) if len(obj.shape) else 0
    return len(obj)


class TensorDataset(Dataset[tuple[Any, ...]]):
    """Sample i is `tuple(t[i] for t in tensors)`.

    Args:
        *tensors: Numpy arrays or torch tensors with the same first dimension.

    Raises:
        ValueError: when no tensor is given, or when the first dimensions differ (that
            one is also an `AssertionError`, which torch raises there).
    """

    def __init__(self, *tensors: Any) -> None:
        if not tensors:
            raise ValueError("TensorDataset needs at least one tensor or array")
        if any(_length(tensors[0]) != _length(t) for t in tensors):
            sizes = [_length(t) for t in tensors]
            raise DatasetValueError(f"Size mismatch between tensors: first dimensions {sizes}")
        self.tensors = tensors

    def __getitem__(self, index: Any) -> tuple[Any, ...]:
        return tuple(t[index] for t in self.tensors)

    def __len__(self) -> int:
        return _length(self.tensors[0])


class ArrayDataset(Dataset[Any]):
    """MXNet's ArrayDataset: one array (or list) gives its items; several give tuples.

    Args:
        *arrays: Arrays, tensors or lists of the same length. With one, sample i is
            `arrays[0][i]`; with several, `tuple(a[i] for a in arrays)`.

    Raises:
        ValueError: when no array is given, or when the lengths differ.
    """

    def __init__(self, *arrays: Any) -> None:
        if not arrays:
            raise ValueError("ArrayDataset needs at least one array or list")
        lengths = [_length(a) for a in arrays]
        if len(set(lengths)) != 1:
            raise ValueError(f"ArrayDataset needs arrays of equal length, but got lengths {lengths}")
        self.arrays = arrays
        self._length = lengths[0]

    def __getitem__(self, index: Any) -> Any:
        if len(self.arrays) == 1:
            return self.arrays[0][index]
        return tuple(a[index] for a in self.arrays)

    def __len__(self) -> int:
        return self._length


class ConcatDataset(Dataset[T_co]):
    """Several map-style datasets one after another.

    Index i falls in the first dataset whose running total of lengths exceeds it
    (`cumulative_sizes` holds those totals); negative indices count from the end.

    Args:
        datasets: The map-style datasets, each with a `__len__`.

    Raises:
        ValueError: when `datasets` is empty (also an `AssertionError`, as in torch).
        TypeError: when one of them is an iterable dataset: use `ChainDataset` (also an
            `AssertionError`, as in torch).
    """

    def __init__(self, datasets: Iterable[Dataset[T_co]]) -> None:
        self.datasets = list(datasets)
        if not self.datasets:
            raise DatasetValueError("datasets should not be an empty iterable")
        for d in self.datasets:
            if is_iterable_dataset(d):
                raise DatasetTypeError(
                    f"ConcatDataset does not support IterableDataset (got {type(d).__name__}); "
                    "use ChainDataset for iterable datasets"
                )
        self.cumulative_sizes = list(itertools.accumulate(len(d) for d in self.datasets))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.cumulative_sizes[-1]

    def __getitem__(self, index: int) -> T_co:
        if index < 0:
            if -index > len(self):
                raise ValueError("absolute value of index should not exceed dataset length")
            index = len(self) + index
        elif index >= len(self):
            raise IndexError(f"index {index} is out of range for a ConcatDataset of length {len(self)}")
        which = bisect.bisect_right(self.cumulative_sizes, index)
        offset = self.cumulative_sizes[which - 1] if which else 0
        return self.datasets[which][index - offset]


class ChainDataset(IterableDataset[T_co]):
    """Several iterable datasets one after another.

    The datasets are checked as they are iterated (and by `len()`), not when the chain is
    made, as in torch.

    Args:
        datasets: The iterable datasets, iterated in order.

    Raises:
        TypeError: on iteration or `len()`, when one of them is a map-style dataset: use
            `ConcatDataset` (also an `AssertionError`, as in torch).
    """

    def __init__(self, datasets: Iterable[Dataset[T_co]]) -> None:
        self.datasets = datasets

    def __iter__(self) -> Iterator[T_co]:
        for d in self.datasets:
            if not is_iterable_dataset(d):
                raise DatasetTypeError(
                    f"ChainDataset only supports IterableDataset, but got {type(d).__name__}; "
                    "use ConcatDataset for map-style datasets"
                )
            yield from d

    def __len__(self) -> int:
        total = 0
        for d in self.datasets:
            if not is_iterable_dataset(d):
                raise DatasetTypeError(
                    f"ChainDataset only supports IterableDataset, but got {type(d).__name__}; "
                    "use ConcatDataset for map-style datasets"
                )
            total += len(d)  # type: ignore[arg-type]
        return total


class Subset(Dataset[T_co]):
    """The samples of `dataset` at `indices`.

    The DataLoader fetches a batch from a Subset with `__getitems__`, so a subclass that
    overrides `__getitem__` must override `__getitems__` too; one that does not is refused
    when it is made (NotImplementedError, as torch does), rather than having its
    `__getitem__` silently bypassed. `__getitems__` may simply call `__getitem__` per index.

    Args:
        dataset: The map-style dataset to take samples from.
        indices: The indices in `dataset` of the subset's samples, in order: sample i of
            the subset is `dataset[indices[i]]`.

    Raises:
        NotImplementedError: when a subclass overrides `__getitem__` but not
            `__getitems__`.
    """

    def __init__(self, dataset: Dataset[T_co], indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = indices
        cls = type(self)
        if cls.__getitem__ is not Subset.__getitem__ and cls.__getitems__ is Subset.__getitems__:
            raise NotImplementedError(
                f"{cls.__name__} overrides __getitem__ but not __getitems__. "
                "When subclassing Subset and overriding __getitem__, you must also override "
                "__getitems__ to ensure DataLoader works correctly with your custom logic. "
                "A simple implementation:\n\n"
                "def __getitems__(self, indices):\n"
                "    return [self.__getitem__(idx) for idx in indices]"
            )

    def __getitem__(self, index: Any) -> T_co:
        if isinstance(index, list):
            return self.dataset[[self.indices[i] for i in index]]
        return self.dataset[self.indices[index]]

    def __getitems__(self, indices: list[int]) -> list[T_co]:
        wanted = [self.indices[i] for i in indices]
        getitems = getattr(self.dataset, "__getitems__", None)
        if callable(getitems):
            return getitems(wanted)
        return [self.dataset[i] for i in wanted]

    def __len__(self) -> int:
        return len(self.indices)


class StackDataset(Dataset[Any]):
    """Samples of several equal-length datasets side by side: a tuple (`*args`) or a dict
    (`**kwargs`).

    Args:
        *args: Datasets whose samples make tuples: sample i is
            `tuple(d[i] for d in args)`.
        **kwargs: Datasets whose samples make dicts: sample i is
            `{k: d[i] for k, d in kwargs.items()}`.

    Raises:
        ValueError: when both `args` and `kwargs` are given, when neither is, or when
            the datasets' lengths differ.
    """

    def __init__(self, *args: Dataset[Any], **kwargs: Dataset[Any]) -> None:
        if args and kwargs:
            raise ValueError(
                "Supported either ``tuple``- (via ``args``) or``dict``- (via ``kwargs``) like "
                "input/output, but both types are given."
            )
        if not args and not kwargs:
            raise ValueError("At least one dataset should be passed")
        parts = list(args) if args else list(kwargs.values())
        self._length = len(parts[0])  # type: ignore[arg-type]
        if any(self._length != len(d) for d in parts):  # type: ignore[arg-type]
            raise ValueError("Size mismatch between datasets")
        self.datasets: tuple[Any, ...] | dict[str, Any] = args if args else kwargs

    def __getitem__(self, index: Any) -> Any:
        if isinstance(self.datasets, dict):
            return {k: d[index] for k, d in self.datasets.items()}
        return tuple(d[index] for d in self.datasets)

    def _column(self, dataset: Any, indices: list[int]) -> list[Any]:
        getitems = getattr(dataset, "__getitems__", None)
        if not callable(getitems):
            return [dataset[i] for i in indices]
        items = getitems(indices)
        if len(items) != len(indices):
            raise ValueError(f"Nested dataset's output size mismatch. Expected {len(indices)}, got {len(items)}")
        return list(items)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        if isinstance(self.datasets, dict):
            columns = {k: self._column(d, indices) for k, d in self.datasets.items()}
            return [{k: col[j] for k, col in columns.items()} for j in range(len(indices))]
        cols = [self._column(d, indices) for d in self.datasets]
        return [tuple(col[j] for col in cols) for j in range(len(indices))]

    def __len__(self) -> int:
        return self._length


def _split_lengths(n: int, lengths: Sequence[int | float]) -> list[int]:
    if math.isclose(sum(lengths), 1) and sum(lengths) <= 1:
        sizes = []
        for i, fraction in enumerate(lengths):
            if fraction < 0 or fraction > 1:
                raise ValueError(f"Fraction at index {i} is not between 0 and 1")
            sizes.append(math.floor(n * fraction))
        for i in range(n - sum(sizes)):
            sizes[i % len(sizes)] += 1
        for i, size in enumerate(sizes):
            if size == 0:
                warnings.warn(
                    f"Length of split at index {i} is 0. This might result in an empty dataset.",
                    stacklevel=4,  # the caller of random_split (either flavour)
                )
        return sizes
    if any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in lengths):
        raise ValueError(
            f"lengths should be non-negative integers summing to the dataset's length, or fractions "
            f"summing to 1, but got lengths={list(lengths)}"
        )
    if sum(lengths) != n:
        raise ValueError("Sum of input lengths does not equal the length of the input dataset!")
    return [int(x) for x in lengths]


def random_split(
    dataset: Dataset[T], lengths: Sequence[int | float], generator: GeneratorLike = None
) -> list[Subset[T]]:
    """Split a dataset into non-overlapping random subsets of the given lengths or fractions.

    With a torch.Generator the subsets equal torch's `random_split` exactly. Fractions
    are floored, and the samples left over are given one each to the subsets in turn,
    from the first, as torch does; a split of length 0 warns.

    Args:
        dataset: The map-style dataset to split; it needs a `__len__`.
        lengths: The subsets' lengths, summing to `len(dataset)`, or fractions
            summing to 1.
        generator: Where the permutation comes from: an int seed, a
            `numpy.random.Generator` or a `torch.Generator`; None draws from numpy's
            global RNG (torch's in `stoker.torch`). Defaults to None.

    Returns:
        One `Subset` per entry of `lengths`, in that order.

    Raises:
        ValueError: when a fraction is outside [0, 1], when a length is not a
            non-negative int, or when the lengths do not sum to `len(dataset)`.
    """
    return split_randomly(dataset, lengths, generator, "numpy", Subset)


def split_randomly(
    dataset: Dataset[T],
    lengths: Sequence[int | float],
    generator: GeneratorLike,
    flavour: str,
    subset: type[Subset[T]],
) -> list[Subset[T]]:
    """`random_split` of either flavour: `flavour` picks the global RNG a missing generator
    means, `subset` the class of the subsets."""
    sizes = _split_lengths(len(dataset), lengths)  # type: ignore[arg-type]
    order = RandomSource(generator, flavour).draws().permutation(sum(sizes))
    return [subset(dataset, order[end - size : end]) for end, size in zip(itertools.accumulate(sizes), sizes)]
