"""Exact, deterministic weighted mixing of S sources (issue 34): the pure core under `MixedDataset`.

The mixed sequence is a sequence of (source, sample) pairs that is a function of (seed, epoch,
the weight schedule, the sizes, the exhaustion mode) alone, and it is addressable: `mixed_at(p)`
computes position p in O(S^2) integer steps (O(S) in the usual case) plus one permutation lookup,
without generating the prefix, so any rank or worker can compute any position and resume is exact
on any world size.

Which source (the pattern). Within a piece of the schedule with weights w (taken as exact
rationals: ints as they are, floats as `Fraction(w).limit_denominator(10**9)`) and shares
q_s = w_s / sum(w), the k-th draw of source s has the ideal time t(s, k) = (k + 1/2) / q_s
(Sainte-Lague's divisors); the pattern is the merge of all these times in increasing order, ties
going to the smaller source index. The counts of the first n positions are found in closed form
(c_s = floor(n q_s + 1/2), then at most S/2 single steps to fix the total), all in integers.

The bound. Let c_s(n) be source s's count among the first n positions of a piece. Cutting the
merged order at the time T of its n-th element gives |c_s(n) - T q_s| <= 1/2 for every s, hence
c_s(n) - n q_s = (1 - q_s)(c_s - T q_s) - q_s sum_{t != s} (c_t - T q_t) lies within
+-((1 - q_s) + q_s (S' - 1)) / 2, S' being the number of sources of positive weight. So over EVERY
window of W consecutive positions inside one piece,

    |count_s(window) - W q_s| <= 1 + q_s (S' - 2)        (<= 1 for two sources, <= S' - 1 always)

and every prefix of a piece is within half of that. The pattern is periodic (period
sum(w) / gcd for integer weights): 0.75/0.25 gives exactly 750/250 of any 1,000 positions.

Which sample. The k-th draw of source s is perm(seed, epoch, s, c)[k mod size_s] with
c = k // size_s: each source walks through its own shuffled orders, one per cycle ("per-source
epochs" are derived, not stored). A source of up to `MATERIALIZE_MAX` samples has its order made
by numpy (Philox) once per cycle and kept; a larger one is permuted index by index by a keyed
Feistel network with cycle walking (O(1) expected per sample, no memory of the size's order).

When a source runs out (k reaches size_s): "repeat" cycles again; "end" ends the mix at the
first position that would need such a draw; "stop" takes that source out of the mix at that
position and renormalises the others (a new piece starts there, with that source's weight 0;
the mix ends when no source is left).

A schedule is a list of (start_position, weights) pieces, the first starting at 0; positions are
counted in the mixed sequence, and the counts at each piece boundary are computed once at
construction.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from fractions import Fraction
from math import gcd
from typing import Any

import numpy as np

from .._base.checks import check_choice, check_int, check_number

MODES = ("repeat", "stop", "end")
_TAG = 0x6D6978  # "mix": keeps these permutations apart from other streams of the same seed
MATERIALIZE_MAX = 1 << 20  # larger sources are permuted index by index (Feistel), not materialised
_MASK64 = (1 << 64) - 1
TABLE_MAX = 1 << 22  # a pattern with a longer period is generated step by step, not from a table


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit words that scatters every bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def feistel_index(j: int, n: int, keys: Sequence[int]) -> int:
    """The image of j in [0, n) under a keyed permutation of [0, n): a balanced Feistel network on
    the smallest even number of bits covering n, walked until it lands inside [0, n)."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    low = (1 << half) - 1
    x = j
    while True:
        left, right = x >> half, x & low
        for key in keys:
            left, right = right, left ^ (_mix64(right ^ key) & low)
        x = (left << half) | right
        if x < n:
            return x


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """`_mix64` on a uint64 array (numpy's uint64 products wrap modulo 2**64, as wanted)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def feistel_many(js: np.ndarray, n: int, keys: Sequence[int]) -> np.ndarray:
    """`feistel_index` of every entry of `js` at once (same images, int64)."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    out = np.asarray(js, dtype=np.uint64).copy()
    todo = np.arange(len(out))
    x = out
    while len(todo):
        left, right = x >> shift, x & low
        for key in keys:
            left, right = right, left ^ (_mix64_array(right ^ np.uint64(key)) & low)
        x = (left << shift) | right
        inside = x < np.uint64(n)
        out[todo[inside]] = x[inside]
        todo, x = todo[~inside], x[~inside]
    return out.astype(np.int64)


def _as_fraction(value: Any) -> Fraction:
    if isinstance(value, (int, np.integer)):
        return Fraction(int(value))
    return Fraction(float(value)).limit_denominator(10**9)


def integer_weights(weights: Sequence[Any], sources: int) -> list[int]:
    """The weights as the smallest integers of the same ratios; ValueError naming `weights`."""
    try:
        values = list(weights)
    except TypeError:
        raise TypeError(f"weights should be a sequence of numbers, but got {weights!r}") from None
    if len(values) != sources:
        raise ValueError(f"weights should have one entry per source ({sources}), but got {len(values)} entries")
    fracs: list[Fraction] = []
    for i, v in enumerate(values):
        check_number(f"weights[{i}]", v, low=0)
        fracs.append(_as_fraction(v))
    if not any(fracs):
        raise ValueError("weights should have a positive entry, but got all zero")
    den = 1
    for fr in fracs:
        den = den * fr.denominator // gcd(den, fr.denominator)
    ints = [int(fr * den) for fr in fracs]
    g = 0
    for x in ints:
        g = gcd(g, x)
    return [x // g for x in ints]


def prefix_counts(w: Sequence[int], n: int) -> list[int]:
    """Each source's count among the first n positions of the pattern of integer weights w."""
    total = sum(w)
    # all draws with ideal time <= n: c_s = #{k >= 0 : (2k + 1) total <= 2 n w_s}
    c = [((2 * n * ws) // total + 1) // 2 if ws else 0 for ws in w]
    m = sum(c)
    while m < n:  # take the next draw: smallest (2c_s + 1) / w_s, ties to the smaller s
        best = -1
        for s, ws in enumerate(w):
            if ws and (best < 0 or (2 * c[s] + 1) * w[best] < (2 * c[best] + 1) * ws):
                best = s
        c[best] += 1
        m += 1
    while m > n:  # give back the last draw: largest (2c_s - 1) / w_s, ties to the larger s
        best = -1
        for s, ws in enumerate(w):
            if ws and c[s] and (best < 0 or (2 * c[s] - 1) * w[best] >= (2 * c[best] - 1) * ws):
                best = s
        c[best] -= 1
        m -= 1
    return c


def next_source(w: Sequence[int], c: Sequence[int]) -> int:
    """The source of the draw after counts c: smallest (2c_s + 1) / w_s, ties to the smaller s."""
    best = -1
    for s, ws in enumerate(w):
        if ws and (best < 0 or (2 * c[s] + 1) * w[best] < (2 * c[best] + 1) * ws):
            best = s
    return best


def period_table(w: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """One period (sum(w) positions) of the pattern of integer weights w: the source at each
    position and that draw's number within the period; None when the period exceeds TABLE_MAX.

    The pattern repeats with period T = sum(w): over T positions every source s takes exactly w_s
    draws, so the counts at position x are (x // T) w_s plus the draws of s in table[: x % T].
    The order is made from float64 keys (2k + 1) / w_s, which order exactly as the rationals do
    here: with T <= TABLE_MAX two distinct keys differ by at least 1 / (w_s w_t), far above
    float64's rounding, and equal rationals round to the same float.
    """
    total = sum(w)
    if total > TABLE_MAX:
        return None
    src = np.concatenate([np.full(ws, s, dtype=np.int64) for s, ws in enumerate(w) if ws])
    rank = np.concatenate([np.arange(ws, dtype=np.int64) for ws in w if ws])
    keys = (2 * rank + 1) / np.asarray(w, dtype=np.float64)[src]
    order = np.lexsort((src, keys))
    return src[order], rank[order]


def position_of(w: Sequence[int], s: int, m: int) -> int:
    """The position (within the pattern of integer weights w) of source s's draw number m."""
    ws = w[s]
    if not ws:
        raise ValueError(f"source {s} has weight 0: it is never drawn")
    pos = m
    for t, wt in enumerate(w):
        if t == s:
            continue
        a = (2 * m + 1) * wt  # t's draws j before it: (2j + 1) w_s < a (or <= a when t < s)
        q = a // ws if t < s else (a - 1) // ws
        pos += (q + 1) // 2 if q > 0 else 0
    return pos


class WeightedMix:
    """The mixed sequence of `sizes` sources under a weight `schedule`; see the module's docstring.

    `schedule` is either one weight vector or a list of (start_position, weights) pieces with
    strictly increasing starts, the first 0. `len(mix)` is defined only when the mix ends
    ("end" or "stop"); `length` is None for an endless mix.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        schedule: Any,
        seed: int = 0,
        epoch: int = 0,
        mode: str = "repeat",
        orders: Sequence[Callable[[int, int], np.ndarray] | None] | None = None,
    ) -> None:
        check_choice("mode", mode, MODES)
        self.sizes = [int(x) for x in sizes]
        if not self.sizes or any(x < 0 for x in self.sizes):
            raise ValueError(f"sizes should be one or more non-negative counts, but got {list(sizes)!r}")
        self.seed, self.epoch, self.mode = (
            int(check_int("seed", seed, low=0)),
            int(check_int("epoch", epoch, low=0)),
            mode,
        )
        # a source's own order per (epoch, cycle), in place of the shuffle (a sharded source's
        # shard-aware order); it must be a permutation of range(size)
        self.orders = list(orders) if orders is not None else [None] * len(self.sizes)
        S = len(self.sizes)
        pieces = _pieces(schedule)
        self.user_schedule = [(start, integer_weights(w, S)) for start, w in pieces]
        if mode == "repeat":
            for _, w in self.user_schedule:
                for s, ws in enumerate(w):
                    if ws and not self.sizes[s]:
                        raise ValueError(f"source {s} is empty but has a positive weight")
        # the effective pieces: (start, integer weights, counts drawn before the piece)
        self.starts: list[int] = []
        self.weights: list[list[int]] = []
        self.counts: list[list[int]] = []
        self.length: int | None = None
        self._build()
        self._perms: dict[int, tuple[int, np.ndarray]] = {}
        self._keys: dict[tuple[int, int], list[int]] = {}
        self._tables: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray] | None] = {}

    def _record(self, start: int, w: list[int], cum: list[int]) -> None:
        if self.starts and self.starts[-1] == start:  # an empty piece: the later one wins
            self.starts.pop(), self.weights.pop(), self.counts.pop()
        self.starts.append(start)
        self.weights.append(list(w))
        self.counts.append(list(cum))

    def _build(self) -> None:
        S = len(self.sizes)
        cum = [0] * S
        user = self.user_schedule
        for i, (start, w0) in enumerate(user):
            end = user[i + 1][0] if i + 1 < len(user) else None
            w = list(w0)
            st = start
            if self.mode == "stop":
                w = [0 if cum[s] >= self.sizes[s] else ws for s, ws in enumerate(w)]
            while True:
                if not any(w):
                    self.length = st
                    return
                if self.mode == "repeat":
                    hit = None
                else:
                    hit = min((position_of(w, s, self.sizes[s] - cum[s]), s) for s in range(S) if w[s])
                self._record(st, w, cum)
                if hit is not None and (end is None or st + hit[0] < end):
                    pos, s = hit
                    if self.mode == "end":
                        self.length = st + pos
                        return
                    cum = [a + b for a, b in zip(cum, prefix_counts(w, pos))]
                    st += pos
                    w[s] = 0
                    continue
                if end is not None:
                    cum = [a + b for a, b in zip(cum, prefix_counts(w, end - st))]
                break

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this mix is endless (mode 'repeat')")
        return self.length

    def _piece(self, p: int) -> int:
        if p < 0:
            raise IndexError(f"position {p} is negative")
        if self.length is not None and p >= self.length:
            raise IndexError(f"position {p} is past the end of the mix ({self.length})")
        return bisect.bisect_right(self.starts, p) - 1

    def perm(self, s: int, cycle: int) -> np.ndarray:
        """Source s's order in its cycle `cycle`: a function of (seed, epoch, s, cycle)."""
        kept = self._perms.get(s)
        if kept is not None and kept[0] == cycle:
            return kept[1]
        own = self.orders[s]
        if own is not None:
            order = np.asarray(own(self.epoch, cycle), dtype=np.int64)
        else:
            seq = np.random.SeedSequence([_TAG, self.seed, self.epoch, s, cycle])
            order = np.random.Generator(np.random.Philox(seq)).permutation(self.sizes[s])
        self._perms[s] = (cycle, order)
        return order

    def _feistel_keys(self, s: int, cycle: int) -> list[int]:
        keys = self._keys.get((s, cycle))
        if keys is None:
            seq = np.random.SeedSequence([_TAG, self.seed, self.epoch, s, cycle, 1])
            keys = [int(x) for x in seq.generate_state(6, np.uint64)]
            if len(self._keys) > 64:
                self._keys.clear()
            self._keys[(s, cycle)] = keys
        return keys

    def _sample(self, s: int, k: int) -> tuple[int, int]:
        size = self.sizes[s]
        cycle, j = divmod(k, size)
        if size > MATERIALIZE_MAX and self.orders[s] is None:
            return s, feistel_index(j, size, self._feistel_keys(s, cycle))
        return s, int(self.perm(s, cycle)[j])

    def source_at(self, p: int) -> tuple[int, int]:
        """(source, draw number k of that source) at position p."""
        i = self._piece(p)
        w = self.weights[i]
        c = prefix_counts(w, p - self.starts[i])
        s = next_source(w, c)
        return s, self.counts[i][s] + c[s]

    def mixed_at(self, p: int) -> tuple[int, int]:
        """(source, sample) at position p, without generating the positions before it."""
        return self._sample(*self.source_at(p))

    def block(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(sources, samples) as int64 arrays for positions [start, stop), vectorised: the same
        pairs as `mixed_at` at each position. `stop` is clipped to the end of a mix that ends."""
        if start < 0:
            raise IndexError(f"position {start} is negative")
        if self.length is not None:
            stop = min(stop, self.length)
        srcs: list[np.ndarray] = []
        draws: list[np.ndarray] = []
        p = start
        while p < stop:
            i = self._piece(p)
            end = self.starts[i + 1] if i + 1 < len(self.starts) else None
            upto = stop if end is None else min(stop, end)
            s, k = self._piece_block(i, p - self.starts[i], upto - self.starts[i])
            srcs.append(s)
            draws.append(k)
            p = upto
        if not srcs:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        s_all, k_all = np.concatenate(srcs), np.concatenate(draws)
        return s_all, self._samples(s_all, k_all)

    def _piece_block(self, i: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Sources and draw numbers of positions [a, b) of piece i (positions within the piece)."""
        w = self.weights[i]
        key = tuple(w)
        if key not in self._tables:
            self._tables[key] = period_table(w)
        table = self._tables[key]
        base = np.asarray(self.counts[i], dtype=np.int64)
        if table is None:  # a very long period: step by step from the counts at a
            c = prefix_counts(w, a)
            s_out = np.empty(b - a, np.int64)
            k_out = np.empty(b - a, np.int64)
            for n in range(b - a):
                s = next_source(w, c)
                s_out[n], k_out[n] = s, base[s] + c[s]
                c[s] += 1
            return s_out, k_out
        src, rank = table
        x = np.arange(a, b, dtype=np.int64)
        cycle, at = np.divmod(x, len(src))
        which = src[at]
        return which, base[which] + cycle * np.asarray(w, dtype=np.int64)[which] + rank[at]

    def _samples(self, sources: np.ndarray, draws: np.ndarray) -> np.ndarray:
        out = np.empty(len(sources), np.int64)
        for s in np.unique(sources).tolist():
            mask = sources == s
            size = self.sizes[s]
            cycles, js = np.divmod(draws[mask], size)
            got = np.empty(len(js), np.int64)
            for c in np.unique(cycles).tolist():
                at = cycles == c
                if size > MATERIALIZE_MAX and self.orders[s] is None:
                    got[at] = feistel_many(js[at], size, self._feistel_keys(s, c))
                else:
                    got[at] = self.perm(s, c)[js[at]]
            out[mask] = got
        return out


def _pieces(schedule: Any) -> list[tuple[int, Sequence[Any]]]:
    try:
        items = list(schedule)
    except TypeError:
        raise TypeError(f"weights should be a sequence of numbers, but got {schedule!r}") from None
    if items and all(isinstance(x, tuple) and len(x) == 2 for x in items):
        pieces = [(int(a), b) for a, b in items]
        starts = [a for a, _ in pieces]
        if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError(f"the schedule's starts should be 0 then strictly increasing, but got {starts}")
        return pieces
    return [(0, items)]
