"""Hypothesis properties of the samplers: nothing lost, nothing repeated."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stoker import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
)


@given(n=st.integers(1, 300), seed=st.integers(0, 2**32), epochs=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_non_replacement_samplers_visit_each_index_once_per_epoch(n: int, seed: int, epochs: int) -> None:
    random = RandomSampler(range(n), generator=seed)
    subset = SubsetRandomSampler(list(range(0, 2 * n, 2)), generator=seed)
    for _ in range(epochs):
        assert sorted(random) == list(range(n))
        assert sorted(subset) == list(range(0, 2 * n, 2))
        assert list(SequentialSampler(range(n))) == list(range(n))


@given(
    n=st.integers(1, 200),
    replicas=st.integers(1, 9),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 5),
)
@settings(max_examples=120, deadline=None)
def test_distributed_shards_partition_the_padded_index_list(
    n: int, replicas: int, shuffle: bool, drop_last: bool, seed: int, epoch: int
) -> None:
    if drop_last and n < replicas:
        return
    shards = []
    for rank in range(replicas):
        sampler = DistributedSampler(
            range(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    sizes = {len(s) for s in shards}
    assert len(sizes) == 1
    merged = sorted(sum(shards, []))
    if drop_last:
        assert len(merged) == (n // replicas) * replicas and len(set(merged)) == len(merged)
    else:
        padded = -(-n // replicas) * replicas
        assert len(merged) == padded and set(merged) == set(range(n))
        # padding repeats indices from the front of the order, each at most ceil(padded / n) times
        assert max(merged.count(i) for i in range(n)) <= -(-padded // n)


@given(
    n=st.integers(1, 120),
    batch_size=st.integers(1, 17),
    epochs=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
@settings(max_examples=120, deadline=None)
def test_rollover_never_loses_or_repeats_an_index(n: int, batch_size: int, epochs: int, seed: int) -> None:
    sampler = BatchSampler(RandomSampler(range(n), generator=seed), batch_size, last_batch="rollover")
    seen: list[int] = []
    for _ in range(epochs):
        expected_batches = len(sampler)
        batches = list(sampler)
        assert len(batches) == expected_batches
        assert all(len(b) == batch_size for b in batches)
        seen += [i for b in batches for i in b]
    seen += sampler.rollover_indices
    # every epoch contributes each index exactly once, whether delivered or still carried
    assert len(seen) == n * epochs
    assert all(seen.count(i) == epochs for i in range(n))
    assert len(sampler.rollover_indices) < batch_size
