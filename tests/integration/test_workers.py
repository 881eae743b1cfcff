"""Worker features under fork, spawn, forkserver and threads, with the leak check."""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time

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
def test_batches_equal_in_process_batches(engine: str) -> None:
    expected = list(DataLoader(Numbers(), batch_size=3))
    got = list(DataLoader(Numbers(), batch_size=3, num_workers=2, **engine_kwargs(engine)))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a["i"].tolist() == b["i"].tolist() and np.array_equal(a["x"], b["x"]) and a["name"] == b["name"]


class Uneven(Dataset):
    """Sample cost varies, so that with in_order=False batches can overtake each other."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        if i % 8 < 4:
            time.sleep(0.005)
        return i


@pytest.mark.parametrize("engine", ENGINES)
def test_out_of_order_delivers_each_batch_once(engine: str) -> None:
    got = list(DataLoader(Uneven(), batch_size=4, num_workers=2, in_order=False, **engine_kwargs(engine)))
    batches = sorted(tuple(b.tolist()) for b in got)
    assert batches == [tuple(range(k, k + 4)) for k in range(0, 40, 4)], "each batch exactly once, whole"


def make_generator(kind: str):
    if kind == "int":
        return 123
    torch = pytest.importorskip("torch")
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("generator", ["int", "torch"])
@pytest.mark.parametrize("engine", ENGINES)
def test_worker_info_seeds_and_reproducibility(engine: str, generator: str) -> None:
    def run() -> list[list[dict]]:
        loader = DataLoader(
            WhoAmI(), batch_size=None, num_workers=2, generator=make_generator(generator), **engine_kwargs(engine)
        )
        return [list(loader) for _ in range(2)]

    first, again = run(), run()
    samples = first[0]
    assert sorted(s["i"] for s in samples) == list(range(16))
    assert {s["worker"] for s in samples} == {0, 1} and {s["workers"] for s in samples} == {2}
    seeds = {s["worker"]: s["seed"] for s in samples}
    assert len({(s["worker"], s["seed"]) for s in samples}) == 2, "one seed per worker"
    assert seeds[1] == seeds[0] + 1, "torch's rule: worker seed = base seed + worker id"
    epoch_seeds = {s["seed"] for s in first[1]}
    assert epoch_seeds.isdisjoint(seeds.values()), "each epoch draws a new base seed"
    assert [s["seed"] for e in first for s in e] == [s["seed"] for e in again for s in e]
    if engine != "threads":  # thread workers share the process: global RNGs are not seeded
        draws = [(s["np"], s["py"]) for e in first for s in e]
        assert draws == [(s["np"], s["py"]) for e in again for s in e], "a seeded run must reproduce"
        for rng in ("np", "py"):
            per = {(epoch, w): [s[rng] for s in first[epoch] if s["worker"] == w] for epoch in (0, 1) for w in (0, 1)}
            assert per[0, 0] != per[0, 1], f"workers must not share {rng} random streams"
            assert per[0, 0] != per[1, 0] and per[0, 1] != per[1, 1], f"{rng} draws must change between epochs"
            assert len({d for e in first for s in e for d in [s[rng]]}) == 32, f"repeated {rng} draws"
        assert len({s["pid"] for s in samples}) == 2
    assert stoker.get_worker_info() is None


@pytest.mark.parametrize("engine", ["fork", "spawn"])
def test_unseeded_runs_differ(engine: str) -> None:
    def run() -> list[float]:
        loader = DataLoader(WhoAmI(), batch_size=None, num_workers=2, **engine_kwargs(engine))
        return [s["np"] for s in loader] + [s["seed"] for s in loader]

    assert run() != run()


def seeds_and_draws(i: int) -> dict:
    import torch

    info = torch.utils.data.get_worker_info() or stoker.get_worker_info()
    return {"seed": info.seed, "py": random.random(), "torch": float(torch.rand(1))}


class TorchDraws(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return seeds_and_draws(i)


def test_worker_seeds_match_torch_for_the_same_generator() -> None:
    """torch.utils.data's workers and stoker.torch's see the same seeds and draws."""
    torch = pytest.importorskip("torch")
    import stoker.torch as st

    def run(module) -> list:
        loader = module.DataLoader(
            TorchDraws(),
            batch_size=None,
            num_workers=2,
            generator=torch.Generator().manual_seed(7),
            multiprocessing_context="fork",
        )
        return [[(s["seed"], s["py"], s["torch"]) for s in loader] for _ in range(2)]

    ours, theirs = run(st), run(torch.utils.data)
    assert ours == theirs


@pytest.mark.parametrize("engine", ENGINES)
def test_persistent_workers_survive_epochs(engine: str) -> None:
    loader = DataLoader(WhoAmI(), batch_size=4, num_workers=2, persistent_workers=True, **engine_kwargs(engine))
    pids, seeds = [], set()
    for _ in range(3):
        batches = list(loader)
        assert [i for b in batches for i in b["i"].tolist()] == list(range(16))
        assert sorted({w for b in batches for w in b["worker"].tolist()}) == [0, 1]
        pids.append(sorted({p for b in batches for p in b["pid"].tolist()}))
        seeds |= {s for b in batches for s in b["seed"].tolist()}
    assert len(seeds) == 2, "with persistent workers the base seed is drawn once"
    assert pids[0] == pids[1] == pids[2], "the same workers serve every epoch"
    if engine != "threads":
        assert len(pids[0]) == 2 and os.getpid() not in pids[0]
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


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("engine", ENGINES)
def test_worker_init_fn_runs_once_per_worker(engine: str, persistent: bool, tmp_path) -> None:
    path = str(tmp_path / "inits")
    loader = DataLoader(
        InitRecorder(path),
        batch_size=2,
        num_workers=2,
        worker_init_fn=append_init,
        persistent_workers=persistent,
        **engine_kwargs(engine),
    )
    for _ in range(3):
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with open(path) as f:
        inits = sorted(f.read().split())
    # persistent workers start once; otherwise each epoch starts two new workers
    assert inits == (["0", "1"] if persistent else ["0", "0", "0", "1", "1", "1"])
    del loader


@pytest.mark.parametrize("engine", ENGINES)
def test_iterable_sharded_and_unsharded(engine: str) -> None:
    sharded = DataLoader(Stream(50, True), batch_size=4, num_workers=2, **engine_kwargs(engine))
    assert sorted(i for b in sharded for i in b.tolist()) == list(range(50))
    # torch's warning, at torch's threshold: batches yielded against the reported length
    with pytest.warns(UserWarning, match="IterableDataset replica at each worker"):
        loader = DataLoader(Stream(10, False), batch_size=1, num_workers=2, **engine_kwargs(engine))
        len(loader)
        items = sorted(i for b in loader for i in b.tolist())
    assert items == sorted(list(range(10)) * 2)


@pytest.mark.parametrize("engine", ["fork", "spawn", "threads"])
@pytest.mark.parametrize("prefetch_factor", [1, 2, 4])
def test_prefetch_factor_bounds_work_done_ahead(engine: str, prefetch_factor: int) -> None:
    from tests.support.leakcheck import Snapshot

    counter = multiprocessing.get_context("spawn" if engine == "spawn" else "fork").Value("i", 0)
    before = Snapshot()  # after the counter: multiprocessing keeps its heap's fd open
    batch_size, workers = 2, 2
    loader = DataLoader(
        Counted(counter),
        batch_size=batch_size,
        num_workers=workers,
        prefetch_factor=prefetch_factor,
        **engine_kwargs(engine),
    )
    window = prefetch_factor * workers * batch_size

    def settled(at_least: int) -> int:
        """The count once it has reached `at_least`, after giving the workers time to overshoot."""
        deadline = time.monotonic() + 60  # a generous bound: polled, costs nothing when prompt
        while counter.value < at_least:
            assert time.monotonic() < deadline, f"only {counter.value} of {at_least} samples were fetched"
            time.sleep(0.01)
        time.sleep(0.3)
        return counter.value

    iterator = iter(loader)
    before_first = settled(window)  # iter() alone fills the window
    assert before_first <= window, f"{before_first} samples fetched before the first batch was consumed"
    first = next(iterator)
    after_first = settled(window + batch_size)  # consuming one batch frees one place
    assert after_first <= window + batch_size, f"{after_first} samples fetched after one batch was consumed"
    assert first.tolist() == [0, 1] and [b.tolist() for b in iterator][-1] == [62, 63]
    assert counter.value == 64
    del iterator, loader
    assert before.wait_clean() == []


class Unpicklable(Dataset):
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


class HoldsLambda(Dataset):
    def __init__(self) -> None:
        self.transform = lambda x: x + 1

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return self.transform(i)


@pytest.mark.parametrize("dataset", [Unpicklable, HoldsLambda])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_unpicklable_dataset_under_spawn_names_it(method: str, dataset: type) -> None:
    with pytest.raises(TypeError, match="dataset") as caught, pytest.warns(UserWarning, match=PICKLE_WARNING):
        list(DataLoader(dataset(), num_workers=2, multiprocessing_context=method))
    assert dataset.__name__ in str(caught.value), "the message should show which object"
    # the same dataset is fine where nothing is pickled
    assert len(list(DataLoader(dataset(), num_workers=2, multiprocessing_context="fork"))) == 4


def test_unpicklable_collate_fn_is_named() -> None:
    with pytest.raises(TypeError, match="collate_fn"), pytest.warns(UserWarning, match=PICKLE_WARNING):
        list(DataLoader(Numbers(), num_workers=1, multiprocessing_context="spawn", collate_fn=lambda b: b))


PICKLE_WARNING = "Got pickle error when attempting to start a worker Process"


def test_local_worker_init_fn_under_forkserver_warns_as_torch_then_names_it() -> None:
    """torch warns before the pickling error; code that filters or matches that warning
    keeps working, and stoker's error then says which argument could not be pickled."""

    def init(worker_id: int) -> None:  # a local function cannot be pickled
        pass

    loader = DataLoader(Numbers(), num_workers=1, multiprocessing_context="forkserver", worker_init_fn=init)
    with pytest.warns(UserWarning, match=PICKLE_WARNING) as warned, pytest.raises(TypeError, match="worker_init_fn"):
        iter(loader)
    ours = [w for w in warned if issubclass(w.category, UserWarning) and PICKLE_WARNING in str(w.message)]
    assert ours[0].filename == __file__, "the warning points at the user's iter(loader)"


@pytest.mark.parametrize("engine", ENGINES)
def test_kept_batches_are_never_overwritten(engine: str) -> None:
    class_ds = Numbers(400)
    kept = list(DataLoader(class_ds, batch_size=4, num_workers=2, **engine_kwargs(engine)))
    assert len(kept) == 100
    for k, batch in enumerate(kept):
        assert batch["i"].tolist() == list(range(4 * k, 4 * k + 4))
        assert (batch["x"][:, 0, 0] == np.arange(4 * k, 4 * k + 4)).all()
    del kept


def test_several_loaders_and_iterators_at_once() -> None:
    a = iter(DataLoader(Numbers(), batch_size=5, num_workers=2))
    b = iter(DataLoader(Numbers(), batch_size=5, num_workers=2, thread_pool=True))
    c = iter(DataLoader(Numbers(), batch_size=5, num_workers=1, multiprocessing_context="spawn"))
    rows = [list(zip(*(it["i"].tolist() for it in (next(a), next(b), next(c))))) for _ in range(8)]
    assert all(x == y == z for row in rows for x, y, z in row)
    del a, b, c


def test_torch_tensors_from_workers_are_real_tensors() -> None:
    torch = pytest.importorskip("torch")
    import stoker.torch as st

    batches = list(st.DataLoader(Numbers(), batch_size=8, num_workers=2))
    assert all(isinstance(b["x"], torch.Tensor) and b["x"].dtype == torch.float32 for b in batches)
    assert torch.equal(batches[1]["i"], torch.arange(8, 16))
    del batches


class Images(Dataset):
    def __len__(self) -> int:
        return 240

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full((3, 16, 16), i % 256, np.uint8)


@pytest.mark.parametrize("engine", ["fork", "spawn"])
def test_kept_views_survive_slot_reuse(engine: str) -> None:
    """Most batches are dropped (their slots are reused); slices kept from the others stay intact."""
    kept = {}
    for k, batch in enumerate(DataLoader(Images(), batch_size=8, num_workers=2, **engine_kwargs(engine))):
        if k % 7 == 0:
            kept[k] = batch[3:5, 1]  # a view into the batch's slot, not a copy
        del batch
    assert len(kept) == 5
    for k, view in kept.items():
        assert view.shape == (2, 16, 16)
        assert view[0].min() == view[0].max() == 8 * k + 3 and view[1].min() == view[1].max() == 8 * k + 4, k
    del kept


def test_kept_torch_tensors_survive_slot_reuse() -> None:
    torch = pytest.importorskip("torch")
    import stoker.torch as st

    kept = {}
    for k, batch in enumerate(st.DataLoader(Images(), batch_size=8, num_workers=2)):
        assert isinstance(batch, torch.Tensor)
        if k % 7 == 0:
            kept[k] = batch[6]
        del batch
    for k, t in kept.items():
        assert torch.equal(t, torch.full((3, 16, 16), 8 * k + 6, dtype=torch.uint8)), k
    del kept


class RaisesLocalError(Dataset):
    """Sample 5 raises an exception whose class cannot be pickled (defined in a function)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:

            class LocalError(Exception):
                pass

            raise LocalError("planted at 5")
        return i


@pytest.mark.parametrize("engine", ENGINES)
def test_exception_of_an_unpicklable_type_is_still_reported(engine: str) -> None:
    iterator = iter(DataLoader(RaisesLocalError(), batch_size=None, num_workers=2, **engine_kwargs(engine)))
    before = [int(next(iterator)) for _ in range(5)]
    try:
        next(iterator)
        error = ("", "no error")
    except Exception as exc:  # keep no reference to the traceback (it holds the iterator)
        error = (type(exc).__name__, str(exc))
    after = [int(b) for b in iterator]
    del iterator
    assert before == [0, 1, 2, 3, 4]
    message = error[1]
    assert "LocalError" in message and "planted at 5" in message, error
    assert "worker 1" in message and "sample index 5" in message, message
    assert after == [6, 7], "a sample's error must not end the epoch"


class Plain(Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("engine", ["fork", "threads"])
def test_shuffled_epochs_with_workers_equal_torchs(engine: str, persistent: bool) -> None:
    """One loader generator feeds both the shuffling and the workers' base seeds, across
    epochs (and, when persistent, the next epoch's early start): same order as torch's."""
    torch = pytest.importorskip("torch")
    import torch.utils.data as tud

    import stoker.torch as st

    def run(module, **extra) -> list:
        loader = module.DataLoader(
            Plain(),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(3),
            num_workers=2,
            persistent_workers=persistent,
            **extra,
        )
        return [[b.tolist() for b in loader] for _ in range(3)]

    ours = run(st, **engine_kwargs(engine))
    theirs = run(tud, multiprocessing_context="fork")
    assert ours == theirs
    assert ours[0] != ours[1] != ours[2]


class SleepsAt(Dataset):
    """Sample `at` takes `sleep_s` seconds; the others none."""

    def __init__(self, at: int, sleep_s: float) -> None:
        self.at = at
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        if i == self.at:
            time.sleep(self.sleep_s)
        return i


def sleeping_at_batch_1(sleep_s: float):
    """An iterator (2 fork workers, timeout=1) that has given batch 0; batch 1 takes sleep_s."""
    loader = DataLoader(SleepsAt(1, sleep_s), batch_size=1, num_workers=2, timeout=1, multiprocessing_context="fork")
    iterator = iter(loader)
    assert next(iterator).tolist() == [0]
    return iterator


@pytest.mark.timeout(60)
def test_a_worker_timed_out_on_is_terminated_at_close_without_the_grace_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc

    import psutil

    from stoker._core import engines

    # a grace period longer than the test's timeout: closing gets past it only by terminating
    # the hung worker at once (it would never read its Stop), never by waiting it out
    monkeypatch.setattr(engines, "JOIN_TIMEOUT_S", 3600.0)
    iterator = sleeping_at_batch_1(600.0)
    with pytest.raises(RuntimeError, match="timed out after 1 seconds waiting for batch 1"):
        next(iterator)
    hung = psutil.Process(iterator._engine.pid(1))
    del iterator
    gc.collect()
    assert not hung.is_running()


def test_a_worker_that_answers_after_a_timeout_is_not_taken_for_hung() -> None:
    iterator = sleeping_at_batch_1(1.5)
    with pytest.raises(RuntimeError, match="timed out"):
        next(iterator)
    assert iterator._engine._stuck == {1}
    assert next(iterator).tolist() == [1]  # torch's rule: after a timeout the iterator goes on
    assert iterator._engine._stuck == set()
    assert [b.tolist() for b in iterator] == [[2], [3], [4], [5]]
