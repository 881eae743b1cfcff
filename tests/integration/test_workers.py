"""Worker features under fork, spawn, forkserver and threads, with the leak check."""

from __future__ import annotations

import multiprocessing
import os
import random
import threading

import numpy as np
import pytest

import stoker
from stoker import DataLoader, Dataset, IterableDataset

ENGINES = ["fork", "spawn", "forkserver", "threads"]


def engine_kwargs(engine: str) -> dict:
    if engine == "threads":
        return {"thread_pool": True}
    return {"multiprocessing_context": engine}


class Numbers(Dataset):
    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"i": i, "x": np.full((2, 3), i, np.float32), "name": f"s{i}"}


class WhoAmI(Dataset):
    """Each sample says which worker made it, with what seed, and draws from the global RNGs."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        info = stoker.get_worker_info()
        return {
            "i": i,
            "worker": info.id,
            "workers": info.num_workers,
            "seed": info.seed,
            "pid": os.getpid(),
            "np": np.random.rand(),
            "py": random.random(),
        }


class Stream(IterableDataset):
    def __init__(self, n: int, sharded: bool) -> None:
        self.n, self.sharded = n, sharded

    def __iter__(self):
        info = stoker.get_worker_info()
        if self.sharded and info is not None:
            return iter(range(info.id, self.n, info.num_workers))
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class Counted(Dataset):
    """Counts fetches in shared memory, to see how far ahead the workers ran."""

    def __init__(self, counter) -> None:
        self.counter = counter

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        with self.counter.get_lock():
            self.counter.value += 1
        return i


def record_init(worker_id: int) -> None:
    info = stoker.get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.inits.append(worker_id) if hasattr(info.dataset, "inits") else None


@pytest.mark.parametrize("engine", ENGINES)
def test_batches_equal_in_process_batches(engine: str, no_leaks) -> None:
    expected = list(DataLoader(Numbers(), batch_size=3))
    got = list(DataLoader(Numbers(), batch_size=3, num_workers=2, **engine_kwargs(engine)))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a["i"].tolist() == b["i"].tolist() and np.array_equal(a["x"], b["x"]) and a["name"] == b["name"]


@pytest.mark.parametrize("engine", ["fork", "threads"])
def test_out_of_order_delivers_each_batch_once(engine: str, no_leaks) -> None:
    got = list(DataLoader(Numbers(), batch_size=4, num_workers=2, in_order=False, **engine_kwargs(engine)))
    assert sorted(i for b in got for i in b["i"].tolist()) == list(range(40))


@pytest.mark.parametrize("engine", ENGINES)
def test_worker_info_seeds_and_reproducibility(engine: str, no_leaks) -> None:
    def run() -> list[list[dict]]:
        loader = DataLoader(WhoAmI(), batch_size=None, num_workers=2, generator=123, **engine_kwargs(engine))
        return [list(loader) for _ in range(2)]

    first, again = run(), run()
    samples = first[0]
    assert {s["worker"] for s in samples} == {0, 1} and {s["workers"] for s in samples} == {2}
    seeds = {s["worker"]: s["seed"] for s in samples}
    assert seeds[1] == seeds[0] + 1
    epoch_seeds = {s["seed"] for s in first[1]}
    assert epoch_seeds.isdisjoint(seeds.values()), "each epoch draws a new base seed"
    assert [s["seed"] for e in first for s in e] == [s["seed"] for e in again for s in e]
    if engine != "threads":  # thread workers share the process: global RNGs are not seeded
        draws = [(s["np"], s["py"]) for e in first for s in e]
        assert draws == [(s["np"], s["py"]) for e in again for s in e], "a seeded run must reproduce"
        by_worker = {w: [s["np"] for s in samples if s["worker"] == w][0] for w in (0, 1)}
        assert by_worker[0] != by_worker[1], "workers must not share random streams"
    assert stoker.get_worker_info() is None


@pytest.mark.parametrize("engine", ["fork", "spawn", "threads"])
def test_persistent_workers_survive_epochs(engine: str, no_leaks) -> None:
    loader = DataLoader(WhoAmI(), batch_size=4, num_workers=2, persistent_workers=True, **engine_kwargs(engine))
    pids, seeds = set(), set()
    for _ in range(3):
        batches = list(loader)
        assert [i for b in batches for i in b["i"].tolist()] == list(range(16))
        pids |= {p for b in batches for p in b["pid"].tolist()}
        seeds |= {s for b in batches for s in b["seed"].tolist()}
    assert len(seeds) == 2, "with persistent workers the base seed is drawn once"
    if engine != "threads":
        assert len(pids) == 2, "the same two worker processes serve every epoch"
    del loader


class InitRecorder(Dataset):
    def __init__(self, path: str) -> None:
        self.path = path

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i


def append_init(worker_id: int) -> None:
    info = stoker.get_worker_info()
    with open(info.dataset.path, "a") as f:
        f.write(f"{worker_id}\n")


@pytest.mark.parametrize("engine", ENGINES)
def test_worker_init_fn_runs_once_per_worker(engine: str, tmp_path, no_leaks) -> None:
    path = str(tmp_path / "inits")
    loader = DataLoader(
        InitRecorder(path), batch_size=2, num_workers=2, worker_init_fn=append_init,
        persistent_workers=True, **engine_kwargs(engine)
    )
    for _ in range(3):
        assert len(list(loader)) == 4
    with open(path) as f:
        assert sorted(f.read().split()) == ["0", "1"]
    del loader


@pytest.mark.parametrize("engine", ENGINES)
def test_iterable_sharded_and_unsharded(engine: str, no_leaks) -> None:
    sharded = DataLoader(Stream(50, True), batch_size=4, num_workers=2, **engine_kwargs(engine))
    assert sorted(i for b in sharded for i in b.tolist()) == list(range(50))
    with pytest.warns(UserWarning, match="not sharded"):
        loader = DataLoader(Stream(10, False), batch_size=4, num_workers=2, **engine_kwargs(engine))
        len(loader)
        items = sorted(i for b in loader for i in b.tolist())
    assert items == sorted(list(range(10)) * 2)


@pytest.mark.parametrize("prefetch_factor", [1, 2, 4])
def test_prefetch_factor_bounds_work_done_ahead(prefetch_factor: int) -> None:
    from leakcheck import Snapshot

    counter = multiprocessing.get_context("fork").Value("i", 0)
    before = Snapshot()  # after the counter: multiprocessing keeps its heap's fd open
    loader = DataLoader(Counted(counter), batch_size=2, num_workers=2, prefetch_factor=prefetch_factor,
                        multiprocessing_context="fork")
    iterator = iter(loader)
    next(iterator)
    import time

    time.sleep(0.5)  # give the workers every chance to run ahead
    fetched = counter.value
    # at most prefetch_factor * num_workers batches outstanding, plus the one consumed
    assert fetched <= (prefetch_factor * 2 + 1) * 2, fetched
    assert fetched >= 2 * 2, "the window should have been filled"
    del iterator
    assert before.wait_clean() == []


class Unpicklable(Dataset):
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_unpicklable_dataset_under_spawn_names_it(method: str, no_leaks) -> None:
    with pytest.raises(TypeError, match="dataset"):
        list(DataLoader(Unpicklable(), num_workers=2, multiprocessing_context=method))


def test_unpicklable_collate_fn_is_named(no_leaks) -> None:
    with pytest.raises(TypeError, match="collate_fn"):
        list(DataLoader(Numbers(), num_workers=1, multiprocessing_context="spawn", collate_fn=lambda b: b))


@pytest.mark.parametrize("engine", ["fork", "spawn"])
def test_kept_batches_are_never_overwritten(engine: str, no_leaks) -> None:
    class_ds = Numbers(400)
    kept = list(DataLoader(class_ds, batch_size=4, num_workers=2, **engine_kwargs(engine)))
    assert len(kept) == 100
    for k, batch in enumerate(kept):
        assert batch["i"].tolist() == list(range(4 * k, 4 * k + 4))
        assert (batch["x"][:, 0, 0] == np.arange(4 * k, 4 * k + 4)).all()
    del kept


def test_several_loaders_and_iterators_at_once(no_leaks) -> None:
    a = iter(DataLoader(Numbers(), batch_size=5, num_workers=2))
    b = iter(DataLoader(Numbers(), batch_size=5, num_workers=2, thread_pool=True))
    c = iter(DataLoader(Numbers(), batch_size=5, num_workers=1, multiprocessing_context="spawn"))
    rows = [list(zip(*(it["i"].tolist() for it in (next(a), next(b), next(c))))) for _ in range(8)]
    assert all(x == y == z for row in rows for x, y, z in row)
    del a, b, c


def test_torch_tensors_from_workers_are_real_tensors(no_leaks) -> None:
    torch = pytest.importorskip("torch")
    import stoker.torch as st

    batches = list(st.DataLoader(Numbers(), batch_size=8, num_workers=2))
    assert all(isinstance(b["x"], torch.Tensor) and b["x"].dtype == torch.float32 for b in batches)
    assert torch.equal(batches[1]["i"], torch.arange(8, 16))
    del batches
