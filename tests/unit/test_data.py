"""Datasets, samplers, DistributedSampler and generators (no workers involved)."""

from __future__ import annotations

import numpy as np
import pytest

import stoker
from stoker import (
    ArrayDataset,
    BatchSampler,
    ChainDataset,
    ConcatDataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    StackDataset,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    random_split,
)


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


# ----------------------------------------------------------------- datasets
def test_tensor_dataset_indexes_every_array_and_checks_sizes() -> None:
    ds = TensorDataset(np.arange(4), np.arange(8).reshape(4, 2))
    assert len(ds) == 4 and ds[2][0] == 2 and ds[2][1].tolist() == [4, 5]
    with pytest.raises(ValueError, match="Size mismatch between tensors"):
        TensorDataset(np.arange(4), np.arange(5))


def test_array_dataset_takes_lists_and_single_arrays() -> None:
    assert ArrayDataset([1, 2, 3])[1] == 2
    pair = ArrayDataset(np.arange(3), ["a", "b", "c"])
    assert pair[2] == (2, "c") and len(pair) == 3
    with pytest.raises(ValueError):
        ArrayDataset([1, 2], [1])


def test_concat_dataset_with_negative_indices_and_plus() -> None:
    a, b = ArrayDataset([0, 1, 2]), ArrayDataset([3, 4])
    both = a + b
    assert isinstance(both, ConcatDataset) and len(both) == 5
    assert [both[i] for i in range(5)] == [0, 1, 2, 3, 4]
    assert both[-1] == 4 and both[-5] == 0
    with pytest.raises(IndexError):
        both[5]
    with pytest.raises(ValueError):
        both[-6]
    with pytest.raises(TypeError, match="ChainDataset"):
        ConcatDataset([a, Stream(3)])


def test_chain_dataset_chains_iterables_only() -> None:
    chained = Stream(2) + Stream(3)
    assert isinstance(chained, ChainDataset) and list(chained) == [0, 1, 0, 1, 2]
    with pytest.raises(TypeError, match="ConcatDataset"):
        list(ChainDataset([ArrayDataset([1])]))


def test_subset_and_getitems() -> None:
    sub = Subset(ArrayDataset(list(range(10))), [9, 3, 5])
    assert len(sub) == 3 and sub[0] == 9 and sub.__getitems__([2, 0]) == [5, 9]


def test_subset_subclass_must_override_getitems_with_getitem() -> None:
    class Doubled(Subset):
        def __getitem__(self, i):
            return 2 * self.dataset[self.indices[i]]

    with pytest.raises(NotImplementedError, match="Doubled overrides __getitem__ but not __getitems__"):
        Doubled(ArrayDataset(list(range(10))), [9, 3, 5])

    class DoubledBoth(Doubled):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    sub = DoubledBoth(ArrayDataset(list(range(10))), [9, 3, 5])
    assert sub[0] == 18 and [b.tolist() for b in stoker.DataLoader(sub, batch_size=2)] == [[18, 6], [10]]


def test_stack_dataset_tuple_and_dict_forms() -> None:
    a, b = ArrayDataset([1, 2]), ArrayDataset(["x", "y"])
    assert StackDataset(a, b)[1] == (2, "y")
    assert StackDataset(num=a, text=b)[0] == {"num": 1, "text": "x"}
    assert StackDataset(num=a, text=b).__getitems__([1, 0]) == [{"num": 2, "text": "y"}, {"num": 1, "text": "x"}]
    with pytest.raises(ValueError):
        StackDataset(a, ArrayDataset([1, 2, 3]))
    with pytest.raises(ValueError):
        StackDataset(a, text=b)


def test_random_split_lengths_and_fractions_are_disjoint_and_seeded() -> None:
    ds = ArrayDataset(list(range(10)))
    parts = random_split(ds, [3, 7], generator=0)
    assert [len(p) for p in parts] == [3, 7]
    assert sorted(parts[0].indices + parts[1].indices) == list(range(10))
    assert parts[0].indices == random_split(ds, [3, 7], generator=0)[0].indices
    assert [len(p) for p in random_split(ds, [0.5, 0.25, 0.25], generator=1)] == [6, 2, 2]
    with pytest.raises(ValueError, match="Sum of input lengths"):
        random_split(ds, [3, 3])


# ----------------------------------------------------------------- samplers
def test_sequential_and_random_samplers() -> None:
    assert list(SequentialSampler(range(5))) == [0, 1, 2, 3, 4]
    order = list(RandomSampler(range(50), generator=3))
    assert sorted(order) == list(range(50)) and order != list(range(50))
    assert order == list(RandomSampler(range(50), generator=3))
    with_replacement = list(RandomSampler(range(5), replacement=True, num_samples=40, generator=0))
    assert len(with_replacement) == 40 and set(with_replacement) <= set(range(5))
    more = list(RandomSampler(range(4), num_samples=10, generator=0))
    assert len(more) == 10 and sorted(more[:8]) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_random_sampler_argument_errors() -> None:
    with pytest.raises(ValueError, match="num_samples"):
        RandomSampler(range(3), num_samples=0)
    with pytest.raises(TypeError, match="replacement"):
        RandomSampler(range(3), replacement=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="generator"):
        RandomSampler(range(3), generator="seed")  # type: ignore[arg-type]


def test_random_sampler_without_generator_follows_numpy_global_seed() -> None:
    np.random.seed(5)
    first = list(RandomSampler(range(20)))
    np.random.seed(5)
    assert list(RandomSampler(range(20))) == first


def test_int_seed_advances_across_epochs() -> None:
    sampler = RandomSampler(range(30), generator=11)
    assert list(sampler) != list(sampler)


def test_subset_random_and_weighted_samplers() -> None:
    assert sorted(SubsetRandomSampler([4, 8, 15], generator=0)) == [4, 8, 15]
    weighted = list(WeightedRandomSampler([0.0, 1.0, 0.0], 20, generator=0))
    assert weighted == [1] * 20
    no_repl = list(WeightedRandomSampler([1, 1, 1, 1], 4, replacement=False, generator=0))
    assert sorted(no_repl) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="weights"):
        WeightedRandomSampler([[1.0]], 1)
    with pytest.raises(ValueError, match="num_samples"):
        WeightedRandomSampler([1.0], 0)


@pytest.mark.parametrize(
    "make",
    [
        lambda generator: RandomSampler(range(30), generator=generator),
        lambda generator: SubsetRandomSampler(list(range(30)), generator=generator),
        lambda generator: WeightedRandomSampler([1.0] * 30, 30, replacement=False, generator=generator),
    ],
    ids=["RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler"],
)
def test_a_random_samplers_generator_reads_back_and_set_starts_anew(make) -> None:
    sampler = make(3)
    assert sampler.generator == 3
    list(sampler)  # the int seed's draws move on
    sampler.generator = 3  # as accelerate does: a new source, from the start
    assert sampler.generator == 3 and list(sampler) == list(make(3))
    rng = np.random.default_rng(4)
    sampler.generator = rng
    assert sampler.generator is rng and list(sampler) == list(make(np.random.default_rng(4)))
    with pytest.raises(TypeError, match="generator should be None, an int seed"):
        sampler.generator = "seed"


def test_batch_sampler_keep_discard_rollover() -> None:
    seq = SequentialSampler(range(10))
    assert list(BatchSampler(seq, 4, False))[-1] == [8, 9]
    assert len(BatchSampler(seq, 4, False)) == 3 and len(BatchSampler(seq, 4, True)) == 2
    assert list(BatchSampler(seq, 4, True)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    roll = BatchSampler(seq, 4, last_batch="rollover")
    assert len(roll) == 2
    assert list(roll) == [[0, 1, 2, 3], [4, 5, 6, 7]] and roll.rollover_indices == [8, 9]
    assert len(roll) == 3
    assert list(roll)[0] == [8, 9, 0, 1]
    with pytest.raises(ValueError, match="batch_size"):
        BatchSampler(seq, 0)
    with pytest.raises(ValueError, match="last_batch"):
        BatchSampler(seq, 2, last_batch="wrap")
    with pytest.raises(ValueError, match="contradicts"):
        BatchSampler(seq, 2, True, last_batch="rollover")


def test_distributed_sampler_pads_and_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    shards = [list(DistributedSampler(range(10), num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    assert sorted(sum(shards, [])) == sorted(list(range(10)) + [0, 1])
    dropped = [list(DistributedSampler(range(10), num_replicas=4, rank=r, drop_last=True)) for r in range(4)]
    assert all(len(s) == 2 for s in dropped) and len(set(sum(dropped, []))) == 8
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0, seed=3)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first
    with pytest.raises(ValueError, match="Invalid rank 2"):
        DistributedSampler(range(10), num_replicas=2, rank=2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    from_env = DistributedSampler(range(9))
    assert (from_env.num_replicas, from_env.rank) == (3, 2)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    alone = DistributedSampler(range(9))
    assert (alone.num_replicas, alone.rank) == (1, 0)


# ------------------------------------------------------- torch's sequences
def test_torch_generators_give_torch_sequences() -> None:
    torch = pytest.importorskip("torch")
    import torch.utils.data as tud

    import stoker.torch as st

    def g() -> object:
        return torch.Generator().manual_seed(1234)

    assert list(stoker.RandomSampler(range(37), generator=g())) == list(tud.RandomSampler(range(37), generator=g()))
    assert list(st.RandomSampler(range(7), replacement=True, num_samples=70, generator=g())) == list(
        tud.RandomSampler(range(7), replacement=True, num_samples=70, generator=g())
    )
    assert list(st.RandomSampler(range(7), num_samples=17, generator=g())) == list(
        tud.RandomSampler(range(7), num_samples=17, generator=g())
    )
    assert list(st.SubsetRandomSampler([3, 9, 27, 81], generator=g())) == list(
        tud.SubsetRandomSampler([3, 9, 27, 81], generator=g())
    )
    weights = [0.1, 0.5, 2.0, 0.0, 1.0]
    assert list(st.WeightedRandomSampler(weights, 30, generator=g())) == list(
        tud.WeightedRandomSampler(weights, 30, generator=g())
    )
    assert list(st.WeightedRandomSampler(weights, 4, replacement=False, generator=g())) == list(
        tud.WeightedRandomSampler(weights, 4, replacement=False, generator=g())
    )
    ours = st.random_split(range(20), [0.3, 0.7], generator=g())
    theirs = tud.random_split(range(20), [0.3, 0.7], generator=g())
    assert [list(s.indices) for s in ours] == [list(s.indices) for s in theirs]
    for epoch in (0, 3):
        a = st.DistributedSampler(range(11), num_replicas=3, rank=1, seed=5)
        b = tud.DistributedSampler(range(11), num_replicas=3, rank=1, seed=5)
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a) == list(b)


def test_torch_flavour_without_generator_follows_torch_manual_seed() -> None:
    torch = pytest.importorskip("torch")
    import torch.utils.data as tud

    import stoker.torch as st

    torch.manual_seed(9)
    ours = list(st.RandomSampler(range(25)))
    torch.manual_seed(9)
    assert ours == list(tud.RandomSampler(range(25)))


# ------------------------------------------------ datasets packed for spawn
def test_packed_dataset_arrays_come_back_as_what_they_were() -> None:
    """Large arrays cross to spawn/forkserver workers through shared memory; a torch tensor
    must arrive as a tensor, a numpy array as an array."""
    torch = pytest.importorskip("torch")
    import io
    import pickle
    from multiprocessing import reduction, resource_sharer

    from stoker._core.sharing import SHARE_MIN_BYTES, Packed

    tensor = torch.arange(SHARE_MIN_BYTES // 4, dtype=torch.float32)
    array = np.arange(SHARE_MIN_BYTES // 8, dtype=np.float64)
    packed = Packed({"tensor": tensor, "array": array, "small": torch.ones(3)})
    try:
        stream = io.BytesIO()
        reduction.ForkingPickler(stream, 5).dump(packed)
        out = pickle.loads(stream.getvalue())
    finally:
        packed.close()
        # pickling a descriptor outside a worker's start started multiprocessing's resource
        # sharer (a thread and its listening socket), which would live on for the process
        resource_sharer.stop()
    assert type(out["tensor"]) is torch.Tensor and torch.equal(out["tensor"], tensor)
    assert type(out["array"]) is np.ndarray and np.array_equal(out["array"], array)
    assert type(out["small"]) is torch.Tensor and out["small"].tolist() == [1.0, 1.0, 1.0]
