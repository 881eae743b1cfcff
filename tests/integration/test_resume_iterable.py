"""Resuming an IterableDataset that keeps a state: each worker's replica state is gathered
into the loader's state and restored into the same worker; never a replay from the start."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import stoker
from stoker.testing import assert_resumes_identically


def _worker() -> tuple[int, int]:
    info = stoker.get_worker_info()
    return (info.id, info.num_workers) if info else (0, 1)


class Counting(stoker.IterableDataset):
    """Worker w of n yields w, w + n, ... below `n_items`; its state is how far it got.
    Items also carry a draw from sample_rng(), which must survive the resume too. The state
    is kept per worker id: thread workers share this one object (processes have a copy)."""

    def __init__(self, n_items: int = 40) -> None:
        self.n_items = n_items
        self.start: dict[int, int] = {}  # worker -> items of its share to skip (a resume)
        self.given: dict[int, int] = {}  # worker -> items of its share given out

    def __iter__(self):
        worker, workers = _worker()
        mine = list(range(worker, self.n_items, workers))
        skip = self.start.pop(worker, 0)
        self.given[worker] = skip
        for i in mine[skip:]:
            self.given[worker] += 1
            yield np.array([i, int(stoker.sample_rng().integers(1 << 30))])
        # the stream's end: a state taken now (an epoch's end, which a resume restores, as
        # torchdata does) starts the next epoch from the beginning
        self.given[worker] = 0

    def state_dict(self) -> dict:
        return {"given": self.given.get(_worker()[0], 0)}

    def load_state_dict(self, state: dict) -> None:
        self.start[_worker()[0]] = int(state["given"])


@pytest.mark.parametrize("engine", ["inline", "fork", "spawn", "threads"])
def test_stateful_iterable_resumes_exactly_with_the_same_workers(engine: str) -> None:
    def make_loader():
        kwargs: dict = {}
        if engine == "inline":
            kwargs["num_workers"] = 0
        elif engine == "threads":
            kwargs.update(num_workers=2, thread_pool=True)
        else:
            kwargs.update(num_workers=2, multiprocessing_context=engine)
        return stoker.DataLoader(Counting(), batch_size=3, generator=4, **kwargs)

    steps = [0, 1, 4, 7, 13, 14] if engine in ("inline", "threads") else [3, 8]
    assert_resumes_identically(make_loader, steps=steps, epochs=2)


def test_another_worker_count_is_refused_saying_why() -> None:
    loader = stoker.DataLoader(Counting(), batch_size=3, num_workers=2)
    it = iter(loader)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    other = stoker.DataLoader(Counting(), batch_size=3, num_workers=1)
    with pytest.raises(ValueError, match="same number of workers"):
        other.load_state_dict(state)


class Plain(stoker.IterableDataset):
    """A stream that keeps no state: each worker yields its share, with a per-item draw."""

    def __iter__(self):
        worker, workers = _worker()
        for i in range(worker, 17, workers):
            yield np.array([i, int(stoker.sample_rng().integers(1 << 30))])


@pytest.mark.parametrize("engine", ["inline", "fork"])
def test_an_iterable_without_state_is_replayed_to_where_each_worker_was(engine: str) -> None:
    def make_loader():
        workers = 0 if engine == "inline" else 2
        return stoker.DataLoader(Plain(), batch_size=2, num_workers=workers, generator=3)

    steps = [0, 1, 3, 8, 9] if engine == "inline" else [2, 5]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the replay's own warning, tested below
        assert_resumes_identically(make_loader, steps=steps, epochs=2)
    loader = make_loader()
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    with pytest.warns(UserWarning, match="Plain by replaying the 2 item"):
        make_loader().load_state_dict(state)
