"""Token documents: `TokenDataset` (one flat array of tokens and the offsets of its documents),
the check every document passes, and the lengths that packing reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._base.hooks import KnowsLengths, follows
from .._data.datasets import Dataset
from .._data.identity import array_digest
from .errors import DocumentError


def _check_document(doc: Any, where: str | Callable[[], str], field: str | None = None) -> np.ndarray:
    """`doc` (or `doc[field]`) as a 1-D integer array; DocumentError naming `where` (a callable
    is called only then: naming a mix's document costs a lookup a valid one need not pay)."""
    if field is not None:
        if not isinstance(doc, Mapping) or field not in doc:
            keys = f" (keys {sorted(map(str, doc))})" if isinstance(doc, Mapping) else ""
            raise DocumentError(f"{_named(where)} is a {type(doc).__name__} without the field {field!r}{keys}")
        doc = doc[field]
        if isinstance(doc, (list, tuple)):  # a Hugging Face dataset's row holds lists
            doc = np.asarray(doc) if doc else np.zeros(0, np.int64)
    if hasattr(doc, "numpy") and not isinstance(doc, np.ndarray):  # a torch tensor
        doc = doc.numpy()
    if not isinstance(doc, np.ndarray):
        raise DocumentError(f"{_named(where)} is a {type(doc).__name__}, not a 1-D integer numpy array")
    if doc.ndim != 1 or doc.dtype.kind not in "iu":
        raise DocumentError(
            f"{_named(where)} has shape {doc.shape} and dtype {doc.dtype}; a document is a 1-D integer array"
        )
    return doc


def _named(where: str | Callable[[], str]) -> str:
    return where if isinstance(where, str) else where()


def lengths_of(dataset: Any, indices: np.ndarray, name: str = "dataset", field: str | None = None) -> np.ndarray:
    """The token counts of `dataset`'s documents at `indices` (int64): from its `lengths` array
    when it has one, else by reading each document (checked: a 1-D integer array, or a mapping
    holding one under `field`)."""
    indices = np.asarray(indices, dtype=np.int64)
    if follows(dataset, KnowsLengths) and isinstance(dataset.lengths, np.ndarray) and dataset.lengths.ndim == 1:
        return dataset.lengths[indices].astype(np.int64, copy=False)
    out = np.empty(len(indices), np.int64)
    for n, i in enumerate(indices.tolist()):
        out[n] = len(_check_document(dataset[i], f"document {i} of {name}", field))
    return out


class TokenDataset(Dataset[np.ndarray]):
    """Documents stored as one flat array of token ids and the offsets where each begins.

    `ds[i]` is `tokens[offsets[i]:offsets[i + 1]]`, a view (no copy); `lengths` are known
    without reading a token, which is what makes packing rows cheap. `tokens` may be
    a `numpy.memmap` of a file bigger than memory.

    Args:
        tokens: A 1-D integer array of every document's tokens back to back.
        offsets: A 1-D integer array of len(documents) + 1 non-decreasing entries, the first
            0 and the last len(tokens).

    Raises:
        TypeError: when `tokens` or `offsets` is not a 1-D integer array.
        ValueError: when `offsets` does not start at 0, end at len(tokens), or decreases.
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray) -> None:
        for name, arr in (("tokens", tokens), ("offsets", offsets)):
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise TypeError(f"{name} should be a 1-D integer numpy array, but got {_describe(arr)}")
        if len(offsets) < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != len(tokens):
            raise ValueError(
                f"offsets should start at 0 and end at len(tokens) = {len(tokens)}, "
                f"but got {int(offsets[0]) if len(offsets) else None} ... {int(offsets[-1]) if len(offsets) else None}"
            )
        steps = np.diff(offsets.astype(np.int64))
        if len(steps) and int(steps.min()) < 0:
            raise ValueError(f"offsets should not decrease, but got a decrease at entry {int(np.argmin(steps)) + 1}")
        self.tokens = tokens
        self.offsets = offsets.astype(np.int64, copy=False)
        self.lengths = steps
        self._digests: tuple[str, str] | None = None  # (tokens, offsets), made at the first state

    @classmethod
    def from_documents(cls, documents: Sequence[Any], dtype: Any = None) -> TokenDataset:
        """A TokenDataset holding `documents` (1-D integer arrays or lists of ints).

        Args:
            documents: The documents, in order.
            dtype: The token dtype. None means the smallest of uint16, uint32 and int64 that
                holds every token (negative ids give int64). Defaults to None.

        Raises:
            DocumentError: when a document is not a 1-D integer array, naming its index.
        """
        arrays = []
        for i, doc in enumerate(documents):
            arr = np.asarray(doc) if isinstance(doc, (list, tuple)) else doc
            if isinstance(arr, np.ndarray) and arr.size == 0:
                arr = arr.astype(np.int64).reshape(0)
            arrays.append(_check_document(arr, f"document {i}"))
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        if dtype is None:
            low = int(flat.min()) if flat.size else 0
            high = int(flat.max()) if flat.size else 0
            dtype = np.uint16 if low >= 0 and high < 1 << 16 else np.uint32 if low >= 0 and high < 1 << 32 else np.int64
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        return cls(flat.astype(dtype), offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} is out of range for {len(self)} documents")
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def stoker_describe(self) -> dict[str, Any]:
        """What a loader state saved over this dataset must agree on: the documents' and
        tokens' counts, the tokens' dtype, and digests of the offsets and the tokens (whole up
        to 64 MiB each, else a bounded sample: see the mixing guide's table of what a state records), computed once."""
        if self._digests is None:
            self._digests = (array_digest(self.tokens), array_digest(self.offsets))
        return {
            "type": "TokenDataset",
            "documents": len(self),
            "tokens": len(self.tokens),
            "dtype": self.tokens.dtype.str,
            "offsets_digest": self._digests[1],
            "tokens_digest": self._digests[0],
        }

    def __repr__(self) -> str:
        return f"TokenDataset({len(self)} documents, {len(self.tokens)} tokens)"


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"an array of shape {x.shape} and dtype {x.dtype}"
    return f"a {type(x).__name__}"
