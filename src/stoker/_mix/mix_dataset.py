"""`MixedDataset`: several datasets mixed in set proportions, indexed by position of the mix
(counted across epochs), over `WeightedMix`."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Sequence, Sized
from typing import Any

import numpy as np

from .._base.checks import check_choice, check_int, fail
from .._base.hooks import HasShards, KnowsLengths, follows, upcoming_of
from .._data.datasets import Dataset
from .._data.identity import describe_data, prefixed
from .._shards.sampler import global_order
from .mix_order import MODES, WeightedMix, _pieces, integer_weights
from .tokens import _describe, lengths_of

WEIGH = ("documents", "tokens")
_DOCTOR_POSITIONS = 100_000  # what the doctor's report covers at most
_ORDER_TAG = 0x6D6F72  # keeps the sharded sources' orders apart from other streams of the seed
TOKEN_RESOLUTION = 1 << 16  # document weights made from token weights: shares to 1/65,536


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
        window_shards: A `ShardedDataset` source (anything with `shard_starts`) walks each
            pass in `ShardedSampler`'s order rather than a uniform shuffle: its shards
            shuffled, its samples shuffled within windows of this many shards, so that it
            reads each shard in one stretch through its cache. Defaults to 4.
        field: When the sources' samples are mappings (a Hugging Face dataset's rows, a
            `ShardedDataset`'s samples), the key that holds the document's tokens (an integer
            array or a list of ints), for `weigh="tokens"` and for a `PackedDataset` over this
            mix. None means the samples are the documents. `ds[p]` is the sample as the source
            gives it either way. Defaults to None.

    Raises:
        ValueError: when `sources` is empty; when `weights` (or a piece of the schedule) has
            another length than `sources`, a negative or non-finite entry, or is all zero; when
            the schedule's starts are not 0 then increasing; when `weigh`, `exhausted`, `seed`,
            `length` or `window_shards` is not one of the accepted values; when a source of
            positive weight is empty; when `tokens` has another length than `sources`.
        TypeError: when `sources` is not a list, a source is not a map-style dataset, `field`
            is not a str, or `seed`, `length` or `window_shards` is not an int.
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
        field: str | None = None,
        window_shards: int = 4,
    ) -> None:
        if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence):
            raise TypeError(f"sources should be a list of datasets, but got {_describe(sources)}")
        if not sources:
            raise ValueError("sources should be a non-empty list of datasets, but got an empty one")
        for i, src in enumerate(sources):
            if not isinstance(src, Sized) or not hasattr(src, "__getitem__"):
                raise TypeError(
                    f"sources[{i}] should be a map-style dataset (with __len__ and __getitem__), but got {type(src).__name__}"
                )
        check_choice("weigh", weigh, WEIGH)
        check_choice("exhausted", exhausted, MODES)
        seed = int(check_int("seed", seed, low=0))
        self.sources = list(sources)
        self.sizes = [len(s) for s in self.sources]
        self.weigh, self.exhausted, self.seed = weigh, exhausted, seed
        if field is not None and not isinstance(field, str):
            fail(TypeError, "field", "a str or None", field)
        self.field = field
        self.window_shards = int(check_int("window_shards", window_shards, low=1))
        self._orders = [self._shard_order(s, src) for s, src in enumerate(self.sources)]
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
        length = check_int("length", length, low=1, none_ok=True)
        if first.length is None:
            self.length = sum(self.sizes) if length is None else length
        else:
            self.length = first.length if length is None else length
            if self.length > first.length:
                raise ValueError(
                    f"length should be at most the mix's {first.length} positions, but got length={length}"
                )
        if self.length < 1:
            raise ValueError(f"length should be an int >= 1, but got length=None (the mix has {self.length} positions)")
        self.length = int(self.length)

    def _mean_lengths(self, tokens: Sequence[int] | None) -> list[float]:
        if tokens is not None:
            if len(tokens) != len(self.sources):
                raise ValueError(
                    f"tokens should have one entry per source ({len(self.sources)}), but got {len(tokens)} entries"
                )
            totals = [int(t) for t in tokens]
        else:
            totals = [
                int(lengths_of(src, np.arange(n), f"source {i}", self.field).sum())
                for i, (src, n) in enumerate(zip(self.sources, self.sizes))
            ]
        return [t / n if n else 0.0 for t, n in zip(totals, self.sizes)]

    def _shard_order(self, s: int, source: Any) -> Callable[[int, int], np.ndarray] | None:
        """A sharded source's order for each (mix epoch, pass): `ShardedSampler`'s (shards
        shuffled, samples shuffled within windows of `window_shards` shards), so that the
        source reads each shard in one stretch; None for any other source."""
        if not follows(source, HasShards):
            return None
        starts = source.shard_starts
        seed = int(np.random.SeedSequence([_ORDER_TAG, self.seed, s]).generate_state(1, np.uint64)[0]) >> 1
        return _ShardOrder(np.asarray(starts, dtype=np.int64), seed, self.window_shards)

    def _mix(self, epoch: int) -> WeightedMix:
        mix = self._mixes.get(epoch)
        if mix is None:
            mix = WeightedMix(
                self.sizes, self._schedule, seed=self.seed, epoch=epoch, mode=self.exhausted, orders=self._orders
            )
            mixes = OrderedDict(self._mixes)  # replaced whole: thread workers may be reading it
            mixes[epoch] = mix
            if len(mixes) > 2:
                mixes.popitem(last=False)
            self._mixes = mixes
        return mix

    def _locate(self, position: int) -> tuple[WeightedMix, int]:
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
            raise TypeError(f"a MixedDataset's index should be an int position, but got {type(position).__name__}")
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
        `lengths` arrays where they have them (what `PackedDataset` packs from).

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
            out[mask] = lengths_of(self.sources[src], j[mask], f"source {src}", self.field)
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
        if self.weigh == "tokens" or all(
            follows(x, KnowsLengths) and isinstance(x.lengths, np.ndarray) for x in self.sources
        ):
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

    def upcoming_positions(self, positions: Sequence[int], behind: int) -> bool:
        """Tell the sources that fetch ahead (`stoker_upcoming`) which of their samples the mix's
        `positions` need (in order); True when all of those told want to be told more.

        Args:
            positions: Positions of the mix, as a batch or a packed row needs them.
            behind: How many earlier batches may still be unread by the workers.
        """
        hooks = [upcoming_of(source) for source in self.sources]
        if not len(positions) or not any(hooks):
            return True
        pos = np.asarray(positions, dtype=np.int64)
        first, last = int(pos.min()), int(pos.max())
        if last - first < 4 * len(pos) + 64:
            block_s, block_j = self.sources_block(first, last + 1)
            s, j = block_s[pos - first], block_j[pos - first]
        else:
            pairs = np.array([self.source_at(int(p)) for p in pos], dtype=np.int64).reshape(-1, 2)
            s, j = pairs[:, 0], pairs[:, 1]
        more = True
        for src in dict.fromkeys(s.tolist()):
            hook = hooks[src]
            if hook is not None:
                more = bool(hook(j[s == src].tolist(), behind)) and more
        return more

    def stoker_fetches_ahead(self) -> bool:
        """Whether a source fetches ahead (a `ShardedDataset`): only then does the loader draw
        this mix's positions ahead, and pass each source its own samples."""
        return any(upcoming_of(source) is not None for source in self.sources)

    def stoker_upcoming(self, indices: list[int], behind: int) -> bool:
        """Pass a batch's samples on to the sources that fetch ahead, each told its own.

        Args:
            indices: The batch's positions.
            behind: How many earlier batches may still be unread by the workers.

        Returns:
            True when every source that was told wants the drawing to run further ahead.
        """
        return self.upcoming_positions(indices, behind)

    def stoker_describe(self) -> dict[str, Any]:
        """What a loader state saved over this dataset must agree on: everything a position's
        (source, sample) depends on, and each source's own identity (`source.<i>.*`: a stoker
        dataset's description, any other's type, length and Hugging Face fingerprint; see
        the mixing guide's table of what a state records). Document weights made from token
        weights are recorded as made, so `tokens=` counts only through them; `window_shards`
        only when a source is sharded; `field` is the packing's (a `PackedDataset` records
        it)."""
        shard_ordered = [order is not None for order in self._orders]
        out: dict[str, Any] = {
            "sizes": self.sizes,
            "schedule_starts": [start for start, _ in self.schedule],
            "weights": [w for _, w in self.schedule],
            "weigh": self.weigh,
            "exhausted": self.exhausted,
            "seed": self.seed,
            "length": self.length,
            "shard_ordered": shard_ordered,
        }
        if self.weigh == "tokens":
            out["document_weights"] = [list(w) for _, w in self._schedule]
        if any(shard_ordered):
            out["window_shards"] = self.window_shards
        for i, source in enumerate(self.sources):
            out.update(prefixed(f"source.{i}", describe_data(source)))
        return out

    def stoker_doctor_lines(self, start: int = 0, stop: int | None = None) -> list[str]:
        """The lines `stoker doctor` prints for this dataset: the achieved and target shares
        and the largest deviation over runs of 1,000 positions.

        Args:
            start: The first position. Defaults to 0.
            stop: The position after the last. None means one epoch, or its first 100,000
                positions (reading lengths may read documents). Defaults to None.
        """
        if stop is None:
            stop = start + min(self.length, _DOCTOR_POSITIONS)
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


class _ShardOrder:
    """A sharded source's order of one (mix epoch, pass): a class, not a closure, so that a
    mix pickles into spawned workers."""

    def __init__(self, starts: np.ndarray, seed: int, window_shards: int) -> None:
        self.starts, self.seed, self.window_shards = starts, seed, window_shards

    def __call__(self, epoch: int, cycle: int) -> np.ndarray:
        return global_order(self.starts, self.seed, (epoch << 32) + cycle, self.window_shards)


def _token_to_document_weights(weights: Sequence[Any], means: Sequence[float]) -> list[int]:
    shares = []
    for i, (w, m) in enumerate(zip(weights, means)):
        w = float(w)
        if w > 0 and m <= 0:
            raise ValueError(f"source {i} should have tokens, as its token weight is positive, but it has none")
        shares.append(w / m if w > 0 else 0.0)
    total = sum(shares)
    ints = [max(1, round(x / total * TOKEN_RESOLUTION)) if x > 0 else 0 for x in shares]
    return ints
