"""Sequence packing as a pure function of the input sequence and the window size K.

Documents are 1-D integer arrays of token ids; rows hold `seq_len` tokens. The input
sequence is cut into windows, each packed into rows, so a packed row is addressed by
(window, row). A window is measured in one of two units:

* **documents** (`pack_window`): window w holds documents [w*K, (w+1)*K)
  (the last may hold fewer) and is packed on its own, so any window can be rebuilt from
  its K documents alone, on any worker, in any order. Its last row is usually part empty:
  when K documents make only a few rows, that tail costs a few points of utilisation.
* **rows** (`pack_rows_window`): a window makes at most R = K rows
  (exactly R while the stream lasts). It takes the pieces the previous window carried over,
  then documents in order until their tokens, with the carried ones, fill R rows
  (`window_take`); the pieces that none of its R rows takes are carried to the next
  window, where they are placed first. No row is left part empty for want of documents,
  so utilisation is what the packer achieves (about 99.9 % on lognormal lengths at
  K = 64, 8,192 tokens a row). A window is rebuilt from its documents and the pieces
  carried into it, which the previous window's packing gives: the windows form a chain,
  packed from lengths alone, as the rows-per-window table of the document unit is.

Packing a window (`pack_window`) sees only the documents' lengths and returns rows, each a list
of pieces ``(doc_index_in_window, start, end)``:

* ``"greedy"`` is first-fit in document order: each piece goes to the first (lowest
  index) row with room, else a new row. The first row with room is found in
  O(log rows) with a max-tree over the rows' remaining room.
* ``"best_fit"`` is best-fit decreasing: pieces longest first (ties: document order,
  then piece order), each into the row with the least room left that still fits it
  (ties: the lowest row index), else a new row. The fitting row is found by bisecting a
  sorted list of the open rows' remaining room.

In a window measured in rows, the carried pieces are placed before the window's own, in
stream order (oldest first), then the window's own as above; a piece that no open row fits
opens a new row only while fewer than R are open, else it is carried on. So a carried piece
waits only behind older ones: it is placed in the next window unless the pieces carried into
it need more than R rows (documents of more than seq_len / 2 tokens, more of them than R).

Within a row, pieces are listed in document order (then piece order), whatever order
they were placed in. Rows are numbered in the order they were opened.

Documents longer than `seq_len`: with ``long="split"`` they are cut into `seq_len`-sized
pieces from the start (each a full row of its own) and the last, shorter piece is packed
like a document; no other document is ever split. A document's pieces are not
necessarily in increasing row order; their (start, end) say where they belong. With
``long="drop"`` such documents are left out. Empty documents produce no pieces.

`build_row` turns one row's pieces into the arrays training code consumes; see its
docstring for the conventions (cu_seqlens leaves the padding tail out). `convert_row` gives
the same row in the fixed-shape conventions of JAX models (``fields="jax"`` or
``"maxtext"``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from .._base.checks import check_choice, check_int

Piece = tuple[int, int, int]
Row = list[Piece]
Method = Literal["greedy", "best_fit"]
Long = Literal["split", "drop"]
Unit = Literal["documents", "rows"]
Fields = Literal["torch", "jax", "maxtext"]

METHODS = ("greedy", "best_fit")
LONG = ("split", "drop")
UNITS = ("documents", "rows")
FIELDS = ("torch", "jax", "maxtext")
IGNORE_INDEX = -100
_INT32 = np.iinfo(np.int32)


def check_seq_len(seq_len: int) -> int:
    """`seq_len` as an int >= 1 (see `check_int`)."""
    return int(check_int("seq_len", seq_len, low=1))


def check_window_size(window_size: int) -> int:
    """`window_size` (K: documents or rows per window) as an int >= 1 (see `check_int`)."""
    return int(check_int("window_size", window_size, low=1))


def check_window_unit(window_unit: str) -> str:
    """`window_unit`, one of UNITS."""
    return check_choice("window_unit", window_unit, UNITS)


def check_fields(fields: str) -> str:
    """`fields`, one of FIELDS."""
    return check_choice("fields", fields, FIELDS)


def check_int32(value: int, name: str) -> int:
    """`value` as an int that fits int32 (the JAX rows' dtype): ValueError naming `name` if not."""
    if not _INT32.min <= value <= _INT32.max:
        raise ValueError(f"{name} should fit int32 (the dtype of JAX rows), but got {value}")
    return int(value)


def check_options(method: str, long: str) -> None:
    """`method` is one of METHODS and `long` one of LONG."""
    check_choice("method", method, METHODS)
    check_choice("long", long, LONG)


def check_doc(doc: Any, index: int) -> np.ndarray:
    """`doc` as a 1-D integer array; errors name the document's index."""
    if not isinstance(doc, np.ndarray):
        raise TypeError(f"document {index} should be a numpy array, but got {type(doc).__name__}")
    if doc.ndim != 1:
        raise ValueError(f"document {index} should be 1-D, but got shape {doc.shape}")
    if doc.dtype.kind not in "iu":
        raise TypeError(f"document {index} should have an integer dtype, but got {doc.dtype}")
    return doc


def _check_lengths(lengths: Any) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths should be 1-D, but got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"lengths should be integers, but got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"lengths should be >= 0, but got lengths[{int(np.argmin(arr))}]={int(arr.min())}")
    return arr


def _pieces(lengths: np.ndarray, seq_len: int, long: str) -> list[Piece]:
    """The pieces to pack, in document order then piece order."""
    out: list[Piece] = []
    for i, n in enumerate(lengths.tolist()):
        if n == 0:
            continue
        if n <= seq_len:
            out.append((i, 0, n))
        elif long == "split":
            out.extend((i, s, min(s + seq_len, n)) for s in range(0, n, seq_len))
    return out


def _first_fit(sizes: list[int], seq_len: int, cap: int | None = None) -> list[int]:
    """Row index of each item under first-fit in the given order; -1 for an item that no
    open row fits when `cap` rows are open already (None: no cap)."""
    size = 1
    while size < max(len(sizes), 1):
        size *= 2
    # max-tree over remaining room; rows not opened yet have the full seq_len, so the
    # leftmost leaf with room is either the first open row that fits or the next new row
    tree = [seq_len] * (2 * size)
    out = []
    for n in sizes:
        i = 1
        while i < size:
            i *= 2
            if tree[i] < n:
                i += 1
        if cap is not None and i - size >= cap:
            out.append(-1)
            continue
        out.append(i - size)
        tree[i] -= n
        i //= 2
        while i:
            m = max(tree[2 * i], tree[2 * i + 1])
            if tree[i] == m:
                break
            tree[i] = m
            i //= 2
    return out


def _best_fit(sizes: list[int], seq_len: int, cap: int | None = None) -> list[int]:
    """Row index of each item under best-fit in the given order; -1 for an item that no
    open row fits when `cap` rows are open already (None: no cap)."""
    base = len(sizes) + 1
    # open rows with room left, each encoded as room * base + row so that the sort order
    # is (room, row): the first entry >= n * base is the tightest fit, lowest row first
    rooms: list[int] = []
    out = []
    n_rows = 0
    for n in sizes:
        pos = bisect.bisect_left(rooms, n * base)
        if pos == len(rooms):
            if n_rows == cap:
                out.append(-1)
                continue
            row, room = n_rows, seq_len - n
            n_rows += 1
        else:
            key = rooms.pop(pos)
            row, room = key % base, key // base - n
        out.append(row)
        if room > 0:
            bisect.insort(rooms, room * base + row)
    return out


def pack_window(lengths: Any, seq_len: int, method: Method = "best_fit", long: Long = "split") -> list[Row]:
    """Pack one window's documents, given their lengths, into rows of `seq_len` tokens.

    Returns the rows in the order they were opened, each a list of
    ``(doc_index_in_window, start, end)`` pieces in document order. Deterministic: the
    same lengths and arguments give the same rows.
    """
    seq_len = check_seq_len(seq_len)
    check_options(method, long)
    arr = _check_lengths(lengths)
    pieces = _pieces(arr, seq_len, long)
    if method == "best_fit":
        sizes = np.fromiter((e - s for _, s, e in pieces), dtype=np.int64, count=len(pieces))
        order = np.argsort(-sizes, kind="stable").tolist()
        pieces = [pieces[k] for k in order]
        rows_of = _best_fit(sizes[order].tolist(), seq_len)
    else:
        rows_of = _first_fit([e - s for _, s, e in pieces], seq_len)
    rows: list[Row] = [[] for _ in range(max(rows_of, default=-1) + 1)]
    for piece, r in zip(pieces, rows_of):
        rows[r].append(piece)
    for row in rows:
        row.sort()
    return rows


def piece_tokens(lengths: Any, seq_len: int, long: Long = "split") -> np.ndarray:
    """The tokens each document puts into rows (int64): its length, or 0 for one that
    `long="drop"` leaves out."""
    arr = _check_lengths(lengths)
    if long == "drop":
        return np.where(arr > seq_len, 0, arr)
    return arr


def window_take(carried: int, tokens: np.ndarray, rows: int, seq_len: int) -> int | None:
    """How many documents a window measured in rows takes: the fewest of `tokens` (each
    document's, from `piece_tokens`, starting at the window's first new document) that,
    with the `carried` tokens, fill `rows` rows of `seq_len`; 0 when the carried ones do;
    None when all of `tokens` do not (the caller reads further, or the stream has ended)."""
    need = rows * seq_len - carried
    if need <= 0:
        return 0
    cum = np.cumsum(tokens)
    n = int(np.searchsorted(cum, need, side="left"))
    return n + 1 if n < len(cum) else None


def pack_rows_window(
    carried: Sequence[Piece],
    lengths: Any,
    first: int,
    rows: int,
    seq_len: int,
    method: Method = "best_fit",
    long: Long = "split",
) -> tuple[list[Row], list[Piece]]:
    """Pack one window measured in rows: the `carried` pieces, then the documents at
    positions first, first + 1, ... (given their `lengths`), into at most `rows` rows.

    Pieces are ``(position, start, end)`` with positions in the stream (carried ones come
    before `first`). Returns the rows in the order they were opened, each in stream order,
    and the pieces carried to the next window, in stream order.
    """
    rows = check_window_size(rows)
    seq_len = check_seq_len(seq_len)
    check_options(method, long)
    arr = _check_lengths(lengths)
    old = np.asarray(carried, dtype=np.int64).reshape(-1, 3)
    doc, start, end = _piece_arrays(arr, seq_len, long)
    new = np.stack([doc + first, start, end], axis=1)
    # the carried pieces first, oldest first (so none waits behind younger ones); then the
    # window's own, in stream order for greedy, longest first for best-fit (a stable sort:
    # ties in stream order)
    old = old[np.lexsort((old[:, 1], old[:, 0]))]
    if method == "best_fit":
        new = new[np.argsort(new[:, 1] - new[:, 2], kind="stable")]
    order = np.concatenate([old, new])
    sizes = (order[:, 2] - order[:, 1]).tolist()
    fit = _best_fit if method == "best_fit" else _first_fit
    rows_of = np.asarray(fit(sizes, seq_len, rows), dtype=np.int64)
    # group by row, each row in stream order; the carried pieces (row -1) come first
    order = order[np.lexsort((order[:, 1], order[:, 0], rows_of))]
    counts = np.bincount(rows_of + 1, minlength=1).tolist()
    pieces = list(zip(*order.T.tolist())) if len(order) else []
    carry: list[Piece] = pieces[: counts[0]]
    packed: list[Row] = []
    at = counts[0]
    for n in counts[1:]:
        packed.append(pieces[at : at + n])
        at += n
    return packed, carry


def _piece_arrays(lengths: np.ndarray, seq_len: int, long: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_pieces` as three arrays (document index, start, end), in document order then piece order."""
    if long == "drop":
        counts = ((lengths > 0) & (lengths <= seq_len)).astype(np.int64)
    else:
        counts = -(-lengths // seq_len)
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    k = np.arange(len(doc), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    start = k * seq_len
    return doc, start, np.minimum(start + seq_len, lengths[doc])


def build_row(docs: Sequence[np.ndarray], pieces: Row, seq_len: int, pad_id: int = 0) -> dict[str, Any]:
    """One packed row, as training code consumes it.

    `docs` are the window's documents (indexed by the pieces' doc_index_in_window).

    * ``input_ids`` (int64, seq_len): the pieces' tokens back to back, then `pad_id`.
    * ``position_ids`` (int32, seq_len): 0, 1, 2... restarting at each piece; 0 on padding.
    * ``segment_ids`` (int32, seq_len): 1, 2, 3... per piece, 0 on padding.
    * ``cu_seqlens`` (int32, pieces + 1): 0 then the cumulative piece lengths, as
      variable-length attention kernels take them. The padding tail is *not* a segment:
      ``cu_seqlens[-1]`` is the number of real tokens.
    * ``max_seqlen`` (int): the longest piece (0 for an empty row).
    * ``labels`` (int64, seq_len): ``input_ids`` with -100 at the first token of each
      piece (its predecessor belongs to another segment) and on padding.
    """
    seq_len = check_seq_len(seq_len)
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    position_ids = np.zeros(seq_len, dtype=np.int32)
    segment_ids = np.zeros(seq_len, dtype=np.int32)
    cu = np.zeros(len(pieces) + 1, dtype=np.int32)
    at = 0
    max_seqlen = 0
    for k, (d, s, e) in enumerate(pieces):
        if d < 0 or d >= len(docs):
            raise ValueError(f"piece {k} names document {d}, but the window has {len(docs)}")
        doc = check_doc(docs[d], d)
        n = e - s
        if s < 0 or n < 1 or e > len(doc):
            raise ValueError(f"piece {k} ({s}, {e}) is not a non-empty part of document {d}")
        if at + n > seq_len:
            raise ValueError(f"pieces overflow seq_len {seq_len} at piece {k}")
        input_ids[at : at + n] = doc[s:e]
        position_ids[at : at + n] = np.arange(n, dtype=np.int32)
        segment_ids[at : at + n] = k + 1
        at += n
        cu[k + 1] = at
        max_seqlen = max(max_seqlen, n)
    labels = input_ids.copy()
    labels[cu[:-1]] = IGNORE_INDEX
    labels[at:] = IGNORE_INDEX
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "cu_seqlens": cu,
        "max_seqlen": max_seqlen,
        "labels": labels,
    }


def convert_row(
    row: dict[str, Any], seq_len: int, fields: str, pad_id: int = 0, where: str = "the row"
) -> dict[str, Any]:
    """`build_row`'s row in the convention `fields` names. The JAX conventions hold int32
    fields of fixed shapes only, so that a default collate stacks a batch into one static
    shape (a jitted step compiles once):

    * ``"torch"``: the row as it is.
    * ``"jax"``: ``input_ids``, ``segment_ids`` (1, 2, ... per piece, 0 on padding),
      ``positions`` (0, 1, ... restarting at each piece, 0 on padding) and ``labels`` (-100
      at each piece's first token and on padding), each (seq_len,), and ``cu_seqlens``
      (seq_len + 1,): the row's boundaries, then its last one (the number of real tokens)
      repeated, so the segments after the row's pieces are empty (length 0) and a kernel that
      reads segment i as [cu[i], cu[i + 1]) skips them. ``max_seqlen`` is left out: seq_len
      bounds it, and a jitted kernel needs a static bound.
    * ``"maxtext"``: MaxText's names and its shifted targets: ``inputs``,
      ``inputs_segmentation``, ``inputs_position`` (the tokens, segments and positions
      above); ``targets`` (token t + 1 where it is in the same piece as token t, else
      `pad_id`); ``targets_segmentation`` (token t's segment where it has such a target,
      else 0: the loss weights); ``targets_position`` (the positions); and ``cu_seqlens`` as
      for ``"jax"``.

    Raises:
        ValueError: when `fields` is not one of FIELDS, or a token id does not fit int32
            (naming `where`).
    """
    check_fields(fields)
    if fields == "torch":
        return row
    ids = row["input_ids"]
    low, high = (int(ids.min()), int(ids.max())) if len(ids) else (0, 0)
    if low < _INT32.min or high > _INT32.max:
        bad = low if low < _INT32.min else high
        raise ValueError(f"{where} holds token id {bad}, which does not fit int32 (the dtype of fields={fields!r})")
    tokens = ids.astype(np.int32)
    segments, positions = row["segment_ids"], row["position_ids"]
    cu = np.full(seq_len + 1, row["cu_seqlens"][-1], dtype=np.int32)
    cu[: len(row["cu_seqlens"])] = row["cu_seqlens"]
    if fields == "jax":
        return {
            "input_ids": tokens,
            "segment_ids": segments,
            "positions": positions,
            "labels": row["labels"].astype(np.int32),
            "cu_seqlens": cu,
        }
    # token t predicts token t + 1 only within its own piece, as `labels` has it
    has_next = np.zeros(seq_len, dtype=bool)
    has_next[:-1] = (segments[1:] == segments[:-1]) & (segments[:-1] > 0)
    targets = np.full(seq_len, pad_id, dtype=np.int32)
    np.copyto(targets[:-1], tokens[1:], where=has_next[:-1])
    return {
        "inputs": tokens,
        "inputs_segmentation": segments,
        "inputs_position": positions,
        "targets": targets,
        "targets_segmentation": segments * has_next,
        "targets_position": positions.copy(),
        "cu_seqlens": cu,
    }
