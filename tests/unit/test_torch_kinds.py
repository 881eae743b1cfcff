"""stoker.torch's classes are torch's kind: a `torch.utils.data.DataLoader` with torch's
attributes, torch's own Dataset / IterableDataset / Sampler, samplers and dataset wrappers
that subclass torch's, torch's `get_worker_info()` answering inside stoker's workers, and the
warning when several ranks run a loader that does not split the dataset by rank."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.utils.data as tud  # noqa: E402
from torch.utils.data.dataloader import _DatasetKind  # noqa: E402

import stoker  # noqa: E402
import stoker.torch as st  # noqa: E402


class Numbers(st.Dataset):
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class SplitStream(st.IterableDataset):
    """A torch-style stream that splits itself across workers with torch's get_worker_info."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(first, self.n, step))


def flat(loader: Any) -> list[int]:
    return [int(x) for batch in loader for x in batch]


# ------------------------------------------------------------------ kinds
def test_the_classes_are_torchs_kind() -> None:
    loader = st.DataLoader(Numbers(), batch_size=8, shuffle=True)
    assert isinstance(loader, tud.DataLoader)
    assert st.Dataset is tud.Dataset and st.IterableDataset is tud.IterableDataset and st.Sampler is tud.Sampler
    assert type(loader.batch_sampler) is tud.BatchSampler  # torch's own, as torch's loader makes it
    assert isinstance(loader.sampler, tud.RandomSampler)
    assert isinstance(st.DataLoader(Numbers()).sampler, tud.SequentialSampler)
    for name in (
        "RandomSampler",
        "SequentialSampler",
        "SubsetRandomSampler",
        "WeightedRandomSampler",
        "BatchSampler",
        "DistributedSampler",
        "TensorDataset",
        "ConcatDataset",
        "ChainDataset",
        "Subset",
        "StackDataset",
    ):
        assert issubclass(getattr(st, name), getattr(tud, name)), name
    assert isinstance(st.TensorDataset(torch.arange(4)) + st.TensorDataset(torch.arange(3)), tud.ConcatDataset)
    assert isinstance(st.random_split(Numbers(10), [4, 6])[0], tud.Subset)
    assert loader._dataset_kind == _DatasetKind.Map
    assert st.DataLoader(SplitStream(), batch_size=4)._dataset_kind == _DatasetKind.Iterable


def test_every_torch_attribute_is_there_with_torchs_value() -> None:
    ds, generator = Numbers(), torch.Generator().manual_seed(3)

    def make(mod: Any) -> Any:
        return mod.DataLoader(
            ds,
            batch_size=8,
            shuffle=True,
            num_workers=2,
            drop_last=True,
            pin_memory=False,
            timeout=5,
            persistent_workers=True,
            in_order=False,
            generator=generator,
        )

    ours, theirs = make(st), make(tud)
    for name in (
        "dataset",
        "batch_size",
        "drop_last",
        "num_workers",
        "pin_memory",
        "pin_memory_device",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "in_order",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert callable(ours.collate_fn)
    assert (ours.batch_sampler.batch_size, ours.batch_sampler.drop_last) == (8, True)
    assert len(ours) == len(theirs) == 8
    ours._get_iterator  # noqa: B018 - inherited from torch's class: present, never used by stoker


def test_recreated_from_its_attributes_with_a_new_sampler_as_frameworks_do() -> None:
    loader = st.DataLoader(
        Numbers(),
        batch_size=8,
        shuffle=True,
        num_workers=2,
        max_worker_restarts=1,
        thread_pool=True,
        persistent_workers=True,
    )
    # Lightning's way: the __init__ parameters that are instance attributes with other than
    # their default values, the sampler swapped
    params = inspect.signature(type(loader).__init__).parameters
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = loader.multiprocessing_context
    kwargs = {k: v for k, v in attrs.items() if k in params and params[k].default is not v}
    kwargs.update(
        dataset=loader.dataset,
        sampler=st.DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False),
        shuffle=False,
        batch_sampler=None,
    )
    again = type(loader)(**kwargs)
    assert type(again) is st.DataLoader
    assert (again.max_worker_restarts, again.thread_pool, again.persistent_workers, again.num_workers) == (
        1,
        True,
        True,
        2,
    )
    assert sorted(flat(again)) == list(range(1, 64, 2))


def test_an_unknown_argument_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="not_an_argument"):
        st.DataLoader(Numbers(), not_an_argument=1)  # type: ignore[call-arg]


def test_sampler_generator_is_assignable_and_used() -> None:
    loader = st.DataLoader(Numbers(), batch_size=8, shuffle=True)
    loader.sampler.generator = torch.Generator().manual_seed(11)
    theirs = tud.RandomSampler(Numbers(), generator=torch.Generator().manual_seed(11))
    assert [int(i) for i in loader.sampler] == list(theirs)
    for sampler in (st.SubsetRandomSampler([1, 2, 3]), st.WeightedRandomSampler([1.0, 2.0], 4)):
        sampler.generator = torch.Generator().manual_seed(1)
        assert isinstance(sampler.generator, torch.Generator)


def test_rollover_keeps_stokers_batch_sampler_of_torchs_kind() -> None:
    loader = st.DataLoader(Numbers(10), batch_size=4, last_batch="rollover")
    assert isinstance(loader.batch_sampler, tud.BatchSampler)
    assert [len(b) for b in loader] == [4, 4]
    assert flat(loader)[:2] == [8, 9]  # the leftover opens the next epoch


# ------------------------------------------------------ get_worker_info
@pytest.mark.parametrize("thread_pool", [False, True])
def test_a_stream_split_with_torchs_get_worker_info_yields_each_item_once(thread_pool: bool) -> None:
    loader = st.DataLoader(SplitStream(), batch_size=4, num_workers=2, thread_pool=thread_pool)
    assert sorted(flat(loader)) == list(range(40))
    assert tud.get_worker_info() is None  # the main process's answer is untouched


class Reports(st.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        theirs, ours = tud.get_worker_info(), st.get_worker_info()
        assert theirs is not None and ours is not None
        assert theirs.dataset is self or ours.dataset is not self  # a copy in a process worker
        return torch.tensor([theirs.id, theirs.num_workers, theirs.seed - ours.seed, ours.id])


@pytest.mark.parametrize("thread_pool", [False, True])
def test_torchs_worker_info_is_stokers_inside_workers(thread_pool: bool) -> None:
    rows = torch.cat(list(st.DataLoader(Reports(), batch_size=2, num_workers=2, thread_pool=thread_pool)))
    assert set(rows[:, 0].tolist()) == {0, 1} and (rows[:, 0] == rows[:, 3]).all()
    assert (rows[:, 1] == 2).all() and (rows[:, 2] == 0).all()


def test_torchs_own_loader_and_chain_take_stoker_torch_streams() -> None:
    assert sorted(flat(tud.DataLoader(SplitStream(), batch_size=4, num_workers=2))) == list(range(40))
    chained = tud.ChainDataset([SplitStream(3), SplitStream(2)])
    assert list(chained) == [0, 1, 2, 0, 1]
    assert list(st.ChainDataset([SplitStream(2), SplitStream(1)])) == [0, 1, 0]


def test_the_numpy_flavour_stays_torch_free() -> None:
    code = (
        "import sys, stoker\n"
        "loader = stoker.DataLoader(stoker.ArrayDataset(list(range(20))), batch_size=4, num_workers=2)\n"
        "assert sum(len(b) for b in loader) == 20\n"
        "assert 'torch' not in sys.modules, 'stoker imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------- unsharded ranks
@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


def _warnings_of(loader: Any, epochs: int = 2) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(epochs):
            list(loader)
    return [w for w in caught if issubclass(w.category, stoker.UnshardedWarning)]


@pytest.mark.parametrize("mod", [st, stoker], ids=["torch", "numpy"])
def test_an_unsharded_loader_under_two_ranks_warns_once(two_ranks: None, mod: Any) -> None:
    caught = _warnings_of(mod.DataLoader(Numbers(16), batch_size=4, shuffle=True))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "every rank reads the whole dataset" in message and "DistributedSampler" in message
    assert "UnshardedWarning" in message  # names the way to silence it
    assert st.UnshardedWarning is stoker.UnshardedWarning


class BatchSamplerShardLike:
    """The shape of accelerate's BatchSamplerShard: a batch sampler of one process's share."""

    def __init__(self, batch_sampler: Any, num_processes: int, process_index: int) -> None:
        self.batch_sampler, self.num_processes, self.process_index = batch_sampler, num_processes, process_index

    def __iter__(self) -> Any:
        for number, batch in enumerate(self.batch_sampler):
            if number % self.num_processes == self.process_index:
                yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler) // self.num_processes


def test_sharded_streamed_or_silenced_loaders_do_not_warn(two_ranks: None) -> None:
    ds = Numbers(16)
    assert _warnings_of(st.DataLoader(ds, batch_size=4, sampler=st.DistributedSampler(ds, seed=0))) == []
    assert _warnings_of(st.DataLoader(ds, batch_size=4, sampler=tud.DistributedSampler(ds, 2, 0))) == []
    shard = BatchSamplerShardLike(tud.BatchSampler(tud.SequentialSampler(ds), 4, False), 2, 0)
    assert _warnings_of(st.DataLoader(ds, batch_sampler=shard)) == []
    assert _warnings_of(st.DataLoader(SplitStream(8), batch_size=4)) == []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=st.UnshardedWarning)
        with warnings.catch_warnings(record=True) as caught:
            list(st.DataLoader(ds, batch_size=4))
    assert not [w for w in caught if issubclass(w.category, st.UnshardedWarning)]


def test_one_rank_does_not_warn() -> None:
    assert _warnings_of(st.DataLoader(Numbers(8), batch_size=4, shuffle=True)) == []


def test_numpy_arrays_still_make_stoker_torch_tensor_datasets() -> None:
    ds = st.TensorDataset(np.arange(6), np.arange(6) * 2)
    assert [b[1].tolist() for b in st.DataLoader(ds, batch_size=3)] == [[0, 2, 4], [6, 8, 10]]


def test_a_stream_without_state_is_replayed_and_an_old_restart_state_still_restarts_it() -> None:
    loader = st.DataLoader(SplitStream(8), batch_size=4)
    iterator = iter(loader)
    head = [next(iterator).tolist()]
    state = loader.state_dict()  # a framework saving every loader's state must not fail
    again = st.DataLoader(SplitStream(8), batch_size=4)
    with pytest.warns(UserWarning, match="replaying"):
        again.load_state_dict(state)
    assert head + [b.tolist() for b in again] == [b.tolist() for b in st.DataLoader(SplitStream(8), batch_size=4)]
    # what an older stoker.torch saved for such a stream restarts it, as it said it would
    old = {"version": 1, "stream_without_state": "SplitStream", "reason": "no state_dict", "epoch": 0}
    older = st.DataLoader(SplitStream(8), batch_size=4)
    with pytest.warns(UserWarning, match="restarts it from its beginning"):
        older.load_state_dict(old)
    assert sorted(flat(older)) == list(range(8))
    with pytest.raises(ValueError, match="not applied"):
        st.DataLoader(Numbers(8), batch_size=4).load_state_dict(old)
