"""Collation: a list of samples becomes one batch. This is the type-preserving flavour.

numpy leaves stay numpy, torch tensors stay tensors (torch is imported only when a sample
holds one), Python numbers become numpy arrays, strings and None stay lists; mappings,
namedtuples, dataclasses and sequences are rebuilt with their own type where possible.
`collate(batch, collate_fn_map=...)` dispatches on the first sample's type — exact type
first, then `isinstance` in registration order — so users extend it per type, as with
torch's `collate_fn_map`.

Every array output is allocated through `allocator`: process workers point it into a
shared-memory slot, so a stacked batch is written once, straight where the main process
will read it.

Errors say what and where: `sample['image'][1]` is the path inside a sample.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import dataclasses
import operator
import sys
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import numpy as np

from .errors import CollateTypeError, CollateValueError, _Located

CollateFnMap = dict[Any, Callable[..., Any]]
Alloc = Callable[[tuple[int, ...], Any], np.ndarray]

_ALLOC: ContextVar[Alloc | None] = ContextVar("stoker_collate_alloc", default=None)


@contextlib.contextmanager
def allocator(alloc: Alloc) -> Iterator[None]:
    """Within the block, collation allocates its array outputs with `alloc(shape, dtype)`."""
    token = _ALLOC.set(alloc)
    try:
        yield
    finally:
        _ALLOC.reset(token)


def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised output array from the current allocator."""
    alloc = _ALLOC.get()
    return np.empty(shape, dtype) if alloc is None else alloc(shape, dtype)


# ----------------------------------------------------------------- error paths
@contextlib.contextmanager
def at(key: Any) -> Iterator[None]:
    """Prefix `key` to the path of a collate error raised inside the block."""
    try:
        yield
    except _Located as exc:
        exc.path.insert(0, key)
        raise


def first_mismatch(batch: Sequence[Any], get: Callable[[Any], Any]) -> tuple[int, Any, Any]:
    """(position, value of sample 0, value of that sample) of the first sample that differs."""
    ref = get(batch[0])
    for i, item in enumerate(batch):
        value = get(item)
        if value != ref:
            return i, ref, value
    return -1, ref, ref


def _check_same_type(batch: Sequence[Any], kind: type | tuple[type, ...], what: str) -> bool:
    """Raise unless every sample is a `kind`; whether they are all of one type."""
    if len(set(map(type, batch))) == 1:
        return True
    for i, item in enumerate(batch):
        if not isinstance(item, kind):
            raise CollateTypeError(
                f"sample 0 has {what} ({type(batch[0]).__name__}) but sample {i} has {type(item).__name__}"
            )
    return False


# --------------------------------------------------------------- dispatch
def lookup(elem: Any, collate_fn_map: CollateFnMap | None) -> Callable[..., Any] | None:
    """The registered function for `elem`'s type: exact type first, then isinstance."""
    if not collate_fn_map:
        return None
    fn = collate_fn_map.get(type(elem))
    if fn is not None:
        return fn
    for kind, fn in collate_fn_map.items():
        if isinstance(elem, kind):
            return fn
    return None


def collate_containers(
    batch: Sequence[Any],
    recurse: Callable[[Sequence[Any]], Any],
    tuple_as_list: bool,
    dataclasses_too: bool,
    transposed_as_tuples: bool = False,
) -> Any:
    """Collate a batch of containers by collating each field with `recurse`.

    The fields of sequences reach `recurse` as lists, or as tuples with
    `transposed_as_tuples` (torch's behaviour, visible when a field is a string: its batch
    stays the tuple). Returns NotImplemented when the first sample is not a container this
    handles.
    """
    column = tuple if transposed_as_tuples else list
    elem = batch[0]
    elem_type = type(elem)
    if isinstance(elem, collections.abc.Mapping):
        one_type = _check_same_type(batch, collections.abc.Mapping, "a mapping")
        keys = list(elem)
        columns = None
        # dicts of one length that all hold sample 0's keys hold the same keys: lengths and
        # look-ups at C speed (comparing the key views cost as much as the whole collation)
        if one_type and type(elem) is dict and len(set(map(len, batch))) == 1:
            try:
                columns = [list(map(operator.itemgetter(key), batch)) for key in keys]
            except KeyError:
                pass
        if columns is None:
            elem_keys = elem.keys()
            for i, d in enumerate(batch):
                if d.keys() != elem_keys:
                    raise CollateValueError(f"sample 0 has keys {keys} but sample {i} has keys {list(d)}")
            columns = [list(map(operator.itemgetter(key), batch)) for key in keys]
        fields = {}
        for key, column_values in zip(keys, columns):
            try:
                fields[key] = recurse(column_values)
            except _Located as exc:  # as `at(key)` does, without a context manager per field
                exc.path.insert(0, key)
                raise
        try:
            if isinstance(elem, collections.abc.MutableMapping):
                mapping = copy.copy(elem)
                mapping.update(fields)
                return mapping
            return elem_type(fields)
        except TypeError:
            return fields
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        _check_same_type(batch, elem_type, f"a {elem_type.__name__}")
        out = []
        for name, samples in zip(elem._fields, zip(*batch)):
            with at(name):
                out.append(recurse(column(samples)))
        return elem_type(*out)
    if dataclasses_too and dataclasses.is_dataclass(elem) and not isinstance(elem, type):
        _check_same_type(batch, elem_type, f"a {elem_type.__name__}")
        values = {}
        for f in dataclasses.fields(elem):
            with at(f.name):
                values[f.name] = recurse([getattr(s, f.name) for s in batch])
        try:
            return elem_type(**values)
        except TypeError:
            instance = copy.copy(elem)
            for name, value in values.items():
                object.__setattr__(instance, name, value)
            return instance
    if isinstance(elem, collections.abc.Sequence) and not isinstance(elem, (str, bytes)):
        _check_same_type(batch, collections.abc.Sequence, "a sequence")
        i, ref, got = first_mismatch(batch, len)
        if i >= 0:
            raise CollateValueError(
                f"each sample should be a sequence of the same length, but sample 0 has length "
                f"{ref} and sample {i} has length {got}"
            )
        out = []
        for position, samples in enumerate(zip(*batch)):
            with at(position):
                out.append(recurse(column(samples)))
        if isinstance(elem, tuple):
            return out if tuple_as_list else tuple(out)
        try:
            if isinstance(elem, collections.abc.MutableSequence):
                sequence = copy.copy(elem)
                for position, value in enumerate(out):
                    sequence[position] = value
                return sequence
            return elem_type(out)
        except TypeError:
            return out
    return NotImplemented


# ------------------------------------------------------------- numpy leaves
_PLAIN_ARRAYS = {np.ndarray}


def stack_uniform(batch: Sequence[Any]) -> np.ndarray | None:
    """The batch stacked on a new first axis into one allocated output, when every sample
    is a plain ndarray of sample 0's shape and dtype (the common case); else None, and the
    caller's checking path decides what to do.

    The checks run at C speed: `np.stack` makes a view per sample and the Python loop
    that checked each sample cost more than the copy on batches of small arrays.
    `concatenate` checks every dimension but the first and the dtype (`casting="no"`); the
    first is checked by `len`, so samples cannot make up each other's lengths.
    """
    elem = batch[0]
    shape = elem.shape
    if not shape or set(map(type, batch)) != _PLAIN_ARRAYS:
        return None  # 0-d arrays, subclasses and mixed types take the checking path
    try:
        if set(map(len, batch)) != {shape[0]}:
            return None
    except TypeError:  # a 0-d array among them
        return None
    out = empty((len(batch), *shape), elem.dtype)
    try:
        np.concatenate(batch, axis=0, out=out.reshape((len(batch) * shape[0], *shape[1:])), casting="no")
    except (TypeError, ValueError):  # another dtype or shape: `out` is dropped unread
        return None
    return out


def stack_arrays(batch: Sequence[np.ndarray]) -> np.ndarray:
    """Stack equal-shape arrays on a new first axis, into one allocated output."""
    elem = batch[0]
    if elem.dtype.hasobject:
        raise CollateTypeError(f"cannot collate numpy arrays of dtype {elem.dtype} (object)")
    fast = stack_uniform(batch)
    if fast is not None:
        return fast
    shape, dtype = elem.shape, elem.dtype
    same_dtype = True
    for i, a in enumerate(batch):
        if type(a) is not np.ndarray and not isinstance(a, np.ndarray):
            raise CollateTypeError(f"sample 0 has a numpy array but sample {i} has {type(a).__name__}")
        if a.shape != shape:
            raise CollateValueError(
                f"cannot stack arrays of different shapes: {shape} in sample 0 vs {a.shape} in sample {i}"
            )
        if a.dtype != dtype:
            same_dtype = False
    if not same_dtype:
        dtype = np.result_type(*batch)
    out = empty((len(batch), *shape), dtype)
    np.stack(batch, out=out)
    return out


def _numbers(batch: Sequence[Any], dtype: Any) -> np.ndarray:
    values = np.array(batch)
    if values.dtype.hasobject or values.ndim != 1:
        kinds = sorted({type(v).__name__ for v in batch})
        raise CollateTypeError(f"samples mix types that do not make one array: {kinds}")
    if dtype is not None and values.dtype.kind == np.dtype(dtype).kind:
        values = values.astype(dtype, copy=False)
    if _ALLOC.get() is None:
        return values
    out = empty(values.shape, values.dtype)
    out[...] = values
    return out


def collate_numpy_array(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return stack_arrays(batch)


def collate_numpy_scalar(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return _numbers(batch, batch[0].dtype)


def collate_bool(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return _numbers(batch, np.bool_)


def collate_int(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return _numbers(batch, np.int64)


def collate_float(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return _numbers(batch, np.float64)


def collate_complex(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return _numbers(batch, np.complex128)


def collate_as_list(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return list(batch)


# ------------------------------------------------------------- torch leaves
def stack_tensors(batch: Sequence[Any]) -> Any:
    """torch.stack, writing into the current allocator's memory when there is one."""
    import torch

    elem = batch[0]
    if elem.is_nested or elem.layout is not torch.strided:
        raise CollateTypeError(f"cannot collate {elem.layout} or nested tensors")
    shape = elem.shape
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor):
            raise CollateTypeError(f"sample 0 has a tensor but sample {i} has {type(t).__name__}")
        if t.shape != shape:
            raise CollateValueError(
                f"cannot stack tensors of different shapes: {tuple(shape)} in sample 0 vs "
                f"{tuple(t.shape)} in sample {i}"
            )
    out = None
    if _ALLOC.get() is not None and elem.device.type == "cpu" and all(t.dtype == elem.dtype for t in batch):
        try:
            np_dtype = torch.empty((), dtype=elem.dtype).numpy().dtype
        except TypeError:
            np_dtype = None
        if np_dtype is not None:
            out = torch.from_numpy(empty((len(batch), *shape), np_dtype))
    return torch.stack(list(batch), 0, out=out)


def _collate_tensor(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return stack_tensors(batch)


default_collate_fn_map: CollateFnMap = {
    np.ndarray: collate_numpy_array,
    (np.bool_, np.number): collate_numpy_scalar,
    bool: collate_bool,
    int: collate_int,
    float: collate_float,
    complex: collate_complex,
    str: collate_as_list,
    bytes: collate_as_list,
    type(None): collate_as_list,
}
"""The functions `default_collate` dispatches to, keyed by sample type.

A key is a type or a tuple of types; a value is called as `fn(batch, collate_fn_map=...)`.
Copy it, add your types, and pass the copy to `collate` to extend `default_collate`.
"""


def collate(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """Collate `batch` with the functions registered in `collate_fn_map`, recursing into
    containers (type-preserving: a tuple stays a tuple).

    The first sample's type picks the function: its exact type first, then `isinstance`
    in the map's order. Torch tensors are stacked; mappings, namedtuples, dataclasses and
    sequences are collated field by field and rebuilt with their own type.

    Args:
        batch: The samples, a non-empty sequence.
        collate_fn_map: Functions keyed by sample type (see `default_collate_fn_map`);
            None collates only tensors and containers. Defaults to None.

    Returns:
        The batch, with the samples' structure.

    Raises:
        ValueError: when the batch is empty, or samples do not line up (arrays of
            different shapes, sequences of different lengths); the message names the
            path inside the sample.
        TypeError: when a sample holds a type nothing collates, or types differ across
            samples.
    """
    if len(batch) == 0:
        raise CollateValueError("cannot collate an empty batch")
    elem = batch[0]
    fn = lookup(elem, collate_fn_map)
    if fn is not None:
        return fn(batch, collate_fn_map=collate_fn_map)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(elem, torch.Tensor):
        return stack_tensors(batch)
    out = collate_containers(
        batch, lambda b: collate(b, collate_fn_map=collate_fn_map), tuple_as_list=False, dataclasses_too=True
    )
    if out is NotImplemented:
        raise CollateTypeError(
            "batch must contain numpy arrays, tensors, numbers, strings, dicts, dataclasses or "
            f"sequences; found {type(elem).__module__}.{type(elem).__qualname__}"
        )
    return out


def default_collate(batch: Sequence[Any]) -> Any:
    """Stack a list of samples into a batch, keeping numpy as numpy and tensors as tensors.

    numpy arrays and tensors are stacked on a new first axis, Python numbers become numpy
    arrays, strings, bytes and None stay lists; containers keep their type.

    Args:
        batch: The samples, a non-empty sequence.

    Returns:
        The batch, with the samples' structure.

    Raises:
        TypeError: when a sample holds an unsupported type, or types differ across
            samples; the message names the path inside the sample.
        ValueError: when the batch is empty, or samples are ragged (arrays of different
            shapes, sequences of different lengths); the message names the path.
    """
    return collate(batch, collate_fn_map=default_collate_fn_map)


def default_convert(data: Any) -> Any:
    """The `batch_size=None` conversion: type-preserving, so samples pass through unchanged.

    Args:
        data: One sample.

    Returns:
        `data` itself.
    """
    return data
