"""The datasets and the sampler of `stoker.mix`: token documents, a weighted mix of sources,
packed rows, and the sampler that walks such a stream epoch after epoch.

Every dataset here is a *stream* addressed by position: index p is the p-th item of an endless
sequence that is a function of the construction arguments alone, and `len()` is the length of
one epoch. `StreamSampler` gives epoch e the positions [e * len, (e + 1) * len), split over ranks
as `DistributedSampler` splits its order, so a loader's `state_dict()` resumes on another world
size through the elastic path every stoker sampler has.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import numpy as np

from .._data.datasets import Dataset
from .._data.distributed import DistributedSampler
from .mixing import MODES, WeightedMix, _pieces, integer_weights
from .packing import (
    IGNORE_INDEX,
    LONG,
    METHODS,
    Row,
    build_row,
    check_seq_len,
    check_window_size,
    plan_window,
)

WEIGH = ("documents", "tokens")
TOKEN_RESOLUTION = 1 << 16  # document weights made from token weights: shares to 1/65,536
_PLANS_KEPT = 16  # window plans a process keeps (rows of the windows it is reading now)
_GROW = 32  # windows planned in one step when the window table grows


class DocumentError(TypeError):
    """A document is not a 1-D integer array; the message names its source and index."""


def _check_document(doc: Any, where: str) -> np.ndarray:
    if hasattr(doc, "numpy") and not isinstance(doc, np.ndarray):  # a torch tensor
        doc = doc.numpy()
    if not isinstance(doc, np.ndarray):
        raise DocumentError(f"{where} is a {type(doc).__name__}, not a 1-D integer numpy array")
    if doc.ndim != 1 or doc.dtype.kind not in "iu":
        raise DocumentError(f"{where} has shape {doc.shape} and dtype {doc.dtype}; a document is a 1-D integer array")
    return doc


def lengths_of(dataset: Any, indices: np.ndarray, name: str = "dataset") -> np.ndarray:
    """The token counts of `dataset`'s documents at `indices` (int64): from its `lengths` array
    when it has one, else by reading each document (checked: a 1-D integer array)."""
    indices = np.asarray(indices, dtype=np.int64)
    known = getattr(dataset, "lengths", None)
    if isinstance(known, np.ndarray) and known.ndim == 1:
        return known[indices].astype(np.int64, copy=False)
    out = np.empty(len(indices), np.int64)
    for n, i in enumerate(indices.tolist()):
        out[n] = len(_check_document(dataset[i], f"document {i} of {name}"))
    return out


class TokenDataset(Dataset[np.ndarray]):
    """Documents stored as one flat array of token ids and the offsets where each begins.

    `ds[i]` is `tokens[offsets[i]:offsets[i + 1]]`, a view (no copy); `lengths` are known
    without reading a token, which is what makes planning packed rows cheap. `tokens` may be
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
                raise TypeError(f"{name} must be a 1-D integer numpy array, got {_describe(arr)}")
        if len(offsets) < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != len(tokens):
            raise ValueError(
                f"offsets must start at 0 and end at len(tokens) = {len(tokens)}, "
                f"got {int(offsets[0]) if len(offsets) else None} ... {int(offsets[-1]) if len(offsets) else None}"
            )
        steps = np.diff(offsets.astype(np.int64))
        if len(steps) and int(steps.min()) < 0:
            raise ValueError(f"offsets decrease at entry {int(np.argmin(steps)) + 1}")
        self.tokens = tokens
        self.offsets = offsets.astype(np.int64, copy=False)
        self.lengths = steps

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

    def __repr__(self) -> str:
        return f"TokenDataset({len(self)} documents, {len(self.tokens)} tokens)"


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"an array of shape {x.shape} and dtype {x.dtype}"
    return f"a {type(x).__name__}"


class MixedDataset(Dataset[Any]):
    """Several datasets mixed in set proportions, exactly and deterministically.

    Position p of the mix is a (source, sample) pair that depends only on (`seed`, the
    epoch of the mix, `weights`, the sources' sizes and `exhausted`): the sources are taken
    in the proportions of `weights` with no sampling drift (over every window of W
    consecutive positions under one weight vector, source s appears W q_s times within
    1 + q_s (S' - 2), q_s its share and S' the number of sources of positive weight; within 1
    for two sources), and each source walks through its own shuffled order, a new one each
    time it has been read through. `ds[p]` is that source's sample.

    Positions count on across epochs (`StreamSampler` gives epoch e the positions
    [e * len(ds), (e + 1) * len(ds))), so a weight schedule is a schedule over the run. With
    `exhausted="repeat"` the mix is endless and `len(ds)` is `length` (by default the
    sources' total size); with "stop" or "end" one epoch of the mix ends when the sources
    run out as chosen, and the next epoch is a new mix (epoch + 1) of the same length.

    Args:
        sources: The datasets to mix (map-style: `__len__` and `__getitem__`), two or more,
            or one to get a single dataset's endless shuffled stream.
        weights: One weight per source (non-negative numbers, not all zero; ints are exact,
            floats are taken as the nearest fraction with a denominator up to 10**9), or a
            schedule: a list of `(start_position, weights)` pairs with starts 0 then strictly
            increasing, each weight vector in force from its start (positions of the mix,
            counted from the start of the run; with "stop"/"end" from each mix epoch's start).
        weigh: "documents" (the weights are shares of the samples) or "tokens" (shares of the
            tokens: each source's weight is divided by its mean document length, and the
            resulting shares are rounded to 1/65,536; the token shares are then exact in
            expectation, and within one document's length of the target over long windows).
            Defaults to "documents".
        exhausted: What happens when a source has been read through: "repeat" (it starts a
            new shuffled pass; the mix never ends), "stop" (it leaves the mix and the other
            weights are renormalised; the epoch ends when none is left) or "end" (the epoch
            ends there). Defaults to "repeat".
        seed: The seed of every source's shuffled order (an int >= 0). Defaults to 0.
        length: The epoch length in positions: by default, with "repeat", the sources' total
            size; with "stop"/"end", where the mix ends (a smaller `length` cuts each epoch
            short). Defaults to None.
        tokens: With `weigh="tokens"`, each source's total token count (its mean document
            length is tokens / size). None means it is counted: from a source's `lengths`
            array when it has one (a `TokenDataset`), else by reading every document once,
            at construction. Defaults to None.

    Raises:
        ValueError: when `weights` (or a piece of the schedule) has another length than
            `sources`, a negative or non-finite entry, or is all zero; when the schedule's
            starts are not 0 then increasing; when `weigh`, `exhausted`, `seed` or `length` is
            not one of the accepted values; when a source of positive weight is empty.
        DocumentError: with `weigh="tokens"` and a document that is not a 1-D integer array.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        weights: Any,
        *,
        weigh: str = "documents",
        exhausted: str = "repeat",
        seed: int = 0,
        length: int | None = None,
        tokens: Sequence[int] | None = None,
    ) -> None:
        if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
            raise ValueError(f"sources must be a non-empty list of datasets, got {_describe(sources)}")
        for i, src in enumerate(sources):
            if not isinstance(src, Sized) or not hasattr(src, "__getitem__"):
                raise TypeError(f"sources[{i}] is a {type(src).__name__}: a source is a map-style dataset")
        if weigh not in WEIGH:
            raise ValueError(f"weigh must be one of {WEIGH}, got {weigh!r}")
        if exhausted not in MODES:
            raise ValueError(f"exhausted must be one of {MODES}, got {exhausted!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.sources = list(sources)
        self.sizes = [len(s) for s in self.sources]
        self.weigh, self.exhausted, self.seed = weigh, exhausted, int(seed)
        pieces = _pieces(weights)
        for _start, w in pieces:  # checked as given, before any conversion
            integer_weights(w, len(self.sources))
        self.schedule = [(start, [float(x) for x in w]) for start, w in pieces]
        self.mean_lengths: list[float] | None = None
        if weigh == "tokens":
            self.mean_lengths = self._mean_lengths(tokens)
            doc_schedule: list[tuple[int, list[int]]] = [
                (start, _token_to_document_weights(w, self.mean_lengths)) for start, w in pieces
            ]
            schedule: Any = doc_schedule
        else:
            schedule = pieces
        self._schedule = schedule
        self._mixes: OrderedDict[int, WeightedMix] = OrderedDict()
        first = self._mix(0)
        if first.length is None:
            self.length = sum(self.sizes) if length is None else length
        else:
            self.length = first.length if length is None else length
            if self.length > first.length:
                raise ValueError(f"length {length} is longer than the mix, which ends at {first.length}")
        if isinstance(self.length, bool) or not isinstance(self.length, (int, np.integer)) or self.length < 1:
            raise ValueError(f"length must be an int >= 1, got {length!r} (the mix has {self.length} positions)")
        self.length = int(self.length)

    def _mean_lengths(self, tokens: Sequence[int] | None) -> list[float]:
        if tokens is not None:
            if len(tokens) != len(self.sources):
                raise ValueError(f"tokens has {len(tokens)} entries but there are {len(self.sources)} sources")
            totals = [int(t) for t in tokens]
        else:
            totals = [
                int(lengths_of(src, np.arange(n), f"source {i}").sum()) for i, (src, n) in enumerate(zip(self.sources, self.sizes))
            ]
        return [t / n if n else 0.0 for t, n in zip(totals, self.sizes)]

    def _mix(self, epoch: int) -> WeightedMix:
        mix = self._mixes.get(epoch)
        if mix is None:
            mix = WeightedMix(self.sizes, self._schedule, seed=self.seed, epoch=epoch, mode=self.exhausted)
            self._mixes[epoch] = mix
            if len(self._mixes) > 2:
                self._mixes.popitem(last=False)
        return mix

    def _locate(self, position: int) -> tuple[WeightedMix, int]:
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
            raise TypeError(f"a MixedDataset is indexed by an int position, got {type(position).__name__}")
        if position < 0:
            raise IndexError(f"position {position} is negative: a mix is indexed from its start")
        if self.exhausted == "repeat":
            return self._mix(0), int(position)
        epoch, at = divmod(int(position), self.length)
        return self._mix(epoch), at

    def __len__(self) -> int:
        return self.length

    def source_at(self, position: int) -> tuple[int, int]:
        """The (source index, sample index) at a position of the mix.

        Args:
            position: The position (an int >= 0, counted across epochs).

        Raises:
            IndexError: when `position` is negative.
            TypeError: when it is not an int.
        """
        mix, at = self._locate(position)
        return mix.mixed_at(at)

    def __getitem__(self, position: int) -> Any:
        s, j = self.source_at(position)
        return self.sources[s][j]

    def sources_block(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The (source, sample) pairs of positions [start, stop) as two int64 arrays, computed
        together (the same pairs `source_at` gives one by one, far faster).

        Args:
            start: The first position (>= 0).
            stop: The position after the last (>= start).

        Raises:
            IndexError: when the positions are not such a range.
        """
        if start < 0 or stop < start:
            raise IndexError(f"positions [{start}, {stop}) are not a range of a mix")
        if self.exhausted == "repeat":
            return self._mix(0).block(start, stop)
        parts_s, parts_j = [], []
        p = start
        while p < stop:
            epoch, at = divmod(p, self.length)
            upto = min(stop, (epoch + 1) * self.length)
            s, j = self._mix(epoch).block(at, at + upto - p)
            parts_s.append(s)
            parts_j.append(j)
            p = upto
        if not parts_s:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(parts_s), np.concatenate(parts_j)

    def stoker_lengths(self, start: int, stop: int) -> np.ndarray:
        """The token counts of the documents at positions [start, stop), from the sources'
        `lengths` arrays where they have them (what `PackedDataset` plans with).

        Args:
            start: The first position (>= 0).
            stop: The position after the last.

        Raises:
            DocumentError: when a source without `lengths` holds a document that is not a 1-D
                integer array.
        """
        s, j = self.sources_block(start, stop)
        out = np.empty(len(s), np.int64)
        for src in np.unique(s).tolist():
            mask = s == src
            out[mask] = lengths_of(self.sources[src], j[mask], f"source {src}")
        return out

    def describe_document(self, position: int) -> str:
        """Words naming the document at `position`, its source and sample, for error messages.

        Args:
            position: The position (an int >= 0).
        """
        s, j = self.source_at(position)
        return f"the document at mix position {position} (source {s}, sample {j})"

    def weights_at(self, position: int) -> list[float]:
        """The target shares (in the unit of `weigh`, summing to 1) in force at a position.

        Args:
            position: The position (an int >= 0).
        """
        _, at = self._locate(position)
        starts = [start for start, _ in self.schedule]
        w = self.schedule[bisect.bisect_right(starts, at) - 1][1]
        total = sum(w)
        return [x / total for x in w]

    def _mean_target(self, start: int, stop: int) -> list[float]:
        """The schedule's shares averaged over positions [start, stop)."""
        total = np.zeros(len(self.sources))
        step = max(1, (stop - start) // 4096)
        points = range(start, stop, step)
        for p in points:
            total += np.asarray(self.weights_at(p))
        return (total / max(1, len(points))).tolist()

    def proportions(self, start: int = 0, stop: int | None = None) -> dict[str, Any]:
        """What the mix gives over positions [start, stop): each source's documents and
        document shares, its tokens and token shares (when every source has a `lengths` array,
        or `weigh="tokens"`), and the schedule's target shares averaged over the range.

        Args:
            start: The first position. Defaults to 0.
            stop: The position after the last. None means one epoch from `start`. Defaults
                to None.

        Returns:
            A dict with `positions`, `documents`, `document_shares`, `target_shares`, `weigh`
            and, where known, `tokens` and `token_shares`.
        """
        stop = start + self.length if stop is None else stop
        s, _ = self.sources_block(start, stop)
        docs = np.bincount(s, minlength=len(self.sources))
        out: dict[str, Any] = {
            "positions": int(stop - start),
            "documents": docs.tolist(),
            "document_shares": (docs / max(1, docs.sum())).tolist(),
            "target_shares": self._mean_target(start, stop),
            "weigh": self.weigh,
        }
        if self.weigh == "tokens" or all(isinstance(getattr(x, "lengths", None), np.ndarray) for x in self.sources):
            toks = np.bincount(s, weights=self.stoker_lengths(start, stop), minlength=len(self.sources))
            out["tokens"] = [int(t) for t in toks]
            out["token_shares"] = (toks / max(1.0, toks.sum())).tolist()
        return out

    def max_deviation(self, start: int, stop: int, window: int = 1000) -> float:
        """The largest |count_s - window * q_s| over every run of `window` consecutive positions
        in [start, stop) that lies under one weight vector; q_s are the document shares the mix
        follows (after the token conversion with `weigh="tokens"`). The documented bound is
        1 + q_s (S' - 2).

        Args:
            start: The first position (within one epoch of a "stop"/"end" mix).
            stop: The position after the last.
            window: The run length. Defaults to 1000.
        """
        mix, at = self._locate(start)
        s, _ = self.sources_block(start, stop)
        if len(s) < window:
            return 0.0
        onehot = np.zeros((len(s) + 1, len(self.sources)), np.int64)
        onehot[np.arange(1, len(s) + 1), s] = 1
        cum = np.cumsum(onehot, axis=0)
        counts = cum[window:] - cum[:-window]  # row a: the window starting at offset a
        first = at + np.arange(len(counts))  # mix positions the windows start at
        piece = np.searchsorted(mix.starts, first, side="right") - 1
        ends = np.asarray([*mix.starts[1:], np.iinfo(np.int64).max], np.int64)
        inside = first + window <= ends[piece]
        shares = np.asarray([np.asarray(w, np.float64) / sum(w) for w in mix.weights])
        dev = np.abs(counts - window * shares[piece])[inside]
        return float(dev.max()) if dev.size else 0.0

    def stoker_describe(self) -> dict[str, Any]:
        """What a loader state saved over this dataset must agree on (see `StreamSampler`)."""
        return {
            "sizes": self.sizes,
            "schedule_starts": [start for start, _ in self.schedule],
            "weights": [w for _, w in self.schedule],
            "weigh": self.weigh,
            "exhausted": self.exhausted,
            "seed": self.seed,
            "length": self.length,
        }

    def stoker_doctor_lines(self, start: int = 0, stop: int | None = None) -> list[str]:
        """The lines `stoker doctor` prints for this dataset: the achieved and target shares
        and the largest deviation over runs of 1,000 positions.

        Args:
            start: The first position. Defaults to 0.
            stop: The position after the last. None means one epoch. Defaults to None.
        """
        got = self.proportions(start, stop)
        shares = got.get("token_shares") if self.weigh == "tokens" else got["document_shares"]
        pairs = ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(shares or [], got["target_shares"]))
        window = min(1000, got["positions"])
        dev = self.max_deviation(start, start + min(got["positions"], 20_000), window)
        return [
            f"mix: {len(self.sources)} sources, weighed by {self.weigh}; over positions [{start}, "
            f"{start + got['positions']}): achieved/target shares {pairs}; largest deviation over "
            f"windows of {window} positions {dev:.2f} documents"
        ]

    def __repr__(self) -> str:
        return f"MixedDataset({len(self.sources)} sources, weigh={self.weigh!r}, exhausted={self.exhausted!r}, length={self.length})"


def _token_to_document_weights(weights: Sequence[Any], means: Sequence[float]) -> list[int]:
    shares = []
    for i, (w, m) in enumerate(zip(weights, means)):
        w = float(w)
        if w > 0 and m <= 0:
            raise ValueError(f"source {i} has a positive token weight but no tokens")
        shares.append(w / m if w > 0 else 0.0)
    total = sum(shares)
    ints = [max(1, round(x / total * TOKEN_RESOLUTION)) if x > 0 else 0 for x in shares]
    return ints


class _Stream:
    """The document stream a PackedDataset packs: a MixedDataset's positions as they are, any
    other dataset's documents in order, cycled (position p is document p % len)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.positional = callable(getattr(dataset, "stoker_lengths", None))
        self.size = len(dataset)
        if self.size < 1:
            raise ValueError("the dataset to pack has no documents")

    def lengths(self, start: int, stop: int) -> np.ndarray:
        if self.positional:
            return np.asarray(self.dataset.stoker_lengths(start, stop), dtype=np.int64)
        return lengths_of(self.dataset, np.arange(start, stop) % self.size)

    def where(self, p: int) -> str:
        describe = getattr(self.dataset, "describe_document", None)
        if describe is not None:
            return str(describe(p))
        return f"document {p % self.size} of the dataset"

    def get(self, p: int) -> np.ndarray:
        doc = self.dataset[p if self.positional else p % self.size]
        return _check_document(doc, self.where(p))


class PackedDataset(Dataset[dict[str, Any]]):
    """Variable-length documents packed into rows of `seq_len` tokens, as a map-style dataset.

    The document stream (a `MixedDataset`'s positions, or any dataset of documents read in
    order and cycled) is cut into fixed windows of `window_size` (K) documents; each window is
    packed on its own, from its documents' lengths alone, so a row is addressed by (window,
    row) and any process can make any row. Rows are numbered window after window: index g is
    the g-th row of an endless packed stream that depends only on the document stream, K,
    `seq_len`, `method` and `long` (the same on any number of workers and ranks).
    `len(ds)` is the epoch length in rows; `StreamSampler` walks the stream epoch after epoch.

    A row is a dict of numpy arrays (torch tensors with `tensors=True`):

    - `input_ids` (int64, seq_len): the documents' tokens back to back, then `pad_id`.
    - `position_ids` (int32, seq_len): 0, 1, 2, ... restarting at each document; 0 on padding.
    - `segment_ids` (int32, seq_len): 1, 2, ... per document in the row; 0 on padding.
    - `cu_seqlens` (int32, documents + 1): 0 then the cumulative document lengths, as
      variable-length attention kernels take them; the padding tail is not a segment.
      It varies in length: batch rows with `collate_packed`.
    - `max_seqlen` (int): the longest document in the row.
    - `labels` (int64, seq_len): `input_ids` with -100 at each document's first token and on
      padding.

    Planning reads lengths, not tokens: a `TokenDataset` (or a `MixedDataset` of them) gives
    them for free; any other dataset's documents are read once more to be measured. To find
    row g a process plans every window before it once (lengths only) and keeps the table of
    rows per window.

    Args:
        dataset: The documents: a map-style dataset of 1-D integer arrays (a `MixedDataset`,
            a `TokenDataset`, or any other).
        seq_len: The row length in tokens (int >= 1).
        window_size: K, the documents packed together (int >= 1). Larger K packs tighter (see
            the guide's table) and plans a little more per row. Defaults to 1024.
        method: "best_fit" (longest first, each into the fullest row it fits) or "greedy"
            (first-fit in stream order). Defaults to "best_fit".
        long: What to do with a document longer than `seq_len`: "split" (into full rows and a
            last piece packed like a document) or "drop". No other document is ever split.
            Defaults to "split".
        pad_id: The token id of padding. Defaults to 0.
        rows_per_epoch: The epoch length in rows. None means the rows that the windows
            covering the first len(dataset) documents make (planned at construction).
            Defaults to None.
        tensors: Give torch tensors instead of numpy arrays (torch needed). Defaults to False.

    Raises:
        TypeError: when `seq_len`, `window_size` or `rows_per_epoch` is not an int.
        ValueError: when one is < 1, `method` or `long` is not an accepted value, or the
            dataset is empty.
        DocumentError: (when a row is made or measured) a document that is not a 1-D integer
            array, naming its source and index.
    """

    def __init__(
        self,
        dataset: Any,
        seq_len: int,
        *,
        window_size: int = 1024,
        method: str = "best_fit",
        long: str = "split",
        pad_id: int = 0,
        rows_per_epoch: int | None = None,
        tensors: bool = False,
    ) -> None:
        self.seq_len = check_seq_len(seq_len)
        self.window_size = check_window_size(window_size)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if long not in LONG:
            raise ValueError(f"long must be one of {LONG}, got {long!r}")
        self.method, self.long, self.pad_id, self.tensors = method, long, int(pad_id), bool(tensors)
        self.dataset = dataset
        self._stream = _Stream(dataset)
        self._rows: list[int] = []  # rows of each window planned so far
        self._cum: list[int] = [0]  # rows before each window
        self._tokens: list[int] = []  # real tokens of each window planned so far
        self._plans: OrderedDict[int, list[Row]] = OrderedDict()
        if rows_per_epoch is None:
            windows = math.ceil(self._stream.size / self.window_size)
            self._grow_to_window(windows)
            rows_per_epoch = self._cum[windows]
        elif isinstance(rows_per_epoch, bool) or not isinstance(rows_per_epoch, (int, np.integer)):
            raise TypeError(f"rows_per_epoch must be an int, got {type(rows_per_epoch).__name__}")
        if rows_per_epoch < 1:
            raise ValueError(f"rows_per_epoch must be >= 1, got {rows_per_epoch}")
        self.rows_per_epoch = int(rows_per_epoch)

    def __len__(self) -> int:
        return self.rows_per_epoch

    def _plan(self, window: int, lengths: np.ndarray | None = None) -> list[Row]:
        plan = self._plans.get(window)
        if plan is not None:
            self._plans.move_to_end(window)
            return plan
        if lengths is None:
            start = window * self.window_size
            lengths = self._stream.lengths(start, start + self.window_size)
        plan = plan_window(lengths, self.seq_len, self.method, self.long)  # type: ignore[arg-type]
        self._plans[window] = plan
        if len(self._plans) > _PLANS_KEPT:
            self._plans.popitem(last=False)
        return plan

    def _grow_to_window(self, windows: int) -> None:
        """Plan windows until the table covers the first `windows` of them."""
        K = self.window_size
        while len(self._rows) < windows:
            first = len(self._rows)
            count = max(1, min(_GROW, windows - first))
            lengths = self._stream.lengths(first * K, (first + count) * K)
            for n in range(count):
                plan = self._plan(first + n, lengths[n * K : (n + 1) * K])
                self._rows.append(len(plan))
                self._tokens.append(sum(e - s for row in plan for _, s, e in row))
                self._cum.append(self._cum[-1] + len(plan))

    def locate(self, row: int) -> tuple[int, int]:
        """The (window, row within the window) of a row of the packed stream.

        Args:
            row: The row (an int >= 0, counted across epochs).

        Raises:
            IndexError: when `row` is negative.
            TypeError: when it is not an int.
        """
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
            raise TypeError(f"a PackedDataset is indexed by an int row, got {type(row).__name__}")
        if row < 0:
            raise IndexError(f"row {row} is negative: packed rows are numbered from the stream's start")
        while self._cum[-1] <= row:
            before = len(self._rows)
            self._grow_to_window(before + _GROW)
            if self._cum[-1] == self._cum[before] and len(self._rows) > before + 4 * _GROW:
                raise ValueError("the document stream gives no rows (every document is empty or dropped)")
        window = bisect.bisect_right(self._cum, row) - 1
        return window, int(row) - self._cum[window]

    def pieces(self, row: int) -> list[tuple[int, int, int]]:
        """What a row holds: (stream position, start, end) of each document piece in it, in
        the order the row holds them.

        Args:
            row: The row (an int >= 0).
        """
        window, r = self.locate(row)
        base = window * self.window_size
        return [(base + d, s, e) for d, s, e in self._plan(window)[r]]

    def __getitem__(self, row: int) -> dict[str, Any]:
        pieces = self.pieces(row)
        docs: dict[int, np.ndarray] = {}
        for p, _, e in pieces:
            if p not in docs:
                doc = self._stream.get(p)
                if len(doc) < e:
                    raise ValueError(f"{self._stream.where(p)} has {len(doc)} tokens, but its length was given as at least {e}")
                docs[p] = doc
        keys = list(docs)
        fields = build_row([docs[k] for k in keys], [(keys.index(p), s, e) for p, s, e in pieces], self.seq_len, self.pad_id)
        if self.tensors:
            import torch

            return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in fields.items()}
        return fields

    def utilisation(self) -> float:
        """Real tokens over row tokens (rows x seq_len) of the windows planned so far."""
        rows = sum(self._rows)
        return sum(self._tokens) / (rows * self.seq_len) if rows else 0.0

    def stoker_describe(self) -> dict[str, Any]:
        """What a loader state saved over this dataset must agree on (see `StreamSampler`)."""
        inner = getattr(self.dataset, "stoker_describe", None)
        out = {
            "seq_len": self.seq_len,
            "window_size": self.window_size,
            "method": self.method,
            "long": self.long,
            "rows_per_epoch": self.rows_per_epoch,
            "documents": self._stream.size,
        }
        if inner is not None:
            out.update({f"mix.{k}": v for k, v in inner().items()})
        return out

    def stoker_doctor_lines(self) -> list[str]:
        """The doctor's lines: packing utilisation over the first epoch, then the mix's."""
        windows = self.locate(self.rows_per_epoch - 1)[0] + 1
        rows, tokens = sum(self._rows[:windows]), sum(self._tokens[:windows])
        lines = [
            f"packing: {self.method}, seq_len {self.seq_len}, {self.window_size} documents a window: "
            f"{rows:,} rows from {windows:,} windows, utilisation {tokens / (rows * self.seq_len):.4f} "
            "(real tokens over row tokens)"
        ]
        inner = getattr(self.dataset, "stoker_doctor_lines", None)
        if inner is not None:
            lines.extend(inner(0, windows * self.window_size))
        return lines

    def __repr__(self) -> str:
        return f"PackedDataset(seq_len={self.seq_len}, window_size={self.window_size}, method={self.method!r}, rows_per_epoch={self.rows_per_epoch})"


def collate_packed(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Batch packed rows: fixed-size fields stacked to (batch, seq_len); `cu_seqlens` for the
    batch flattened to batch * seq_len tokens, where each row's padding tail (if any) is a
    segment of its own so that the boundaries stay contiguous (its labels are -100);
    `max_seqlen` the longest segment. numpy rows give numpy, torch rows torch tensors.

    Args:
        rows: `PackedDataset` rows, all of the same `seq_len`.

    Raises:
        ValueError: when `rows` is empty or the rows' lengths differ.
    """
    if not rows:
        raise ValueError("collate_packed needs at least one row")
    torch_rows = not isinstance(rows[0]["input_ids"], np.ndarray)

    def arr(x: Any) -> np.ndarray:
        return x if isinstance(x, np.ndarray) else x.numpy()

    seq_len = len(rows[0]["input_ids"])
    bounds = [0]
    for n, row in enumerate(rows):
        if len(row["input_ids"]) != seq_len:
            raise ValueError(f"row {n} has {len(row['input_ids'])} tokens, row 0 has {seq_len}")
        cu = arr(row["cu_seqlens"]).astype(np.int64)
        base = n * seq_len
        bounds.extend((base + cu[1:]).tolist())
        if cu[-1] < seq_len:
            bounds.append(base + seq_len)
    cu_all = np.asarray(bounds, dtype=np.int32)
    out: dict[str, Any] = {
        k: np.stack([arr(row[k]) for row in rows]) for k in ("input_ids", "position_ids", "segment_ids", "labels")
    }
    out["cu_seqlens"] = cu_all
    out["max_seqlen"] = int(np.diff(cu_all).max()) if len(cu_all) > 1 else 0
    if torch_rows:
        import torch

        out = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in out.items()}
    return out


class StreamSampler(DistributedSampler):
    """The positions of a stream dataset (`MixedDataset`, `PackedDataset`) epoch after epoch,
    split over ranks.

    Epoch e (`set_epoch`) gives the positions [e * len(dataset), (e + 1) * len(dataset)) in
    order; rank r takes the r-th, (r + world)-th, ... of them, as `DistributedSampler` splits
    its order (padding the tail with the epoch's first positions, or dropping it). The global
    sequence does not depend on the number of ranks or workers, so a loader's `state_dict()`
    resumes exactly on another world size (the rest of the epoch is what no old rank took),
    and a state saved over another stream (other sources, weights, schedule, seq_len, K, ...)
    is refused with what differs.

    Args:
        dataset: The stream dataset.
        num_replicas: The number of ranks. None means torch.distributed's world size when it
            is initialised, else `WORLD_SIZE`, else 1. Defaults to None.
        rank: This rank. None means torch.distributed's rank, else `RANK`, else 0. Defaults
            to None.
        drop_last: Drop the tail that does not divide evenly by `num_replicas` instead of
            padding it. Defaults to False.

    Raises:
        ValueError: as `DistributedSampler` (num_replicas, rank).
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle=False, seed=0, drop_last=drop_last)

    def _order(self) -> list[int]:
        n = len(self.dataset)
        return list(range(self.epoch * n, (self.epoch + 1) * n))

    def _iter_from(self, skip: int) -> Iterator[int]:
        indices = super()._iter_from(skip)
        locate = getattr(self.dataset, "locate", None)
        if locate is None:
            return indices
        first = next(indices, None)
        if first is None:
            return iter(())
        # drawn in the loader's process before its workers fork: the window table it plans
        # here (every window before `first`, lengths only) is inherited, not planned again
        locate(first)
        return itertools.chain([first], indices)

    def stoker_describe(self) -> dict[str, Any]:
        """The stream's description, which a loader's state records and checks."""
        describe = getattr(self.dataset, "stoker_describe", None)
        return dict(describe()) if describe is not None else {}

    def __iter__(self) -> Iterator[int]:
        return self._iter_from(0)


__all__ = [
    "IGNORE_INDEX",
    "DocumentError",
    "MixedDataset",
    "PackedDataset",
    "StreamSampler",
    "TokenDataset",
    "collate_packed",
    "lengths_of",
]
