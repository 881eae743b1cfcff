"""DataLoader arguments, attributes, len() and in-process iteration (num_workers=0)."""

from __future__ import annotations

import multiprocessing
import warnings

import numpy as np
import pytest

import stoker
from stoker import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler


class Squares(Dataset[dict]):
    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"i": i, "x": np.full(2, i * i, np.int32)}


class Batched(Squares):
    """Counts how it is fetched: __getitems__ must be used a batch at a time."""

    def __init__(self, n: int = 10) -> None:
        super().__init__(n)
        self.calls: list[list[int]] = []

    def __getitems__(self, indices: list[int]) -> list[dict]:
        self.calls.append(list(indices))
        return [self[i] for i in indices]


class Count(IterableDataset[int]):
    def __init__(self, n: int, reported: int | None = None) -> None:
        self.n, self.reported = n, reported

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n if self.reported is None else self.reported


# ------------------------------------------------------------ argument checks
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_workers": -1}, ValueError, "num_workers option should be non-negative"),
        ({"num_workers": 1.5}, TypeError, "num_workers should be an int"),
        ({"timeout": -1}, ValueError, "timeout option should be non-negative"),
        ({"prefetch_factor": 2}, ValueError, "prefetch_factor option could only be specified in multiprocessing"),
        ({"num_workers": 1, "prefetch_factor": -1}, ValueError, "prefetch_factor option should be non-negative"),
        ({"persistent_workers": True}, ValueError, "persistent_workers option needs num_workers > 0"),
        ({"sampler": [0, 1], "shuffle": True}, ValueError, "sampler option is mutually exclusive with shuffle"),
        ({"batch_sampler": [[0]], "batch_size": 2}, ValueError, "batch_sampler option is mutually exclusive"),
        ({"batch_sampler": [[0]], "drop_last": True}, ValueError, "batch_sampler option is mutually exclusive"),
        ({"batch_size": None, "drop_last": True}, ValueError, "mutually exclusive with drop_last"),
        ({"batch_size": 0}, ValueError, "batch_size should be a positive integer"),
        ({"multiprocessing_context": "fork"}, ValueError, "can only be used with multi-process loading"),
        ({"num_workers": 1, "multiprocessing_context": "nope"}, ValueError, "valid start method"),
        ({"num_workers": 1, "multiprocessing_context": 3}, TypeError, "valid context object"),
        ({"generator": "x"}, TypeError, "generator should be"),
        ({"collate_fn": 3}, TypeError, "collate_fn should be a callable"),
        ({"worker_init_fn": 3}, TypeError, "worker_init_fn should be a callable"),
        ({"collate_fn": list, "batchify_fn": list}, ValueError, "batchify_fn"),
        ({"last_batch": "wrap"}, ValueError, "last_batch should be one of"),
        ({"last_batch": "rollover", "drop_last": True}, ValueError, "contradicts"),
        ({"last_batch": "keep", "batch_size": None}, ValueError, "last_batch applies"),
        ({"thread_pool": 1}, TypeError, "thread_pool should be True or False"),
        ({"in_order": "yes"}, TypeError, "in_order should be True or False"),
        ({"num_workers": 1, "max_worker_restarts": -1}, ValueError, "max_worker_restarts should be a non-negative int"),
        ({"num_workers": 1, "max_worker_restarts": 1.0}, TypeError, "max_worker_restarts should be an int"),
        ({"num_workers": 1, "max_worker_restarts": True}, TypeError, "max_worker_restarts should be an int"),
        ({"num_workers": 1, "max_worker_restarts": "3"}, TypeError, "max_worker_restarts should be an int"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DataLoader(Squares(), **kwargs)


@pytest.mark.parametrize("kwargs", [{"num_workers": 0}, {"num_workers": 2, "thread_pool": True}])
def test_max_worker_restarts_is_accepted_and_inert_without_worker_processes(kwargs: dict) -> None:
    """Threads and the caller's thread do not die alone: the argument has no effect there."""
    loader = DataLoader(Squares(), batch_size=4, max_worker_restarts=3, **kwargs)
    assert loader.max_worker_restarts == 3
    assert [b["x"].tolist() for b in loader] == [b["x"].tolist() for b in DataLoader(Squares(), batch_size=4)]


def test_iterable_dataset_refuses_samplers_and_shuffle() -> None:
    for kwargs, name in [
        ({"shuffle": True}, "shuffle"),
        ({"sampler": [0]}, "sampler"),
        ({"batch_sampler": [[0]]}, "batch_sampler"),
    ]:
        with pytest.raises(ValueError, match=f"expected unspecified {name} option"):
            DataLoader(Count(3), **kwargs)
    with pytest.raises(ValueError, match="rollover"):
        DataLoader(Count(3), batch_size=2, last_batch="rollover")


def test_arguments_match_torch_errors() -> None:
    torch = pytest.importorskip("torch")
    import torch.utils.data as tud

    import stoker.torch as st

    cases = [
        {"num_workers": -1},
        {"timeout": -1},
        {"prefetch_factor": 2},
        {"persistent_workers": True},
        {"sampler": [0], "shuffle": True},
        {"batch_sampler": [[0]], "batch_size": 3},
        {"batch_size": None, "drop_last": True},
        {"multiprocessing_context": "spawn"},
        {"num_workers": 1, "multiprocessing_context": "nope"},
    ]
    for kwargs in cases:
        with pytest.raises(Exception) as theirs:
            tud.DataLoader(torch.arange(4), **kwargs)
        with pytest.raises(type(theirs.value)) as ours:
            st.DataLoader(torch.arange(4), **kwargs)
        assert str(ours.value) == str(theirs.value), kwargs


def test_read_only_attributes_after_construction() -> None:
    loader = DataLoader(Squares(), batch_size=2)
    for name in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after DataLoader is initialized"):
            setattr(loader, name, None)
    loader.timeout = 3  # others stay writable, as in torch
    assert loader.timeout == 3


def test_multiprocessing_context_accepts_names_and_objects() -> None:
    loader = DataLoader(Squares(), num_workers=1, multiprocessing_context="spawn")
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    context = multiprocessing.get_context("fork")
    assert DataLoader(Squares(), num_workers=1, multiprocessing_context=context).multiprocessing_context is context


def test_prefetch_factor_defaults_to_two_with_workers() -> None:
    assert DataLoader(Squares(), num_workers=1).prefetch_factor == 2
    assert DataLoader(Squares()).prefetch_factor is None


def test_too_many_workers_warns_like_torch() -> None:
    with pytest.warns(UserWarning, match="This DataLoader will create 512 worker processes in total"):
        DataLoader(Squares(), num_workers=512)


@pytest.mark.parametrize("flavour", ["stoker", "stoker.torch"])
def test_too_many_workers_warning_names_the_users_line(flavour: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The constructor, iter() and check_worker_number_rationality() each warn at the line
    of the user's code that called them (two thread workers on what reads as one CPU)."""
    import importlib

    from stoker._core import loader as loader_module

    if flavour == "stoker.torch":
        pytest.importorskip("torch")
    monkeypatch.setattr(loader_module, "usable_cpus", lambda: 1)
    loader_cls = importlib.import_module(flavour).DataLoader
    with pytest.warns(UserWarning, match="2 worker processes") as made:
        loader = loader_cls(Squares(4), batch_size=2, num_workers=2, thread_pool=True)
    with pytest.warns(UserWarning, match="2 worker processes") as iterated:
        assert len(list(loader)) == 2
    with pytest.warns(UserWarning, match="2 worker processes") as checked:
        loader.check_worker_number_rationality()
    assert [w.filename for w in [*made, *iterated, *checked]] == [__file__] * 3


# ------------------------------------------------------------------ batches
def test_default_batches_are_numpy_and_ordered() -> None:
    batches = list(DataLoader(Squares(5), batch_size=2))
    assert [b["i"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert batches[0]["x"].dtype == np.int32 and batches[0]["x"].shape == (2, 2)


def test_batch_size_none_disables_auto_collation() -> None:
    samples = list(DataLoader(Squares(3), batch_size=None))
    assert [s["i"] for s in samples] == [0, 1, 2] and samples[1]["x"].shape == (2,)


def test_getitems_fetches_a_batch_at_a_time() -> None:
    ds = Batched(7)
    assert [b["i"].tolist() for b in DataLoader(ds, batch_size=3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert ds.calls == [[0, 1, 2], [3, 4, 5], [6]]


def test_shuffle_with_seed_reproduces_and_varies_by_epoch() -> None:
    loader = DataLoader(Squares(20), batch_size=5, shuffle=True, generator=7)
    first = [b["i"].tolist() for b in loader]
    second = [b["i"].tolist() for b in loader]
    assert sorted(sum(first, [])) == list(range(20)) and first != second
    again = DataLoader(Squares(20), batch_size=5, shuffle=True, generator=7)
    assert [b["i"].tolist() for b in again] == first


def test_last_batch_modes_and_batchify_fn() -> None:
    ds = Squares(10)
    assert len(DataLoader(ds, batch_size=4, last_batch="discard")) == 2
    assert len(list(DataLoader(ds, batch_size=4, last_batch="keep"))) == 3
    roll = DataLoader(ds, batch_size=4, last_batch="rollover", batchify_fn=lambda b: [s["i"] for s in b])
    assert list(roll) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(roll) == 3 and list(roll)[0] == [8, 9, 0, 1]


def test_custom_batch_sampler_and_sampler() -> None:
    loader = DataLoader(Squares(6), batch_sampler=BatchSampler(SequentialSampler(range(6)), 4, False))
    assert loader.batch_size is None and len(loader) == 2
    assert [b["i"].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5]]
    assert [b["i"].tolist() for b in DataLoader(Squares(6), sampler=[5, 0], batch_size=2)] == [[5, 0]]


def test_iterable_len_estimate_and_warning_when_exceeded() -> None:
    loader = DataLoader(Count(10, reported=2), batch_size=3)
    assert len(loader) == 1
    # torch's threshold: batches past len(dataset) (the third one here)
    with pytest.warns(UserWarning, match="was reported to be 2"):
        batches = list(loader)
    assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert len(DataLoader(Count(10), batch_size=3, drop_last=True)) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("error", RuntimeWarning)  # stoker's categories: not the others'
        assert len(list(DataLoader(Count(10), batch_size=3, drop_last=True))) == 3


def test_many_epochs_and_get_worker_info_in_main() -> None:
    loader = DataLoader(Squares(4), batch_size=2)
    for _ in range(5):
        assert [b["i"].tolist() for b in loader] == [[0, 1], [2, 3]]
    assert stoker.get_worker_info() is None


def test_exception_in_getitem_propagates_unchanged_without_workers() -> None:
    class Broken(Squares):
        def __getitem__(self, i: int) -> dict:
            if i == 3:
                raise KeyError("missing 3")
            return super().__getitem__(i)

    iterator = iter(DataLoader(Broken(6), batch_size=2))
    assert next(iterator)["i"].tolist() == [0, 1]
    with pytest.raises(KeyError, match="missing 3"):
        next(iterator)


def test_torch_flavour_yields_tensors() -> None:
    torch = pytest.importorskip("torch")
    import stoker.torch as st

    batch = next(iter(st.DataLoader(Squares(4), batch_size=2)))
    assert isinstance(batch["i"], torch.Tensor) and batch["i"].dtype == torch.int64
    assert isinstance(batch["x"], torch.Tensor) and batch["x"].dtype == torch.int32


def test_pin_memory_without_accelerator_warns_and_still_delivers() -> None:
    torch = pytest.importorskip("torch")
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    loader = DataLoader(Squares(4), batch_size=2, pin_memory=True, pin_memory_device="cuda")
    with pytest.warns(UserWarning) as caught:
        batches = list(loader)
    messages = " ".join(str(w.message) for w in caught)
    assert "pin_memory_device is deprecated" in messages and "no accelerator is found" in messages
    assert [b["i"].tolist() for b in batches] == [[0, 1], [2, 3]]
