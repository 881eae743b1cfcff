"""ShardedSampler: the shard-aware global order is a function of (seed, epoch) alone, reads
each shard within one window, and resumes exactly on another world size."""

from __future__ import annotations

import numpy as np
import pytest

from stoker import DataLoader
from stoker._core.ahead import drawing_ahead
from stoker._shards.sampler import ShardedSampler, global_order


class Shards:
    """A map-style dataset with shards of uneven sizes (what ShardedSampler reads of one)."""

    def __init__(self, counts: list[int]) -> None:
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def __getitem__(self, i: int) -> int:
        return i


COUNTS = [37, 50, 50, 12, 50, 41, 50, 50, 3, 50, 29]


def shard_of(starts: np.ndarray, i: int) -> int:
    return int(np.searchsorted(starts, i, side="right")) - 1


def test_the_order_is_a_permutation_read_window_by_window() -> None:
    data = Shards(COUNTS)
    order = global_order(data.shard_starts, seed=3, epoch=1, window_shards=3)
    assert sorted(order.tolist()) == list(range(len(data)))
    shards = [shard_of(data.shard_starts, int(i)) for i in order]
    # each shard's samples lie within one window: once a shard is left, it never comes back
    seen_windows: list[set[int]] = []
    at = 0
    while at < len(shards):
        window: set[int] = set()
        while at < len(shards) and (len(window) < 3 or shards[at] in window):
            window.add(shards[at])
            at += 1
        seen_windows.append(window)
    flat = [s for w in seen_windows for s in w]
    assert sorted(flat) == list(range(len(COUNTS)))
    assert len(seen_windows) == -(-len(COUNTS) // 3)


def test_the_order_depends_on_seed_and_epoch_only() -> None:
    starts = Shards(COUNTS).shard_starts
    a = global_order(starts, 0, 0, 4)
    assert np.array_equal(a, global_order(starts, 0, 0, 4))
    assert not np.array_equal(a, global_order(starts, 0, 1, 4))
    assert not np.array_equal(a, global_order(starts, 1, 0, 4))
    assert np.array_equal(global_order(starts, 0, 0, 4, shuffle=False), np.arange(len(a)))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_split_the_global_order(world: int) -> None:
    data = Shards(COUNTS)
    order = global_order(data.shard_starts, 5, 2, 4).tolist()
    parts = []
    for rank in range(world):
        sampler = ShardedSampler(data, num_replicas=world, rank=rank, seed=5, window_shards=4)
        sampler.set_epoch(2)
        parts.append(list(sampler))
    total = parts[0].__len__() * world
    padded = (order + order)[:total]
    for rank in range(world):
        assert parts[rank] == padded[rank:total:world]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="window_shards should be an int >= 1, but got window_shards=0"):
        ShardedSampler(Shards(COUNTS), num_replicas=1, rank=0, window_shards=0)
    with pytest.raises(TypeError, match="window_shards should be an int >= 1, but got window_shards='4'"):
        ShardedSampler(Shards(COUNTS), num_replicas=1, rank=0, window_shards="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ShardedDataset"):
        ShardedSampler(list(range(10)), num_replicas=1, rank=0)  # type: ignore[arg-type]


def global_sequence(per_rank: list[list[list[int]]]) -> list[int]:
    """The run's global sample sequence: rank r's j-th sample is the global order's position
    r + world * j, so the ranks' streams interleaved one sample at a time."""
    streams = [[i for batch in batches for i in batch] for batches in per_rank]
    return [i for group in zip(*streams) for i in group]


def run(world: int, workers: int, states: list | None = None, stop_after: int | None = None):
    data = Shards(COUNTS)
    loaders = []
    for rank in range(world):
        sampler = ShardedSampler(data, num_replicas=world, rank=rank, seed=11, window_shards=2, drop_last=True)
        loader = DataLoader(
            data,
            batch_size=4,
            sampler=sampler,
            num_workers=workers,
            **({"multiprocessing_context": "fork"} if workers else {}),
        )
        if states is not None:
            loader.load_state_dict(states[rank % len(states)])
        loaders.append(loader)
    per_rank: list[list[list[int]]] = [[] for _ in range(world)]
    saved = None
    iterators = [iter(loader) for loader in loaders]
    for step, batches in enumerate(zip(*iterators)):
        for rank, batch in enumerate(batches):
            per_rank[rank].append([int(x) for x in batch])
        if stop_after is not None and step + 1 == stop_after:
            saved = [loader.state_dict() for loader in loaders]
            break
    return global_sequence(per_rank), saved


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_a_state_resumes_exactly_on_another_world_size() -> None:
    whole, _ = run(4, 0)
    first, states = run(4, 2, stop_after=5)
    assert first == whole[: len(first)]
    rest, _ = run(2, 3, states=states)
    # the rest, split over 2 ranks, is the uninterrupted run's global sequence from there on
    # (the 4-rank run dropped its tail; the 2-rank rest drops its own, at most 1 sample)
    assert (first + rest) == whole[: len(first) + len(rest)]
    assert len(whole) - len(first + rest) <= 1


def test_drawing_ahead_gives_the_same_items_and_tells_each_once() -> None:
    heard: list[tuple[list[int], int]] = []

    def hook(indices: list[int], behind: int) -> bool:
        heard.append((indices, behind))
        return len(heard) % 3 != 0  # ask for more, twice in three

    items = [[i, i + 1] for i in range(0, 40, 2)]
    out = []
    for item in drawing_ahead(iter(items), hook, window=2):
        out.append(item)
        assert len(heard) >= len(out)  # never dispatched before the hook heard of it
    assert out == items
    assert [h[0] for h in heard] == items
