"""The resumes that were silently wrong (issue 45's defects), each checked as a user meets it:
a state's own types, a state taken right after a resume, a state at an epoch's end, an elastic
resume of a loader given `batch_sampler=`, the next epoch fixed by a state without a generator,
and a state of the older format."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import stoker.torch as st  # noqa: E402


def _plain(batch: Any) -> Any:
    if isinstance(batch, (list, tuple)):
        return [_plain(b) for b in batch]
    return batch.tolist() if hasattr(batch, "tolist") else batch


class Typed(st.IterableDataset):
    """Keeps its position per worker under int keys, beside a tuple, an array and a tensor;
    `load_state_dict` fails unless each comes back of its own type."""

    def __init__(self, n: int = 12) -> None:
        self.n = n
        self.seen: dict[int, int] = {}

    def __iter__(self) -> Any:
        info = st.get_worker_info()
        worker = 0 if info is None else info.id
        for i in range(self.seen.get(worker, 0), self.n):
            self.seen[worker] = i + 1
            yield worker * 100 + i

    def state_dict(self) -> dict[str, Any]:
        return {"seen": dict(self.seen), "pair": (1, 2), "array": np.arange(3), "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert all(type(k) is int for k in state["seen"]), state["seen"]
        assert type(state["pair"]) is tuple and isinstance(state["array"], np.ndarray)
        assert isinstance(state["rng"], torch.Tensor)
        self.seen = dict(state["seen"])


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types, arrays and tensors included."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    return bool(a == b)


def _rest(loader: Any) -> list[Any]:
    return [_plain(b) for b in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_datasets_state_comes_back_equal_and_of_the_same_types(workers: int) -> None:
    full = _rest(st.DataLoader(Typed(), batch_size=3, num_workers=workers))
    loader = st.DataLoader(Typed(), batch_size=3, num_workers=workers)
    iterator = iter(loader)
    head = [_plain(next(iterator)) for _ in range(3)]
    state = loader.state_dict()
    record = state["replicas"]["records"][head[-1][0] // 100]
    assert type(record["dataset"]["pair"]) is tuple and all(type(k) is int for k in record["dataset"]["seen"])
    again = st.DataLoader(Typed(), batch_size=3, num_workers=workers)
    again.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert head + _rest(again) == full


@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_right_after_a_resume_is_the_loaded_one_and_loses_no_worker(persistent: bool) -> None:
    def make() -> Any:
        return st.DataLoader(Typed(), batch_size=3, num_workers=2, persistent_workers=persistent)

    full = _rest(make())
    assert len(full) == 8  # 2 workers x 12 items
    loader = make()
    iterator = iter(loader)
    head = [_plain(next(iterator))]  # worker 1 has delivered nothing yet
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert _same(resumed.state_dict()["replicas"], state["replicas"])  # loaded, not iterated
    second = iter(resumed)
    again = resumed.state_dict()  # right after iter(): still the loaded point
    assert _same(again["replicas"], state["replicas"]) and again["position"] == state["position"]
    del second
    third = make()
    third.load_state_dict(again)
    rest = _rest(third)
    assert head + rest == full
    assert sum(len(b) for b in head + rest) == 24


class CountsEpochs(st.IterableDataset):
    """Counts its own epochs: epoch e's items are (e, i)."""

    def __init__(self) -> None:
        self.epoch = 0

    def __iter__(self) -> Any:
        for i in range(4):
            yield (self.epoch, i)
        self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_state_at_an_epochs_end_keeps_the_datasets_own_epoch(workers: int) -> None:
    def make() -> Any:
        return st.DataLoader(CountsEpochs(), batch_size=2, num_workers=workers, persistent_workers=workers > 0)

    loader = make()
    first = _rest(loader)
    state = loader.state_dict()  # between the epochs
    uninterrupted = _rest(loader)
    assert first[0][0] == [0, 0] and uninterrupted[0][0] == [1, 1]
    resumed = make()
    resumed.load_state_dict(state)
    assert _rest(resumed) == uninterrupted


class Pairs(st.Dataset):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> int:
        return i


def test_an_elastic_resume_with_a_batch_sampler_skips_batches_not_samples() -> None:
    def loader(world: int, rank: int) -> Any:
        sampler = st.DistributedSampler(Pairs(), num_replicas=world, rank=rank, shuffle=True, seed=3)
        return st.DataLoader(Pairs(), batch_sampler=st.BatchSampler(sampler, 2, drop_last=False))

    old = [loader(2, r) for r in range(2)]
    iterators = [iter(o) for o in old]
    consumed = [x for it in iterators for _ in range(3) for x in next(it).tolist()]
    state = old[0].state_dict()
    rest = []
    for rank in range(3):
        new = loader(3, rank)
        new.load_state_dict(state)
        rest += [x for batch in new for x in batch.tolist()]
    # every sample no old rank took, once (the new ranks pad to equal shares, as DistributedSampler does)
    assert set(rest) == set(range(23)) - set(consumed)
    assert len(consumed) == 12


def test_a_state_taken_before_the_first_iter_fixes_the_order_without_a_generator() -> None:
    torch.manual_seed(5)
    loader = st.DataLoader(Pairs(), batch_size=4, shuffle=True)
    state = loader.state_dict()
    uninterrupted = _rest(loader)
    torch.manual_seed(99)  # another global RNG when the run resumes
    resumed = st.DataLoader(Pairs(), batch_size=4, shuffle=True)
    resumed.load_state_dict(state)
    assert _rest(resumed) == uninterrupted
    assert loader.state_dict()["epoch"] == 1  # after the epoch: the next one, fixed in turn
    after = loader.state_dict()
    again = _rest(loader)
    torch.manual_seed(7)
    third = st.DataLoader(Pairs(), batch_size=4, shuffle=True)
    third.load_state_dict(after)
    assert _rest(third) == again


def test_a_version_1_state_is_read_and_an_unknown_version_is_refused_naming_it() -> None:
    loader = st.DataLoader(Pairs(), batch_size=4)
    iterator = iter(loader)
    head = [_plain(next(iterator))]
    state = loader.state_dict()
    old = {k: v for k, v in state.items() if k != "replicas"}
    old.update(version=1, iterable=None)  # as stoker wrote it before version 2
    again = st.DataLoader(Pairs(), batch_size=4)
    again.load_state_dict(old)
    assert head + _rest(again) == _rest(st.DataLoader(Pairs(), batch_size=4))
    with pytest.raises(ValueError, match=r"state format version 7 .* reads versions 1 and 2"):
        st.DataLoader(Pairs(), batch_size=4).load_state_dict(dict(state, version=7))
