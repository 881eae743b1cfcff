"""Datasets, samplers and cases for test_vs_torchdata.py: the same loader arguments given to
torchdata's `StatefulDataLoader` and to `stoker.torch.StatefulDataLoader`.

Every item is an int (or a pair of ints) that depends only on the dataset, the worker that
makes it and that worker's own position and RNG, never on timing. An iterable's replica in
worker w of n takes the items w, w + n, ... (one replica takes all of them in process).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import stoker.torch as st

N = 14  # items per epoch: 5 batches of 3 in process; 2 workers make 7 each, 3 + 3 + 1


def _worker() -> tuple[int, int]:
    """(worker id, number of workers) of whichever loader runs us; (0, 1) in process."""
    info = tud.get_worker_info() or st.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def _share(n: int) -> list[int]:
    first, step = _worker()
    return list(range(first, n, step))


def _require(value: Any, kind: type, what: str) -> Any:
    """A state must come back with the types it was saved with."""
    if type(value) is not kind:
        raise TypeError(f"{what}: saved as {kind.__name__}, got {type(value).__name__} back")
    return value


# ---------------------------------------------------------------------------- datasets


class MapRange(tud.Dataset):
    """Map-style: item i is i."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class RngMap(tud.Dataset):
    """Map-style with its own state: every `__getitem__` draws from a `random.Random`, whose
    state (nested tuples) is the dataset's state."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.rng = random.Random(5)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i * 1000 + self.rng.randrange(1000)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(_require(state["rng"], tuple, "RngMap rng"))


class SelfIterable(tud.IterableDataset):
    """Stateful, its own iterator: `__iter__` returns self and keeps the position, which goes
    back to 0 when the replica's items run out (so the next epoch starts over)."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.pos = 0

    def __iter__(self) -> SelfIterable:
        return self

    def __next__(self) -> int:
        items = _share(self.n)
        if self.pos >= len(items):
            self.pos = 0
            raise StopIteration
        self.pos += 1
        return items[self.pos - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = _require(state["pos"], int, "SelfIterable pos")


class GeneratorIterable(tud.IterableDataset):
    """Stateful, `__iter__` a generator function reading the dataset's position."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.pos = 0

    def __iter__(self) -> Iterator[int]:
        items = _share(self.n)
        while self.pos < len(items):
            self.pos += 1
            yield items[self.pos - 1]
        self.pos = 0

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = _require(state["pos"], int, "GeneratorIterable pos")


class StatelessIterable(tud.IterableDataset):
    """No state at all: a resume must replay each worker's stream to where it was."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        yield from _share(self.n)


class ShareIterator:
    """The iterator of `SeparateIterable`: its own position and state."""

    def __init__(self, items: list[int]) -> None:
        self.items, self.pos = items, 0

    def __iter__(self) -> ShareIterator:
        return self

    def __next__(self) -> int:
        if self.pos >= len(self.items):
            raise StopIteration
        self.pos += 1
        return self.items[self.pos - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "items": list(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["items"] != self.items:
            raise ValueError(f"ShareIterator: a state for items {state['items']} loaded into one of {self.items}")
        self.pos = _require(state["pos"], int, "ShareIterator pos")


class SeparateIterable(tud.IterableDataset):
    """No state of its own; `__iter__` makes a fresh iterator at position 0, which has one.
    A loader must load the iterator's state after `iter()`, or the position is overwritten."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self) -> ShareIterator:
        return ShareIterator(_share(self.n))


class TypedStateIterable(tud.IterableDataset):
    """Stateful, whose state holds int keys, a tuple, a numpy array and a torch tensor (a
    `torch.Generator`'s state, which its items draw from); `load_state_dict` needs each back
    with its type."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.pos = 0
        self.gen: torch.Generator | None = None

    def _generator(self) -> torch.Generator:
        if self.gen is None:
            self.gen = torch.Generator().manual_seed(100 + _worker()[0])
        return self.gen

    def __iter__(self) -> Iterator[int]:
        items, gen = _share(self.n), self._generator()
        while self.pos < len(items):
            self.pos += 1
            yield items[self.pos - 1] * 1000 + int(torch.randint(1000, (1,), generator=gen))
        self.pos = 0

    def state_dict(self) -> dict[str, Any]:
        worker = _worker()
        return {
            "seen": {worker[0]: self.pos},
            "worker": worker,
            "positions": np.array([self.pos, len(_share(self.n))], dtype=np.int64),
            "rng": self._generator().get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        worker = _worker()
        if _require(state["worker"], tuple, "TypedStateIterable worker") != worker:
            raise ValueError(f"TypedStateIterable: the state of worker {state['worker']} loaded into {worker}")
        pos = _require(_require(state["seen"], dict, "TypedStateIterable seen")[worker[0]], int, "seen[w]")
        positions = _require(state["positions"], np.ndarray, "TypedStateIterable positions")
        if positions.dtype != np.int64 or positions.tolist() != [pos, len(_share(self.n))]:
            raise ValueError(f"TypedStateIterable: positions {positions!r} do not match pos {pos}")
        self._generator().set_state(_require(state["rng"], torch.Tensor, "TypedStateIterable rng"))
        self.pos = pos


class EpochCountingIterable(tud.IterableDataset):
    """Stateful, counting its own epochs: item = 100 * epoch + i. The count goes up when the
    replica's items run out, so only a replica that lives on (in process, or a persistent
    worker) counts past 0."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.epoch = 0
        self.pos = 0

    def __iter__(self) -> Iterator[int]:
        items = _share(self.n)
        while self.pos < len(items):
            self.pos += 1
            yield 100 * self.epoch + items[self.pos - 1]
        self.epoch += 1
        self.pos = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = _require(state["epoch"], int, "EpochCountingIterable epoch")
        self.pos = _require(state["pos"], int, "EpochCountingIterable pos")


# ---------------------------------------------------------------------------- samplers


def _order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1000 + epoch).shuffle(order)
    return order


class StatefulSampler(tud.Sampler[int]):
    """A shuffling sampler with its own state: a new order each epoch, counted by itself."""

    def __init__(self, n: int = N, seed: int = 3) -> None:
        self.n, self.seed = n, seed
        self.epoch, self.pos = 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = _order(self.n, self.seed, self.epoch)
        while self.pos < self.n:
            self.pos += 1
            yield order[self.pos - 1]
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = _require(state["epoch"], int, "StatefulSampler epoch")
        self.pos = _require(state["pos"], int, "StatefulSampler pos")


class StatefulBatchSampler(tud.Sampler[list[int]]):
    """A batch sampler with its own state: batches of 2 and 3 alternately over a shuffled
    order, a new order each epoch, counted by itself."""

    def __init__(self, n: int = N, seed: int = 4) -> None:
        self.n, self.seed = n, seed
        self.epoch, self.start, self.count = 0, 0, 0

    def __len__(self) -> int:
        batches, start = 0, 0
        while start < self.n:
            start += 2 + batches % 2
            batches += 1
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        order = _order(self.n, self.seed, self.epoch)
        while self.start < self.n:
            size = 2 + self.count % 2
            batch = order[self.start : self.start + size]
            self.start, self.count = self.start + size, self.count + 1
            yield batch
        self.epoch, self.start, self.count = self.epoch + 1, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "start": self.start, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = _require(state["epoch"], int, "StatefulBatchSampler epoch")
        self.start = _require(state["start"], int, "StatefulBatchSampler start")
        self.count = _require(state["count"], int, "StatefulBatchSampler count")


# ---------------------------------------------------------------------------- cases


def _no_hook(loader: Any, epoch: int) -> None:
    pass


def _set_epoch(loader: Any, epoch: int) -> None:
    loader.sampler.set_epoch(epoch)


@dataclass(frozen=True)
class Case:
    """One loader configuration, built alike for both libraries.

    `dataset` makes a fresh dataset (as a new process would); `kwargs(dataset)` the loader's
    other arguments, fresh objects each time; `before_epoch(loader, epoch)` is what the
    training loop does before each `iter()`. `same_order`: both libraries define the batches
    the same way, so their uninterrupted runs must be equal. `ordered=False` (`in_order=False`):
    only the remaining items per epoch, as multisets, are compared, and only for stoker.
    `points`: where the run is interrupted. `torchdata_xfail`: point -> why torchdata fails
    there (a limitation of torchdata's, asserted strictly)."""

    id: str
    dataset: Callable[[], Any]
    kwargs: Callable[[Any], dict[str, Any]]
    points: tuple[str, ...]
    same_order: bool = True
    ordered: bool = True
    before_epoch: Callable[[Any, int], None] = _no_hook
    torchdata_xfail: dict[str, str] = field(default_factory=dict)

    def make(self, loader_class: type) -> Any:
        dataset = self.dataset()
        return loader_class(dataset, **self.kwargs(dataset))


# Where a run can be interrupted: (epoch, batches taken in it, whether iter() was called for
# it). ALL: every batch of that epoch taken, without the StopIteration after them.
ALL = -1
POINTS: dict[str, tuple[int, int, bool]] = {
    "before_iter": (0, 0, False),  # a fresh loader, before its first iter()
    "after_iter": (0, 0, True),  # right after the first iter(), no batch taken
    "mid": (0, 2, True),
    "last_batch": (0, ALL, True),  # after the epoch's last batch, before its StopIteration
    "epoch_end": (1, 0, False),  # after epoch 0's StopIteration, before the next iter()
    "mid_epoch1": (1, 1, True),
    # from the state taken at "mid": resume, iter(), save again at once; and after one batch
    "after_resume": (0, 2, True),
    "after_resume_1": (0, 2, True),
    # at "mid_epoch1", two state_dict() calls in a row: equal, and both resume exactly
    "twice": (1, 1, True),
}
EVERY = tuple(POINTS)
SOME = ("before_iter", "mid", "last_batch", "epoch_end", "mid_epoch1", "after_resume_1")
FEW = ("mid", "epoch_end", "mid_epoch1", "after_resume")
ENDS = ("mid", "last_batch", "epoch_end", "mid_epoch1")
SNAPSHOT = ("mid", "mid_epoch1", "after_resume_1")  # steps 2, 6 and 3: off and on a multiple of 3

# What torchdata 0.11.0 gets wrong, each seen in these cases (the test xfails it strictly).
SHUFFLE_IN_PROCESS = (
    "torchdata: shuffle=True, num_workers=0: the restored RandomSampler generator misses the "
    "base-seed draw the loader's iterator makes from the same generator, so the epochs after "
    "the resumed one are shuffled otherwise"
)
STREAM_END_UNSAVED = (
    "torchdata: a state taken after an epoch's last batch, before its StopIteration, does not "
    "keep that the workers' streams ended: the resumed iter() yields a whole extra epoch"
)
PERSISTENT_EPOCH_END = (
    "torchdata: persistent workers, a state taken after StopIteration: the resumed epoch yields only its last batches"
)
REPLAY_COUNTED_TWICE = (
    "torchdata: a state taken after resuming a stateless iterable counts the replayed batches "
    "twice, so resuming from it skips as many"
)
SAMPLER_NEXT_EPOCH = (
    "torchdata: a sampler that starts its next epoch when exhausted: a state taken after the "
    "last batch, before StopIteration, resumes into that next epoch, not this one's empty rest"
)
SAMPLER_EPOCH_END_WORKERS = (
    "torchdata: a stateful sampler, 2 workers, a state taken after StopIteration: the resumed "
    "epoch yields only its last batch"
)
DISTRIBUTED_EPOCH_END = (
    "torchdata: StatefulDistributedSampler keeps yielded == its length after an epoch, so a "
    "state taken then (num_workers=0) skips the whole next epoch"
)


def _xfail(reason: str, *points: str) -> dict[str, str]:
    return dict.fromkeys(points, reason)


def _fork(workers: int, persistent: bool = False, **more: Any) -> dict[str, Any]:
    if workers == 0:
        return dict(more)
    return {"num_workers": workers, "multiprocessing_context": "fork", "persistent_workers": persistent, **more}


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# (name suffix, num_workers, persistent_workers)
W0, W2, W2P = ("w0", 0, False), ("w2", 2, False), ("w2_persistent", 2, True)


def _batched(
    kind: str,
    dataset: Callable[[], Any],
    variants: list[tuple[tuple[str, int, bool], tuple[str, ...], dict[str, str]]],
    **more: Any,
) -> list[Case]:
    """Cases of `kind` over `dataset`, batch_size=3 and `more` loader arguments, one per
    (workers, points, torchdata's xfails)."""
    return [
        Case(
            f"{kind}-{name}",
            dataset,
            lambda ds, w=workers, p=persistent: _fork(w, p, batch_size=3, **more),
            points,
            torchdata_xfail=xfail,
        )
        for (name, workers, persistent), points, xfail in variants
    ]


def _snapshot_cases(kind: str, dataset: Callable[[], Any], persistent: bool, snapshots: tuple[int, ...]) -> list[Case]:
    variant = "w2_persistent" if persistent else "w2"
    return [
        Case(
            f"{kind}-{variant}-snapshot{s}",
            dataset,
            lambda ds, s=s: _fork(2, persistent, batch_size=3, snapshot_every_n_steps=s),
            SNAPSHOT,
        )
        for s in snapshots
    ]


def _map_cases() -> list[Case]:
    shuffled = [
        Case(
            f"map_shuffle-{name}",
            MapRange,
            lambda ds, w=workers, p=persistent: _fork(w, p, batch_size=3, shuffle=True, generator=_g(7)),
            SOME,
            same_order=False,  # torchdata's own RandomSampler draws otherwise than torch's, which stoker follows
            torchdata_xfail=xfail,
        )
        for (name, workers, persistent), xfail in [
            (W0, _xfail(SHUFFLE_IN_PROCESS, "before_iter", "mid", "last_batch", "epoch_end", "after_resume_1")),
            (W2P, {}),
        ]
    ]
    return (
        _batched("map", MapRange, [(W0, EVERY, {}), (W2, SOME, {}), (W2P, EVERY, {})])
        + shuffled
        + _batched("map_rng_state", RngMap, [(W0, SOME, {}), (W2, FEW, {}), (W2P, FEW, {})])
        + _snapshot_cases("map", MapRange, False, (0, 3))
        + _snapshot_cases("map_rng_state", RngMap, True, (3,))
    )


def _iterable_cases() -> list[Case]:
    stream_end = _xfail(STREAM_END_UNSAVED, "last_batch")
    persistent_end = _xfail(PERSISTENT_EPOCH_END, "epoch_end")
    return (
        _batched(
            "iterable",
            SelfIterable,
            [(W0, EVERY, {}), (W2, SOME, stream_end), (W2P, EVERY, stream_end | persistent_end)],
        )
        + _batched("generator", GeneratorIterable, [(W0, SOME, {}), (W2, ENDS, stream_end), (W2P, FEW, persistent_end)])
        + _batched(
            "stateless",
            StatelessIterable,
            [
                (W0, SOME, _xfail(REPLAY_COUNTED_TWICE, "after_resume_1")),
                (W2, SOME, _xfail(REPLAY_COUNTED_TWICE, "after_resume_1")),
                (W2P, FEW, _xfail(REPLAY_COUNTED_TWICE, "after_resume")),
            ],
        )
        + _batched("separate_iterator", SeparateIterable, [(W0, SOME, {}), (W2, FEW, {})])
        + _batched("typed_state", TypedStateIterable, [(W0, SOME, {}), (W2P, SOME, stream_end | persistent_end)])
        + _batched(
            "counts_epochs",
            EpochCountingIterable,
            [(W0, SOME, {}), (W2, ("epoch_end", "mid_epoch1"), {}), (W2P, SOME, stream_end | persistent_end)],
        )
        + _snapshot_cases("iterable", SelfIterable, False, (3,))
        + _snapshot_cases("stateless", StatelessIterable, False, (0, 3))
    )


def _sampler_cases() -> list[Case]:
    cases = []
    for name, workers, _ in (W0, W2):
        cases += [
            Case(
                f"stateful_sampler-{name}",
                MapRange,
                lambda ds, w=workers: _fork(w, batch_size=3, sampler=StatefulSampler()),
                ENDS if workers else SOME,
                torchdata_xfail=_xfail(SAMPLER_NEXT_EPOCH, "last_batch")
                | (_xfail(SAMPLER_EPOCH_END_WORKERS, "epoch_end") if workers else {}),
            ),
            Case(
                f"stateful_batch_sampler-{name}",
                MapRange,
                lambda ds, w=workers: _fork(w, batch_sampler=StatefulBatchSampler()),
                ENDS if workers else SOME,
            ),
            Case(
                f"distributed_sampler-{name}",
                lambda: MapRange(N + 3),  # an odd share: the sampler pads it
                lambda ds, w=workers: _fork(
                    w, batch_size=2, sampler=StatefulDistributedSampler(ds, num_replicas=2, rank=1, seed=9)
                ),
                SOME,
                before_epoch=_set_epoch,
                torchdata_xfail={} if workers else _xfail(DISTRIBUTED_EPOCH_END, "epoch_end"),
            ),
        ]
    cases.append(
        Case(
            "stateful_sampler-w2_persistent-snapshot3",
            MapRange,
            lambda ds: _fork(2, True, batch_size=3, sampler=StatefulSampler(), snapshot_every_n_steps=3),
            SNAPSHOT,
        )
    )
    return cases


def _unordered_cases() -> list[Case]:
    return [
        Case(
            f"{kind}-{name}-unordered",
            dataset,
            lambda ds, p=persistent: _fork(2, p, batch_size=3, in_order=False),
            FEW,
            ordered=False,
        )
        for kind, dataset in (("map", MapRange), ("iterable", SelfIterable))
        for name, _, persistent in (W2, W2P)
    ]


CASES: list[Case] = _map_cases() + _iterable_cases() + _sampler_cases() + _unordered_cases()
