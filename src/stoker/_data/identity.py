"""What a stream dataset's description is made of: cheap, stable identities of data.

A loader's `state_dict()` records its dataset's description (`stoker_describe()`, a flat dict
of plain JSON values) and `load_state_dict()` refuses a state whose description differs, key
by key, before it applies anything. So the description must name everything that changes a
row, and cost little: `state_dict()` runs often, and a token array may be a memory-mapped
file far bigger than memory. The rules, in one place so that every dataset follows them:

- An array (`array_digest`) is named by its dtype, its shape and a sha256 of its bytes: all
  of them when it holds at most `FULL_DIGEST_BYTES` (64 MiB, about 35 ms once), else its
  first and last `BLOCK_BYTES` and `SAMPLE_BLOCKS` blocks evenly spaced between (4 MiB read,
  wherever the array lives). Re-tokenised, re-ordered, re-cut or other data changes nearly
  every block and is seen; an edit that falls only between the sampled blocks of a large
  array is not. Datasets compute their digests once and keep them: their arrays are taken as
  fixed after construction.
- A dataset that describes itself (`stoker_describe()`: stoker's `TokenDataset`,
  `MixedDataset`, `PackedDataset`, `ShardedDataset`) gives its own description.
- Any other dataset (`describe_data`) is named by its type's name and length, and by its
  Hugging Face `datasets` fingerprint (`_fingerprint`) when it has one: other contents of
  the same type and length are not seen.
- A callable (`callable_name`: a `ShardedDataset`'s `decode` or `transform`) is named by its
  qualified name, not its code.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sized
from typing import Any

import numpy as np

from .._base.hooks import DescribesStream, follows

FULL_DIGEST_BYTES = 64 << 20  # arrays up to this size are hashed whole
BLOCK_BYTES = 4096  # larger ones: this many bytes at each sampled place
SAMPLE_BLOCKS = 1024  # ... at this many places, first and last included


def array_digest(arr: np.ndarray) -> str:
    """A sha256 (hex, 32 characters) of an array's dtype, shape and bytes: all of them up
    to `FULL_DIGEST_BYTES`, else a bounded sample of evenly spaced blocks (see the module's
    docstring for what that does and does not see).

    Args:
        arr: The array (a `numpy.memmap` too).
    """
    h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
    flat = arr.reshape(-1)
    if arr.nbytes <= FULL_DIGEST_BYTES:
        h.update(np.ascontiguousarray(flat).data)
    else:
        h.update(b"sampled")
        per = max(1, BLOCK_BYTES // max(1, arr.itemsize))
        starts = np.unique(np.linspace(0, len(flat) - per, SAMPLE_BLOCKS).astype(np.int64))
        for start in starts.tolist():
            h.update(np.ascontiguousarray(flat[start : start + per]).data)
    return h.hexdigest()[:32]


def type_name(obj: Any) -> str:
    """The qualified name of `obj`'s type (without its module: a script's classes are in
    `__main__` when it runs and in their module when imported)."""
    return type(obj).__qualname__


def callable_name(fn: Any) -> str | None:
    """A callable's qualified name (a `functools.partial` as `partial(name)`, a callable
    object as its type's name), None for None, a string as itself.

    Args:
        fn: The callable, None or a string (a mode such as "auto").
    """
    if fn is None or isinstance(fn, str):
        return fn
    if isinstance(fn, functools.partial):
        return f"partial({callable_name(fn.func)})"
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else type_name(fn)


def describe_data(dataset: Any) -> dict[str, Any]:
    """A dataset's description: its own `stoker_describe()` when it has one, else its type's
    name, its length (when it has one) and its Hugging Face fingerprint (when it has one).

    Args:
        dataset: The dataset.

    Raises:
        TypeError: when its `stoker_describe()` returns something other than a mapping.
    """
    if follows(dataset, DescribesStream) and callable(dataset.stoker_describe):
        described = dataset.stoker_describe()
        if not isinstance(described, Mapping):
            raise TypeError(
                f"{type_name(dataset)}.stoker_describe() should return a dict, but got {type(described).__name__}"
            )
        return dict(described)
    out: dict[str, Any] = {"type": type_name(dataset), "length": len(dataset) if isinstance(dataset, Sized) else None}
    fingerprint = getattr(dataset, "_fingerprint", None)  # a Hugging Face datasets.Dataset
    if isinstance(fingerprint, str):
        out["fingerprint"] = fingerprint
    return out


def prefixed(prefix: str, description: Mapping[str, Any]) -> dict[str, Any]:
    """`description`'s keys under `prefix` ("prefix.key"), so that a refusal names the key in
    full (`stream.mix.source.1.tokens_digest`)."""
    return {f"{prefix}.{key}": value for key, value in description.items()}
