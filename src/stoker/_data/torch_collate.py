"""Collation with torch's semantics: what `torch.utils.data.default_collate` returns.

numpy arrays, numpy scalars and Python numbers become tensors; tuples become lists;
strings stay lists; mappings, namedtuples and sequences recurse. The exception types are
torch's (TypeError for unsupported types, RuntimeError for ragged samples) and the
message also names the path inside the sample. Stacked tensors are written through
`_collate.empty`, so in a process worker they land straight in a shared-memory slot.
"""

from __future__ import annotations

import collections.abc
import copy
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .collate import (
    _ALLOC,
    CollateFnMap,
    CollateTypeError,
    CollateValueError,
    _Located,
    collate_containers,
    empty,
    lookup,
    stack_tensors,
    stack_uniform,
)

_STRING_OR_OBJECT = re.compile(r"[SaUO]")


class CollateRuntimeError(_Located, RuntimeError):
    """Samples do not line up (torch raises RuntimeError here; so do we, with the path)."""


def _numpy_equal(batch: Sequence[Any], dtype: Any) -> Any:
    """The numpy dtype that makes of `batch` exactly the tensor torch makes (`dtype` None:
    torch's inference), when numpy can, else None. numpy converts a list of Python numbers
    five times faster than `torch.as_tensor`."""
    kinds = set(map(type, batch))
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if dtype is None:
        return {int: np.int64, bool: np.bool_}.get(kind)
    import torch

    return np.float64 if kind is float and dtype == torch.float64 else None


def _tensor_from(batch: Sequence[Any], dtype: Any = None) -> Any:
    """torch.tensor / torch.as_tensor of a list of numbers, placed through the allocator."""
    import torch

    np_dtype = _numpy_equal(batch, dtype)
    if np_dtype is not None:
        out = empty((len(batch),), np_dtype)
        try:
            out[...] = batch
            return torch.from_numpy(out)
        except OverflowError:
            pass  # an int beyond int64: torch raises its own error below
    values = torch.tensor(batch, dtype=dtype) if dtype is not None else torch.as_tensor(batch)
    if _ALLOC.get() is None:
        return values
    try:
        np_dtype = values.numpy().dtype
    except TypeError:
        return values
    target = torch.from_numpy(empty(tuple(values.shape), np_dtype))
    target.copy_(values)
    return target


def _checked_stack(batch: Sequence[Any]) -> Any:
    try:
        return stack_tensors(batch)
    except CollateValueError as exc:
        raise CollateRuntimeError(exc.reason) from None


def collate_numpy_array(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    import torch

    elem = batch[0]
    if _STRING_OR_OBJECT.search(elem.dtype.str) is not None:
        raise CollateTypeError(
            f"batch must contain tensors, numpy arrays, numbers, dicts or lists; found {elem.dtype}"
        )
    if elem.dtype.isnative:
        fast = stack_uniform(batch)
        if fast is not None:
            try:
                return torch.from_numpy(fast)
            except TypeError:
                pass  # a dtype torch cannot wrap: let torch raise its own error below
    shape, dtype = elem.shape, elem.dtype
    uniform = True
    for i, a in enumerate(batch):
        if not isinstance(a, np.ndarray):
            raise CollateTypeError(f"sample 0 has a numpy array but sample {i} has {type(a).__name__}")
        if a.shape != shape or a.dtype != dtype:
            uniform = False
    if uniform and dtype.isnative:
        # Same result as stacking torch.as_tensor of each, without a tensor per sample.
        out = empty((len(batch), *shape), dtype)
        np.stack(batch, out=out)
        try:
            return torch.from_numpy(out)
        except TypeError:
            pass  # a dtype torch cannot wrap: let torch raise its own error below
    return _checked_stack([torch.as_tensor(b) for b in batch])


def collate_numpy_scalar(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return _tensor_from(batch)


def collate_float(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    import torch

    return _tensor_from(batch, torch.float64)


def collate_int(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return _tensor_from(batch)


def _collate_tensor(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return _checked_stack(batch)


def collate_str(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return batch


def _map() -> CollateFnMap:
    import torch

    return {
        torch.Tensor: _collate_tensor,
        np.ndarray: collate_numpy_array,
        np.memmap: collate_numpy_array,
        (np.bool_, np.number, np.object_): collate_numpy_scalar,
        float: collate_float,
        int: collate_int,
        str: collate_str,
        bytes: collate_str,
    }


_default_map: CollateFnMap | None = None


def default_collate_fn_map() -> CollateFnMap:
    """torch's `default_collate_fn_map`, keyed by the same types (torch is imported here)."""
    global _default_map
    if _default_map is None:
        _default_map = _map()
    return _default_map


def collate(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """torch's `collate`: dispatch on the first sample's type, recurse into containers."""
    elem = batch[0]
    fn = lookup(elem, collate_fn_map)
    if fn is not None:
        return fn(batch, collate_fn_map=collate_fn_map)
    if isinstance(elem, collections.abc.Sequence) and not isinstance(elem, (str, bytes)):
        it = iter(batch)
        size = len(next(it))
        if not all(len(e) == size for e in it):
            raise CollateRuntimeError("each element in list of batch should be of equal size")
    out = collate_containers(
        batch, lambda b: collate(b, collate_fn_map=collate_fn_map), tuple_as_list=True, dataclasses_too=False,
        transposed_as_tuples=True,
    )
    if out is NotImplemented:
        raise CollateTypeError(
            f"batch must contain tensors, numpy arrays, numbers, dicts or lists; found {type(elem)}"
        )
    return out


def default_collate(batch: Sequence[Any]) -> Any:
    """torch's `default_collate`: a list of samples becomes a batch of tensors."""
    return collate(batch, collate_fn_map=default_collate_fn_map())


def default_convert(data: Any) -> Any:
    """torch's `default_convert` (`batch_size=None`): numpy arrays and scalars become tensors."""
    import torch

    elem_type = type(data)
    if isinstance(data, torch.Tensor):
        return data
    if elem_type.__module__ == "numpy" and elem_type.__name__ not in ("str_", "string_"):
        if elem_type.__name__ in ("ndarray", "memmap") and _STRING_OR_OBJECT.search(data.dtype.str):
            return data
        return torch.as_tensor(data)
    if isinstance(data, collections.abc.Mapping):
        try:
            if isinstance(data, collections.abc.MutableMapping):
                mapping = copy.copy(data)
                mapping.update({key: default_convert(data[key]) for key in data})
                return mapping
            return elem_type({key: default_convert(data[key]) for key in data})
        except TypeError:
            return {key: default_convert(data[key]) for key in data}
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return elem_type(*(default_convert(d) for d in data))
    if isinstance(data, tuple):
        return [default_convert(d) for d in data]
    if isinstance(data, collections.abc.Sequence) and not isinstance(data, (str, bytes)):
        try:
            if isinstance(data, collections.abc.MutableSequence):
                sequence = copy.copy(data)
                for i, d in enumerate(data):
                    sequence[i] = default_convert(d)
                return sequence
            return elem_type([default_convert(d) for d in data])
        except TypeError:
            return [default_convert(d) for d in data]
    return data
