"""A dataset's own methods are the dataset's: stoker calls `state_dict()` / `load_state_dict()`
only through the Stateful protocol (no argument; the state), checked by signature. A dataset or
sampler whose `state_dict` is something else loads as torch's loader loads it, and a Stateful
dataset whose `state_dict()` raises or returns what JSON cannot hold never breaks the epoch:
the loader's `state_dict()` then says why that stream cannot resume."""

from __future__ import annotations

import json
import threading
import warnings
from typing import Any

import numpy as np
import pytest

import stoker
from stoker.testing import assert_resumes_identically

torch = pytest.importorskip("torch")
import torch.utils.data as tud  # noqa: E402

import stoker.torch as st  # noqa: E402

N = 20
ENGINES = ["inline", "fork", "threads"]


def _share() -> range:
    """This replica's items: worker w of n takes w, w + n, ..."""
    info = tud.get_worker_info()
    first, step = (info.id, info.num_workers) if info is not None else (0, 1)
    return range(first, N, step)


class CountsAsked(tud.IterableDataset):
    """Its state_dict asks for the loader's counts, as litdata's StreamingDataset does."""

    def __iter__(self) -> Any:
        return iter(_share())

    def state_dict(self, num_samples_yielded: int, num_workers: int, batch_size: int) -> dict[str, Any]:
        return {"yielded": num_samples_yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("stoker must not load a state into a dataset it never asked for one")


class Raising(tud.IterableDataset):
    """Stateful by signature, but its state_dict() fails."""

    def __iter__(self) -> Any:
        return iter(_share())

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("position unknown while streaming")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Unpicklable(Raising):
    """Stateful by signature; its state holds a lock, which pickle cannot."""

    def state_dict(self) -> dict[str, Any]:
        return {"lock": threading.Lock()}


def _loader(flavour: Any, dataset: Any, engine: str, **kwargs: Any) -> Any:
    if engine == "threads":
        kwargs.update(num_workers=2, thread_pool=True)
    elif engine != "inline":
        kwargs.update(num_workers=2, multiprocessing_context=engine)
    return flavour.DataLoader(dataset, batch_size=3, **kwargs)


def _batches(loader: Any) -> list[list[int]]:
    return [[int(x) for x in batch] for batch in loader]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_state_dict_that_needs_arguments_is_the_datasets_own(engine: str) -> None:
    workers = 0 if engine == "inline" else 2
    expected = _batches(tud.DataLoader(CountsAsked(), batch_size=3, num_workers=workers))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning of stoker's, per batch or other
        warnings.simplefilter("error", RuntimeWarning)  # stoker's categories: not the others'
        loader = _loader(st, CountsAsked(), engine)
        got = _batches(loader)
        plain = _batches(_loader(stoker, CountsAsked(), engine))
    if engine == "threads":  # torch has no thread workers: the same items, in worker order
        assert sorted(sum(got, [])) == list(range(N))
    else:
        assert got == expected
    assert sorted(sum(plain, [])) == list(range(N))
    for flavour in (st, stoker):  # never called: the stream is replayed to where it was
        loader = _loader(flavour, CountsAsked(), engine)
        iterator = iter(loader)
        head = [[int(x) for x in next(iterator)]]
        state = loader.state_dict()
        assert state["replicas"]["records"][0]["dataset"] is None
        del iterator
        again = _loader(flavour, CountsAsked(), engine)
        with pytest.warns(UserWarning, match=r"CountsAsked by replaying"):
            again.load_state_dict(json.loads(json.dumps(state)))
        rest = _batches(again)
        if engine == "threads":
            assert sorted(sum(head + rest, [])) == list(range(N))
        else:
            assert head + rest == (expected if flavour is st else plain)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("dataset", "error", "reason"),
    [
        (Raising, RuntimeError, r"its state_dict\(\) raised RuntimeError: position unknown while streaming"),
        (Unpicklable, TypeError, r"its state_dict\(\) returned a value that cannot be pickled \(.*lock"),
    ],
    ids=["raises", "unpicklable"],
)
def test_a_state_that_cannot_be_saved_leaves_the_epoch_whole_and_names_dataset_and_worker(
    engine: str, dataset: type, error: type, reason: str
) -> None:
    where = "in this process" if engine == "inline" else "in worker [01]"
    for flavour in (stoker, st):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            warnings.simplefilter("error", RuntimeWarning)  # stoker's categories: not the others'
            loader = _loader(flavour, dataset(), engine)
            iterator = iter(loader)
            first = next(iterator)
            with pytest.raises(error, match=rf"state of {dataset.__name__} {where}.*: {reason}"):
                loader.state_dict()  # mid-epoch
            rest = list(iterator)
        assert sorted(int(x) for batch in [first, *rest] for x in batch) == list(range(N))
        if engine == "fork":  # the next epoch's workers start afresh: no replica state to take
            after = loader.state_dict()
            assert (after["epoch"], after["position"]) == (1, 0)
            assert after["replicas"]["records"] == [None, None]
        else:  # the same replica goes on: its state at the stream's end cannot be taken either
            with pytest.raises(error, match=reason):
                loader.state_dict()


class LiveState(stoker.IterableDataset):
    """A Stateful replica whose state_dict() hands out the dict it keeps changing: the
    state reported with a batch must be the one of that moment. Kept per worker id (thread
    workers share this object)."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, int]] = {}
        self.start: dict[int, int] = {}

    def _worker(self) -> int:
        info = stoker.get_worker_info()
        return info.id if info is not None else 0

    def __iter__(self) -> Any:
        info = stoker.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(worker, N, workers))
        state = self.states[worker] = {"given": self.start.pop(worker, 0)}
        while state["given"] < len(mine):
            item = mine[state["given"]]
            state["given"] += 1
            yield np.array([item])

    def state_dict(self) -> dict[str, int]:
        return self.states.setdefault(self._worker(), {"given": 0})

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start[self._worker()] = int(state["given"])


def test_the_state_kept_with_a_batch_is_that_moments_even_if_the_dataset_changes_it() -> None:
    # thread workers hand their replies over by reference, several batches ahead
    def make_loader() -> Any:
        return _loader(stoker, LiveState(), "threads", prefetch_factor=4)

    assert_resumes_identically(make_loader, steps=[1, 2, 4], epochs=1)


class OwnSampler(stoker.Sampler[int]):
    """A sampler whose state_dict is its own (it needs an argument): replayed on resume, as
    one without state_dict would be, and never called."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        return iter(range(self.n - 1, -1, -1))

    def state_dict(self, epoch: int) -> dict[str, Any]:
        raise AssertionError("stoker must not call a state_dict that needs an argument")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("stoker must not call load_state_dict of a sampler it never saved")


class Numbers(tud.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def test_a_samplers_own_state_dict_is_not_called_and_the_sampler_is_replayed() -> None:
    expected = _batches(tud.DataLoader(Numbers(), batch_size=3, sampler=OwnSampler(N)))
    assert _batches(st.DataLoader(Numbers(), batch_size=3, sampler=OwnSampler(N))) == expected

    def make_loader(num_workers: int = 0) -> Any:
        return st.DataLoader(Numbers(), batch_size=3, sampler=OwnSampler(N), num_workers=num_workers)

    with pytest.warns(UserWarning, match="resuming OwnSampler by replaying"):
        assert_resumes_identically(make_loader, steps=[2, 5], epochs=1)
