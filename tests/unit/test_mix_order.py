"""Exact, deterministic weighted mixing (stoker._mix.mix_order)."""

from __future__ import annotations

import heapq
from fractions import Fraction

import numpy as np
import pytest

from stoker._mix.mix_order import WeightedMix, integer_weights, next_source, prefix_counts

WEIGHTS = [
    [0.75, 0.25],
    [1, 1],
    [0.5, 0.3, 0.2],
    [0.97, 0.01, 0.01, 0.01],
    [1, 2, 3, 4, 5],
    [0.6, 0.0, 0.4],
    [1 / 3, 1 / 7, 0.5, 0.02],
]


def iterate(mix, start=0):
    """The mix's sequence from `start`, generated step by step (counts carried along): the
    sequential oracle `mixed_at` and `block` are checked against."""
    p = start
    while mix.length is None or p < mix.length:
        i = mix._piece(p)
        w, base = mix.weights[i], mix.counts[i]
        end = mix.starts[i + 1] if i + 1 < len(mix.starts) else mix.length
        c = prefix_counts(w, p - mix.starts[i])
        while end is None or p < end:
            s = next_source(w, c)
            yield mix._sample(s, base[s] + c[s])
            c[s] += 1
            p += 1


def reference_sources(weights, n):
    """The source pattern by brute force: merge the ideal times (k + 1/2) / q_s with a heap."""
    total = sum(Fraction(w).limit_denominator(10**9) for w in weights)
    q = [Fraction(w).limit_denominator(10**9) / total for w in weights]
    heap = [((Fraction(1, 2) / qs), s, 0) for s, qs in enumerate(q) if qs]
    heapq.heapify(heap)
    out = []
    while len(out) < n:
        _, s, k = heapq.heappop(heap)
        out.append(s)
        heapq.heappush(heap, ((k + Fraction(3, 2)) / q[s], s, k + 1))
    return out


def bound(weights, s):
    q = weights[s] / sum(weights)
    live = sum(1 for w in weights if w > 0)
    return 1 + q * (live - 2)


def test_deterministic_and_seeded():
    a = WeightedMix([50, 70, 30], [0.5, 0.3, 0.2], seed=3, epoch=1)
    b = WeightedMix([50, 70, 30], [0.5, 0.3, 0.2], seed=3, epoch=1)
    seq = [a.mixed_at(p) for p in range(500)]
    assert seq == [b.mixed_at(p) for p in range(500)]
    assert seq != [WeightedMix([50, 70, 30], [0.5, 0.3, 0.2], seed=4, epoch=1).mixed_at(p) for p in range(500)]
    assert seq != [WeightedMix([50, 70, 30], [0.5, 0.3, 0.2], seed=3, epoch=2).mixed_at(p) for p in range(500)]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_pattern_matches_brute_force_merge(weights):
    sizes = [97] * len(weights)
    mix = WeightedMix(sizes, weights)
    ref = reference_sources(weights, 3000)
    assert [mix.source_at(p)[0] for p in range(3000)] == ref


@pytest.mark.parametrize("mode", ["repeat", "end", "stop"])
def test_mixed_at_equals_sequential(mode):
    sched = [(0, [0.5, 0.3, 0.2]), (700, [0.1, 0.1, 0.8]), (1500, [1, 0, 3])]
    mix = WeightedMix([300, 211, 1000], sched, seed=11, mode=mode)
    n = 4000 if mode == "repeat" else len(mix)
    seq = []
    for item in iterate(mix):
        seq.append(item)
        if len(seq) == n:
            break
    assert len(seq) == n
    rng = np.random.default_rng(0)
    for p in list(range(0, n, 7)) + list(rng.integers(0, n, 300)):
        assert mix.mixed_at(int(p)) == seq[int(p)], p
    # and from a later start
    it = iterate(mix, start=1234 % n)
    assert [next(it) for _ in range(50)] == seq[1234 % n : 1234 % n + 50]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_window_bound(weights):
    S = len(weights)
    mix = WeightedMix([10_000] * S, weights)
    n = 6000
    src = np.array([mix.source_at(p)[0] for p in range(n)])
    onehot = np.zeros((n + 1, S), dtype=np.int64)
    onehot[np.arange(1, n + 1), src] = 1
    cum = onehot.cumsum(axis=0)
    q = np.array(weights, dtype=float) / sum(weights)
    for W in (1, 2, 3, 7, 10, 33, 100, 257, 1000):
        counts = cum[W:] - cum[:-W]  # every window of W consecutive positions
        dev = np.abs(counts - W * q).max(axis=0)
        for s in range(S):
            assert dev[s] <= bound(weights, s) + 1e-9, (W, s, dev[s])


def test_three_quarters_exact():
    mix = WeightedMix([10**6, 10**6], [0.75, 0.25])
    src = np.array([mix.source_at(p)[0] for p in range(5000)])
    cum = np.concatenate([[0], np.cumsum(src == 0)])
    assert set((cum[1000:] - cum[:-1000]).tolist()) == {750}


def test_prefix_counts_sum_and_monotone():
    for weights in WEIGHTS:
        w = integer_weights(weights, len(weights))
        prev = [0] * len(w)
        for n in range(0, 2000):
            c = prefix_counts(w, n)
            assert sum(c) == n
            assert all(a >= b for a, b in zip(c, prev))
            prev = c


def test_each_cycle_visits_every_sample_once():
    sizes = [13, 40, 7]
    mix = WeightedMix(sizes, [0.2, 0.5, 0.3], seed=5)
    draws: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for p in range(2000):
        s, x = mix.mixed_at(p)
        draws[s].append(x)
    for s, xs in draws.items():
        full = len(xs) // sizes[s]
        assert full >= 3
        cycles = [xs[c * sizes[s] : (c + 1) * sizes[s]] for c in range(full)]
        for cyc in cycles:
            assert sorted(cyc) == list(range(sizes[s]))
        assert cycles[0] != cycles[1]  # a new order each cycle


def test_schedule_switch_changes_proportions():
    mix = WeightedMix([10**5] * 2, [(0, [0.9, 0.1]), (1000, [0.2, 0.8])])
    src = np.array([mix.source_at(p)[0] for p in range(2000)])
    assert (src[:1000] == 0).sum() == 900
    assert (src[1000:] == 0).sum() == 200
    # draw numbers continue across the boundary
    ks = [mix.source_at(p) for p in range(2000)]
    seen = {0: -1, 1: -1}
    for s, k in ks:
        assert k == seen[s] + 1
        seen[s] = k


def test_end_stops_at_first_exhaustion():
    mix = WeightedMix([10, 20], [0.75, 0.25], mode="end")
    assert len(mix) == 13  # source 0's positions 0,1,3,4,5,7,8,9,11,12; its 11th draw would be 13
    with pytest.raises(IndexError):
        mix.mixed_at(13)
    seq = list(iterate(mix))
    assert len(seq) == 13
    assert sorted(x for s, x in seq if s == 0) == list(range(10))
    assert [mix.mixed_at(p) for p in range(13)] == seq


def test_stop_renormalises():
    mix = WeightedMix([10, 20, 5], [0.5, 0.25, 0.25], mode="stop", seed=2)
    seq = list(iterate(mix))
    assert len(mix) == 35 == len(seq)
    for s, size in enumerate([10, 20, 5]):
        assert sorted(x for t, x in seq if t == s) == list(range(size))
    assert [mix.mixed_at(p) for p in range(35)] == seq


def test_bad_weights():
    for bad, words, error in [
        ([1, -1], "should be a finite number >= 0, but got weights[1]=-1", ValueError),
        ([0, 0], "all zero", ValueError),
        ([1], "per source (2)", ValueError),
        ([1, 2, 3], "per source (2)", ValueError),
        ([1, float("nan")], "should be a finite number >= 0, but got weights[1]=nan", ValueError),
        ([1, "x"], "should be a finite number >= 0, but got weights[1]='x'", TypeError),
        ([1, True], "should be a finite number >= 0, but got weights[1]=True", TypeError),
    ]:
        with pytest.raises(error, match="weights") as info:
            WeightedMix([5, 5], bad)
        assert words in str(info.value)
    with pytest.raises(ValueError, match="mode"):
        WeightedMix([5, 5], [1, 1], mode="loop")
    with pytest.raises(ValueError, match="starts"):
        WeightedMix([5, 5], [(0, [1, 1]), (0, [1, 2])])
    with pytest.raises(ValueError, match="empty"):
        WeightedMix([0, 5], [1, 1])


def test_large_sources_permuted_index_by_index(monkeypatch):
    import stoker._mix.mix_order as mixing

    monkeypatch.setattr(mixing, "MATERIALIZE_MAX", 10)
    sizes = [37, 1000]
    mix = WeightedMix(sizes, [0.3, 0.7], seed=1)
    draws: dict[int, list[int]] = {0: [], 1: []}
    for p in range(4000):
        s, x = mix.mixed_at(p)
        draws[s].append(x)
    for s, xs in draws.items():
        cycles = [xs[c * sizes[s] : (c + 1) * sizes[s]] for c in range(len(xs) // sizes[s])]
        assert len(cycles) >= 2
        for cyc in cycles:
            assert sorted(cyc) == list(range(sizes[s]))
        assert cycles[0] != cycles[1]
        assert cycles[0] != sorted(cycles[0])
    # addressable at huge sizes and positions, and deterministic
    big = WeightedMix([10**12, 3 * 10**11], [0.5, 0.5], seed=4)
    got = big.mixed_at(10**15 + 3)
    assert got == WeightedMix([10**12, 3 * 10**11], [0.5, 0.5], seed=4).mixed_at(10**15 + 3)
    assert 0 <= got[1] < [10**12, 3 * 10**11][got[0]]


def test_block_gives_the_pairs_of_mixed_at_in_every_mode_and_schedule() -> None:
    import random

    from stoker._mix.mix_order import WeightedMix

    rng = random.Random(1)
    for trial in range(60):
        S = rng.randint(1, 5)
        sizes = [rng.randint(1, 50) for _ in range(S)]
        w = [rng.choice([0, 1, 2, 3, 0.25, 0.7, 5, 13]) for _ in range(S)]
        if not any(w):
            w[0] = 1
        mode = rng.choice(["repeat", "stop", "end"])
        schedule = [(0, w), (rng.randint(1, 300), [rng.randint(1, 4) for _ in range(S)])] if trial % 2 else w
        mix = WeightedMix(sizes, schedule, seed=trial, mode=mode)
        n = 700 if mix.length is None else mix.length
        a = rng.randint(0, n // 2)
        s, k = mix.block(a, n)
        assert list(zip(s.tolist(), k.tolist())) == [mix.mixed_at(p) for p in range(a, n)], (trial, schedule, mode)


def test_block_over_a_long_period_and_a_feistel_source() -> None:
    import numpy as np

    from stoker._mix import mix_order as mixing
    from stoker._mix.mix_order import WeightedMix, feistel_index, feistel_many

    keys = [0x1234567 * (i + 1) for i in range(6)]
    assert feistel_many(np.arange(3000), 1_234_567, keys).tolist() == [
        feistel_index(j, 1_234_567, keys) for j in range(3000)
    ]
    big = WeightedMix([mixing.MATERIALIZE_MAX + 5, 10], [1, 1], seed=3)
    s, k = big.block(0, 1000)
    assert list(zip(s.tolist(), k.tolist())) == [big.mixed_at(p) for p in range(1000)]
    long_period = WeightedMix([50, 60], [mixing.TABLE_MAX, 3], seed=1)  # no table: step by step
    s, k = long_period.block(10, 400)
    assert list(zip(s.tolist(), k.tolist())) == [long_period.mixed_at(p) for p in range(10, 400)]
    assert long_period._tables[tuple(long_period.weights[0])] is None
