"""`PackedDataset` (documents packed into rows, addressed by window and row) and
`collate_packed`; `StreamSampler` (stream_sampler.py) walks it epoch after epoch.

Every `stoker.mix` dataset is a *stream* addressed by position: index p is the p-th item of an endless
sequence that is a function of the construction arguments alone, and `len()` is the length of
one epoch. `StreamSampler` gives epoch e the positions [e * len, (e + 1) * len), split over ranks
as `DistributedSampler` splits its order, so a loader's `state_dict()` resumes on another world
size through the elastic path every stoker sampler has.
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base.checks import check_int, fail
from .._base.hooks import (
    KnowsLengths,
    KnowsStreamLengths,
    NamesDocuments,
    ReportsToDoctor,
    follows,
    upcoming_of,
)
from .._base.process import at_fork
from .._data.datasets import Dataset
from .._data.identity import describe_data, prefixed
from .mix_dataset import MixedDataset
from .pack_rows import (
    Piece,
    Row,
    build_row,
    check_fields,
    check_int32,
    check_options,
    check_seq_len,
    check_window_size,
    check_window_unit,
    convert_row,
    pack_rows_window,
    pack_window,
    piece_tokens,
    window_take,
)
from .tokens import _check_document, lengths_of

# A fork while another thread holds a dataset's lock would leave the child's copy locked forever.
_LOCKED: weakref.WeakSet[Any] = weakref.WeakSet()


def _new_locks() -> None:
    for dataset in list(_LOCKED):
        dataset._lock = threading.RLock()


at_fork(after_in_child=_new_locks)

_DOCTOR_ROWS = 100_000  # what the doctor's report covers at most
_WINDOWS_KEPT = 16  # packed windows a process keeps (rows of the windows it is reading now)
_GROW = 32  # windows packed in one step when the window table grows
_CHECKPOINT = 16  # rows unit: the pieces carried into every 16th window are kept, to repack from
_READ = 4096  # rows unit: documents' lengths read ahead at least this many at a time


class _Stream:
    """The document stream a PackedDataset packs: a MixedDataset's positions as they are (any
    stream with `stoker_lengths`), any other dataset's documents in order, cycled (position p
    is document p % len)."""

    def __init__(self, dataset: Any, field: str | None) -> None:
        self.dataset = dataset
        self.field = field
        self.positional = follows(dataset, KnowsStreamLengths) and callable(dataset.stoker_lengths)
        self.size = len(dataset)
        if self.size < 1:
            raise ValueError("the dataset to pack has no documents")

    def lengths(self, start: int, stop: int) -> np.ndarray:
        if self.positional:
            return np.asarray(self.dataset.stoker_lengths(start, stop), dtype=np.int64)
        return lengths_of(self.dataset, np.arange(start, stop) % self.size, field=self.field)

    def declared(self, p: int) -> int | None:
        """The length packing read for position p when it came from a `lengths` array (a
        length measured by reading the document cannot disagree with it), else None."""
        dataset, index = self.dataset, p % self.size
        if isinstance(dataset, MixedDataset):
            source, index = dataset.source_at(p)
            dataset = dataset.sources[source]
        elif self.positional:
            return None
        if follows(dataset, KnowsLengths) and isinstance(dataset.lengths, np.ndarray) and dataset.lengths.ndim == 1:
            return int(dataset.lengths[index])
        return None

    def where(self, p: int) -> str:
        if follows(self.dataset, NamesDocuments):
            return str(self.dataset.describe_document(p))
        return f"document {p % self.size} of the dataset"

    def get(self, p: int) -> np.ndarray:
        doc = self.dataset[p if self.positional else p % self.size]
        return _check_document(doc, lambda: self.where(p), self.field)


class PackedDataset(Dataset[dict[str, Any]]):
    """Variable-length documents packed into rows of `seq_len` tokens, as a map-style dataset.

    The document stream (a `MixedDataset`'s positions, or any dataset of documents read in
    order and cycled) is cut into windows, each packed from its documents' lengths alone, so a
    row is addressed by (window, row) and any process can make any row. With
    `window_unit="documents"` a window is `window_size` (K) documents, packed on its own; with
    `window_unit="rows"` a window makes K rows: it takes documents until their tokens fill K
    rows, and the pieces that do not fit are carried to the next window and placed first, so
    no row is left part empty for want of documents (tighter packing when K documents would
    make only a few rows). Rows are numbered window after window: index g is the g-th row of an
    endless packed stream that depends only on the document stream, K, the window unit,
    `seq_len`, `method` and `long` (the same on any number of workers and ranks).
    `len(ds)` is the epoch length in rows; `StreamSampler` walks the stream epoch after epoch.

    A row is a dict of numpy arrays (torch tensors with `tensors=True`). With `fields="torch"`
    (the default):

    - `input_ids` (int64, seq_len): the documents' tokens back to back, then `pad_id`.
    - `position_ids` (int32, seq_len): 0, 1, 2, ... restarting at each document; 0 on padding.
    - `segment_ids` (int32, seq_len): 1, 2, ... per document in the row; 0 on padding.
    - `cu_seqlens` (int32, documents + 1): 0 then the cumulative document lengths, as
      variable-length attention kernels take them; the padding tail is not a segment.
      It varies in length: batch rows with `collate_packed`.
    - `max_seqlen` (int): the longest document in the row.
    - `labels` (int64, seq_len): `input_ids` with -100 at each document's first token and on
      padding.

    With `fields="jax"`, the convention of JAX and Flax models: every field int32 and of a
    fixed shape, so that the default collate stacks a batch into one static shape and a jitted
    step compiles once:

    - `input_ids`, `segment_ids` and `labels` (seq_len) as above; `positions` (seq_len): the
      `position_ids` above.
    - `cu_seqlens` (seq_len + 1): the boundaries above, then the last one (the number of real
      tokens) repeated: the segments after the row's documents are empty, so a kernel that
      reads segment i as [cu[i], cu[i + 1]) still reads the row right. No `max_seqlen`:
      `seq_len` bounds it.

    With `fields="maxtext"`, MaxText's batch names, int32, fixed shapes: `inputs`,
    `inputs_segmentation`, `inputs_position` (the tokens, segments and positions);
    `targets` (the next token where it is in the same document, else `pad_id`),
    `targets_segmentation` (the segment where a token has a target, else 0: MaxText's loss
    weights), `targets_position`; and `cu_seqlens` as for "jax". No token is trained to
    predict across a document boundary, as with `labels`.

    The same arguments give the same rows, tokens and boundaries in every convention.

    Packing reads lengths, not tokens: a `TokenDataset` (or a `MixedDataset` of them) gives
    them for free; any other dataset's documents are read once more to be measured. To find
    row g a process packs every window before it once (lengths only) and keeps the table of
    rows (and, for rows windows, first documents) per window.

    Args:
        dataset: The documents: a map-style dataset of 1-D integer arrays (a `MixedDataset`,
            a `TokenDataset`, or any other).
        seq_len: The row length in tokens (int >= 1).
        window_size: K, the window's size in `window_unit`s (int >= 1). Larger K packs tighter
            (see the guide's table) and costs a little more per row. Defaults to 1024.
        method: "best_fit" (longest first, each into the fullest row it fits) or "greedy"
            (first-fit in stream order). Defaults to "best_fit".
        long: What to do with a document longer than `seq_len`: "split" (into full rows and a
            last piece packed like a document) or "drop". No other document is ever split.
            Defaults to "split".
        window_unit: What `window_size` counts: "documents" (each window K documents, packed
            on its own) or "rows" (each window K rows; the pieces that do not fit are carried
            to the next window and placed first, oldest first). "rows" packs as tightly as
            Grain's packers with K bins or tighter on every length law the guide measures,
            where "documents" loses up to a few points when K documents make few rows. A
            window takes at most one pass of the stream. Defaults to "rows".
        pad_id: The token id of padding. Defaults to 0.
        rows_per_epoch: The epoch length in rows. None means the rows that the windows
            covering the first len(dataset) documents make (packed at construction).
            Defaults to None.
        tensors: Give torch tensors instead of numpy arrays (torch needed). Defaults to False.
        field: When the documents are mappings (a Hugging Face dataset's rows), the key that
            holds the tokens (an integer array or a list of ints). None means the mix's
            `field` over a `MixedDataset`, else the documents are arrays. Defaults to None.
        fields: The rows' convention: "torch" (variable-length `cu_seqlens`, batched with
            `collate_packed`), "jax" (fixed shapes, int32, `segment_ids` and `positions`;
            batched by the default collate) or "maxtext" (fixed shapes, int32, MaxText's
            names and shifted targets). Token ids and `pad_id` must fit int32 for "jax" and
            "maxtext". A loader state records it unless it is "torch". Defaults to "torch".

    Raises:
        TypeError: when `seq_len`, `window_size` or `rows_per_epoch` is not an int, or
            `field` is not a str.
        ValueError: when one is < 1, `method`, `long`, `window_unit` or `fields` is not an
            accepted value, the dataset is empty, its documents pack into no rows, `field`
            differs from the mix's, `pad_id` does not fit int32 with JAX fields, or (when a
            row is made) a token id does not fit int32 with JAX fields.
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
        field: str | None = None,
        window_unit: str = "rows",
        fields: str = "torch",
    ) -> None:
        self.seq_len = check_seq_len(seq_len)
        self.window_size = check_window_size(window_size)
        check_options(method, long)
        self.window_unit = check_window_unit(window_unit)
        self.fields = check_fields(fields)
        self.method, self.long, self.pad_id, self.tensors = method, long, int(pad_id), bool(tensors)
        if self.fields != "torch":
            check_int32(self.pad_id, "pad_id")
        self.dataset = dataset
        inner = dataset.field if isinstance(dataset, MixedDataset) else None  # HasField
        if field is None:
            field = inner
        elif not isinstance(field, str):
            fail(TypeError, "field", "a str or None", field)
        elif isinstance(dataset, MixedDataset) and inner != field:
            raise ValueError(
                f"field should be the mix's field {inner!r} or None, but got field={field!r}: "
                "give it to the MixedDataset"
            )
        self.field = field
        self._stream = _Stream(dataset, field)
        self._cum: list[int] = [0]  # rows before each window packed so far, then their total
        self._tokens: list[int] = []  # real tokens of each window packed so far
        self._starts: list[int] = [0]  # rows unit: each packed window's first document, then the next's
        self._carried: dict[int, list[Piece]] = {0: []}  # rows unit: carried into every _CHECKPOINT-th window
        self._frontier: list[Piece] = []  # rows unit: what the last packed window carries on
        self._read_at, self._read = 0, np.zeros(0, np.int64)  # rows unit: lengths read ahead
        # window -> (rows, pieces carried on): the windows packed last
        self._packed: OrderedDict[int, tuple[list[Row], list[Piece]]] = OrderedDict()
        self._lock = threading.RLock()  # thread workers share the table and the packed windows
        _LOCKED.add(self)
        if rows_per_epoch is None:
            if self.window_unit == "rows":  # the windows whose first document is in the first pass
                while self._starts[-1] < self._stream.size and self._grow_rows(len(self._tokens) + 1):
                    pass
                windows = len(self._tokens)
            else:
                windows = math.ceil(self._stream.size / self.window_size)
                self._grow_to_window(windows)
            rows_per_epoch = self._cum[windows]
            if rows_per_epoch < 1:
                raise ValueError(
                    f"the first {self._stream.size} documents pack into no rows: every one is empty"
                    + (f" or longer than seq_len {self.seq_len} (long='drop')" if self.long == "drop" else "")
                )
        self.rows_per_epoch = int(check_int("rows_per_epoch", rows_per_epoch, low=1))

    def __len__(self) -> int:
        return self.rows_per_epoch

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        _LOCKED.add(self)

    def _first_doc(self, window: int) -> int:
        """The stream position of the first document `window` takes (rows unit: of a packed window)."""
        return self._starts[window] if self.window_unit == "rows" else window * self.window_size

    def _keep(self, window: int, rows: list[Row], carry: list[Piece]) -> None:
        self._packed[window] = (rows, carry)
        if len(self._packed) > _WINDOWS_KEPT:
            self._packed.popitem(last=False)

    def _window_rows(self, window: int, lengths: np.ndarray | None = None) -> list[Row]:
        """The rows of a window the table covers; pieces name documents by their index in the
        window (documents unit) or by stream position (rows unit)."""
        with self._lock:  # reentrant: _grow_to_window holds it too
            kept = self._packed.get(window)
            if kept is not None:
                self._packed.move_to_end(window)
                return kept[0]
            if self.window_unit == "rows":
                return self._pack_rows_window(window, self._carried_into(window))
            if lengths is None:
                start = window * self.window_size
                lengths = self._stream.lengths(start, start + self.window_size)
            rows = pack_window(lengths, self.seq_len, self.method, self.long)  # type: ignore[arg-type]
            self._keep(window, rows, [])
            return rows

    def _pack_rows_window(self, window: int, carried: list[Piece], lengths: np.ndarray | None = None) -> list[Row]:
        a, b = self._starts[window], self._starts[window + 1]
        if lengths is None:
            lengths = self._stream.lengths(a, b)
        rows, carry = pack_rows_window(
            carried,
            lengths,
            a,
            self.window_size,
            self.seq_len,
            self.method,  # type: ignore[arg-type]
            self.long,  # type: ignore[arg-type]
        )
        self._keep(window, rows, carry)
        return rows

    def _carried_into(self, window: int) -> list[Piece]:
        """The pieces carried into a window the table covers: from the previous window's kept
        packing, else packed again from the last checkpoint (at most _CHECKPOINT - 1 windows)."""
        if window in self._carried:
            return self._carried[window]
        kept = self._packed.get(window - 1)
        if kept is not None:
            return kept[1]
        at = window - window % _CHECKPOINT
        carried = self._carried[at]
        for w in range(at, window):
            self._pack_rows_window(w, carried)
            carried = self._packed[w][1]
        return carried

    def _lengths_ahead(self, start: int, count: int) -> np.ndarray:
        """The lengths of documents [start, start + count), through a read-ahead buffer (the
        table grows window after window, each taking the documents after the last)."""
        end = self._read_at + len(self._read)
        if start < self._read_at or start + count > end:
            if not self._read_at <= start <= end:
                self._read_at, self._read = start, np.zeros(0, np.int64)
                end = start
            more = self._stream.lengths(end, max(start + count, end + _READ))
            self._read = np.concatenate([self._read[start - self._read_at :], more])
            self._read_at = start
        return self._read[start - self._read_at : start - self._read_at + count]

    def _grow_rows(self, windows: int) -> bool:
        """Pack rows windows until the table covers the first `windows`; False when a window
        made no row and carried nothing (a whole pass of the stream gave nothing to pack)."""
        K, size = self.window_size, self._stream.size
        while len(self._tokens) < windows:
            window, carried = len(self._tokens), self._frontier
            first, tokens = self._starts[-1], sum(e - s for _, s, e in carried)
            count = min(size, _READ)
            while True:  # a window takes at most one pass of the stream
                ahead = piece_tokens(self._lengths_ahead(first, count), self.seq_len, self.long)  # type: ignore[arg-type]
                take = window_take(tokens, ahead, K, self.seq_len)
                if take is not None or count >= size:
                    take = size if take is None else take
                    break
                count = min(size, 2 * count)
            self._starts.append(first + take)
            rows = self._pack_rows_window(window, carried, self._lengths_ahead(first, take))
            self._frontier = self._packed[window][1]
            if (window + 1) % _CHECKPOINT == 0:
                self._carried[window + 1] = self._frontier
            tokens += int(ahead[:take].sum()) - sum(e - s for _, s, e in self._frontier)
            self._tokens.append(tokens)
            self._cum.append(self._cum[-1] + len(rows))
            if not rows and not self._frontier:
                return False
        return True

    def _grow_to_window(self, windows: int) -> None:
        """Pack windows until the table covers the first `windows` of them (rows unit: or until
        a window gives nothing to pack, which `locate` reports)."""
        K = self.window_size
        with self._lock:
            if self.window_unit == "rows":
                self._grow_rows(windows)
                return
            while len(self._tokens) < windows:
                first = len(self._tokens)
                count = max(1, min(_GROW, windows - first))
                lengths = self._stream.lengths(first * K, (first + count) * K)
                for n in range(count):
                    rows = self._window_rows(first + n, lengths[n * K : (n + 1) * K])
                    self._tokens.append(sum(e - s for row in rows for _, s, e in row))
                    self._cum.append(self._cum[-1] + len(rows))

    def locate(self, row: int) -> tuple[int, int]:
        """The (window, row within the window) of a row of the packed stream.

        Args:
            row: The row (an int >= 0, counted across epochs).

        Raises:
            IndexError: when `row` is negative.
            TypeError: when it is not an int.
        """
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
            raise TypeError(f"a PackedDataset's index should be an int row, but got {type(row).__name__}")
        if row < 0:
            raise IndexError(f"row {row} is negative: packed rows are numbered from the stream's start")
        with self._lock:
            empty_from = len(self._tokens)  # the stream must give a row within one pass of its documents
            while self._cum[-1] <= row:
                before = len(self._tokens)
                self._grow_to_window(before + _GROW)
                if self._cum[-1] > self._cum[before]:
                    empty_from = len(self._tokens)
                elif (
                    self._first_doc(len(self._tokens)) - self._first_doc(empty_from)
                    > self._stream.size + self.window_size
                ):
                    raise ValueError(
                        f"row {row} is past the end of the packed stream: a whole pass of the "
                        f"{self._stream.size} documents after row {self._cum[-1] - 1} gives no row"
                    )
            window = bisect.bisect_right(self._cum, row) - 1
            return window, int(row) - self._cum[window]

    def pieces(self, row: int) -> list[tuple[int, int, int]]:
        """What a row holds: (stream position, start, end) of each document piece in it, in
        the order the row holds them.

        Args:
            row: The row (an int >= 0).
        """
        window, r = self.locate(row)
        base = 0 if self.window_unit == "rows" else window * self.window_size
        return [(base + d, s, e) for d, s, e in self._window_rows(window)[r]]

    def __getitem__(self, row: int) -> dict[str, Any]:
        pieces = self.pieces(row)
        docs: dict[int, np.ndarray] = {}
        for p, _, e in pieces:
            if p not in docs:
                doc = self._stream.get(p)
                declared = self._stream.declared(p)
                if declared is not None and len(doc) != declared:
                    raise ValueError(
                        f"{self._stream.where(p)} has {len(doc)} tokens, but its dataset's `lengths` "
                        f"gives {declared}: rows are packed from the lengths, so each should be its "
                        "document's length"
                    )
                if len(doc) < e:
                    raise ValueError(
                        f"{self._stream.where(p)} has {len(doc)} tokens, but its length was given as at least {e}"
                    )
                docs[p] = doc
        keys = list(docs)
        arrays = build_row(
            [docs[k] for k in keys], [(keys.index(p), s, e) for p, s, e in pieces], self.seq_len, self.pad_id
        )
        if self.fields != "torch":
            arrays = convert_row(arrays, self.seq_len, self.fields, self.pad_id, f"row {row}")
        if self.tensors:
            import torch

            return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in arrays.items()}
        return arrays

    def utilisation(self) -> float:
        """Real tokens over row tokens (rows x seq_len) of the windows packed so far."""
        rows = self._cum[-1]
        return sum(self._tokens) / (rows * self.seq_len) if rows else 0.0

    def stoker_describe(self) -> dict[str, Any]:
        """What a loader state saved over this dataset must agree on: every argument that
        changes a row (not `tensors`, which changes only the rows' type; `fields` only when it
        is not "torch", so that states saved before it existed still load), the stream's size,
        and the documents' own description, under `mix.` for a `MixedDataset` and `data.`
        for any other dataset (see the mixing guide's table of what a state records).

        This is the one place a new row-changing argument is recorded: add its key here
        (tests/unit/test_stream_identity.py fails until every argument is accounted for)."""
        out: dict[str, Any] = {
            "seq_len": self.seq_len,
            "window_size": self.window_size,
            "window_unit": self.window_unit,
            "method": self.method,
            "long": self.long,
            "pad_id": self.pad_id,
            "rows_per_epoch": self.rows_per_epoch,
            "field": self.field,
            "documents": self._stream.size,
        }
        if self.fields != "torch":  # the rows' names, dtypes and shapes (and MaxText's shifted targets)
            out["fields"] = self.fields
        inner = "mix" if isinstance(self.dataset, MixedDataset) else "data"
        out.update(prefixed(inner, describe_data(self.dataset)))
        return out

    def stoker_doctor_lines(self) -> list[str]:
        """The doctor's lines: packing utilisation over the first epoch (at most its first
        100,000 rows), then the mix's over the same documents."""
        windows = self.locate(min(self.rows_per_epoch, _DOCTOR_ROWS) - 1)[0] + 1
        rows, tokens = self._cum[windows], sum(self._tokens[:windows])
        lines = [
            f"packing: {self.method}, seq_len {self.seq_len}, {self.window_size} {self.window_unit} a window: "
            f"{rows:,} rows from {windows:,} windows, utilisation {tokens / (rows * self.seq_len):.4f} "
            "(real tokens over row tokens)"
        ]
        if isinstance(self.dataset, MixedDataset):  # the mix's report over the same documents
            lines.extend(self.dataset.stoker_doctor_lines(0, self._first_doc(windows)))
        elif follows(self.dataset, ReportsToDoctor):
            lines.extend(self.dataset.stoker_doctor_lines())
        return lines

    def stoker_fetches_ahead(self) -> bool:
        """Whether the documents' dataset fetches ahead (a `ShardedDataset`, or a mix of
        sources of which one does): only then does the loader draw this dataset's rows ahead."""
        return upcoming_of(self.dataset) is not None

    def stoker_upcoming(self, indices: list[int], behind: int) -> bool:
        """Pass the documents of a batch's rows on to the dataset that fetches ahead, in order.

        Args:
            indices: The batch's rows.
            behind: How many earlier batches may still be unread by the workers.

        Returns:
            True when the documents' dataset wants the drawing to run further ahead (True,
            too, when it does not fetch ahead).
        """
        inner = self.dataset
        hook = upcoming_of(inner)
        if hook is None:
            return True
        positions = list(dict.fromkeys(p for row in indices for p, _, _ in self.pieces(row)))
        if isinstance(inner, MixedDataset):
            return inner.upcoming_positions(positions, behind)
        return bool(hook([p % self._stream.size for p in positions], behind))

    def __repr__(self) -> str:
        return (
            f"PackedDataset(seq_len={self.seq_len}, window_size={self.window_size}, window_unit={self.window_unit!r}, "
            f"method={self.method!r}, rows_per_epoch={self.rows_per_epoch}"
            + (f", fields={self.fields!r})" if self.fields != "torch" else ")")
        )


def collate_packed(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Batch packed rows: fixed-size fields stacked to (batch, seq_len); `cu_seqlens` for the
    batch flattened to batch * seq_len tokens, where each row's padding tail (if any) is a
    segment of its own so that the boundaries stay contiguous (its labels are -100);
    `max_seqlen` the longest segment. numpy rows give numpy, torch rows torch tensors.

    Args:
        rows: `PackedDataset` rows made with `fields="torch"`, all of the same `seq_len`.

    Raises:
        ValueError: when `rows` is empty, the rows' lengths differ, or they are rows of
            `fields="jax"` or `"maxtext"` (fixed shapes: the default collate batches them).
    """
    if not rows:
        raise ValueError("collate_packed needs at least one row")
    if "position_ids" not in rows[0] or "max_seqlen" not in rows[0]:
        raise ValueError(
            f"collate_packed batches rows of PackedDataset(fields='torch'), but got a row with fields "
            f"{sorted(rows[0])}: rows of fields='jax' or 'maxtext' have fixed shapes, batch them with the "
            "default collate (leave collate_fn out)"
        )
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
