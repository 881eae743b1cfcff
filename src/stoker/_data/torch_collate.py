"""Collation with torch's semantics: what `torch.utils.data.default_collate` returns.

numpy arrays, numpy scalars and Python numbers become tensors; tuples become lists;
strings stay lists; mappings, namedtuples and sequences recurse. The exception types are
torch's (TypeError for unsupported types, RuntimeError for ragged samples) and the
message also names the path inside the sample. Stacked tensors are written through
`_collate.empty`, so in a process worker they land straight in a shared-memory slot.

A process worker that has not imported torch (nothing in its dataset needs it) does not
import it to collate: numbers and arrays are stacked by numpy into `TensorLeaf` arrays,
which the main process turns into tensors with `torch.from_numpy` as they arrive (the
arena does it for every array leaf already; pickled, a `TensorLeaf` rebuilds as a
tensor). Importing torch costs a worker seconds at start-up. `defer_tensors()` turns this
on; only process workers call it.
"""

from __future__ import annotations

import collections.abc
import copy
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .collate import (
    _ALLOC,
    CollateFnMap,
    collate_containers,
    empty,
    lookup,
    stack_tensors,
    stack_uniform,
)
from .errors import CollateRuntimeError, CollateTypeError, CollateValueError

_STRING_OR_OBJECT = re.compile(r"[SaUO]")

_deferring = False


def defer_tensors() -> None:
    """Collate into `TensorLeaf` arrays while torch is not imported in this process (a
    process worker's start-up: only its main process needs the tensors)."""
    global _deferring
    _deferring = True


class TensorLeaf(np.ndarray):
    """A stacked batch leaf that becomes a tensor in the main process: `torch.from_numpy`
    of its data (the arena flags it so; pickling rebuilds it so)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _tensor_of, (self.view(np.ndarray),)


def _tensor_of(array: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(array)


def _batch_tensor(out: np.ndarray) -> Any:
    """The tensor over a freshly stacked array, or the array as a `TensorLeaf` in a
    worker that defers tensors and has not imported torch."""
    if _deferring and "torch" not in sys.modules:
        return out.view(TensorLeaf)
    import torch

    return torch.from_numpy(out)


# Types whose lists numpy turns into the same values and dtype as `torch.as_tensor` does
# (numpy scalars keep their dtype in both), five times faster than torch.
_SAME_IN_NUMPY: dict[type, Any] = {int: np.int64, bool: np.bool_} | {
    t: t
    for t in (
        np.bool_,
        np.uint8,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    )
}


_TORCH_WRAPS = frozenset(np.dtype(t) for t in _SAME_IN_NUMPY.values())  # torch.from_numpy takes these


def _numpy_equal(batch: Sequence[Any], float64: bool) -> Any:
    """The numpy dtype that makes of `batch` exactly the tensor torch makes (`float64`:
    `torch.tensor(batch, dtype=torch.float64)`, else `torch.as_tensor(batch)`), or None
    when numpy cannot be relied on to."""
    kinds = set(map(type, batch))
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if float64:
        return np.float64 if kind is float else None
    return _SAME_IN_NUMPY.get(kind)


def _tensor_from(batch: Sequence[Any], float64: bool = False) -> Any:
    """torch.as_tensor of a list of numbers (`float64`: torch.tensor with that dtype),
    placed through the allocator."""
    np_dtype = _numpy_equal(batch, float64)
    if np_dtype is not None:
        out = empty((len(batch),), np_dtype)
        try:
            out[...] = batch
            return _batch_tensor(out)
        except OverflowError:
            pass  # an int beyond int64: torch raises its own error below
    import torch

    dtype = torch.float64 if float64 else None
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
    elem = batch[0]
    if _STRING_OR_OBJECT.search(elem.dtype.str) is not None:
        raise CollateTypeError(f"batch must contain tensors, numpy arrays, numbers, dicts or lists; found {elem.dtype}")
    if elem.dtype in _TORCH_WRAPS:  # native byte order, a dtype torch.from_numpy takes
        fast = stack_uniform(batch)
        if fast is not None:
            return _batch_tensor(fast)
    import torch

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
    return _tensor_from(batch, float64=True)


def collate_int(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return _tensor_from(batch)


def _unstackable(elem: Any) -> str | None:
    """What kind of tensor torch's `default_collate` refuses `elem` as ("nested", "sparse"), or
    None for a tensor it stacks."""
    import torch

    if elem.is_nested:
        return "nested"
    if elem.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc):
        return "sparse"
    return None


def _collate_tensor(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    kind = _unstackable(batch[0])
    if kind is not None:  # torch's own error, type and words, for code that matches them
        raise RuntimeError(
            f"Batches of {kind} tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    return _checked_stack(batch)


def collate_str(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    return batch


def _map(with_torch: bool = True) -> CollateFnMap:
    if with_torch:
        import torch

        return {torch.Tensor: _collate_tensor, **_map(with_torch=False)}
    return {
        np.ndarray: collate_numpy_array,
        np.memmap: collate_numpy_array,
        (np.bool_, np.number, np.object_): collate_numpy_scalar,
        float: collate_float,
        int: collate_int,
        str: collate_str,
        bytes: collate_str,
    }


_default_map: CollateFnMap | None = None
_torch_free_map = _map(with_torch=False)  # a sample cannot hold a tensor while torch is not imported


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
        batch,
        lambda b: collate(b, collate_fn_map=collate_fn_map),
        tuple_as_list=True,
        dataclasses_too=False,
        transposed_as_tuples=True,
    )
    if out is NotImplemented:
        raise CollateTypeError(f"batch must contain tensors, numpy arrays, numbers, dicts or lists; found {type(elem)}")
    return out


def default_collate(batch: Sequence[Any]) -> Any:
    """torch's `default_collate`: a list of samples becomes a batch of tensors.

    numpy arrays, numpy scalars and Python numbers become tensors, tensors are stacked,
    tuples become lists, strings stay lists; mappings, namedtuples and sequences recurse.
    The result equals torch's for the same samples.

    Args:
        batch: The samples, a non-empty sequence.

    Returns:
        The batch, with the samples' structure.

    Raises:
        TypeError: when a sample holds a type torch does not collate.
        RuntimeError: when samples are ragged (tensors of different shapes, sequences
            of different lengths); the message names the path inside the sample. Also,
            with torch's own message, when the first sample's tensor is nested or sparse.
    """
    if _deferring and "torch" not in sys.modules:
        return collate(batch, collate_fn_map=_torch_free_map)
    return collate(batch, collate_fn_map=default_collate_fn_map())


def default_convert(data: Any) -> Any:
    """torch's `default_convert` (`batch_size=None`): numpy arrays and scalars become tensors.

    Containers are converted element by element; arrays of strings or objects, and
    anything else, pass through unchanged.

    Args:
        data: One sample.

    Returns:
        The sample, its numpy leaves turned into tensors.
    """
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
