"""`iterator.stats()` / `loader.stats()` with real workers: the figures add up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

import stoker
from stoker import DataLoader, Dataset, IterableDataset

ENGINES = ["inline", "fork", "spawn", "forkserver", "threads"]


def engine_kwargs(engine: str, workers: int = 2) -> dict:
    if engine == "inline":
        return {"num_workers": 0}
    if engine == "threads":
        return {"num_workers": workers, "thread_pool": True}
    return {"num_workers": workers, "multiprocessing_context": engine}


class Arrays(Dataset):
    """Samples of uneven array sizes, so that bytes are not a multiple of one figure."""

    def __init__(self, n: int = 103, sleep_s: float = 0.0) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return {"x": np.full((i % 5 + 1, 3), i, np.float32), "i": np.int64(i), "name": f"s{i}"}


def collate_flat(samples: list) -> dict:
    """Keeps each sample's array as it is (lists of arrays): bytes are exactly the samples'."""
    return {"x": [s["x"] for s in samples], "i": np.array([s["i"] for s in samples])}


def expected_bytes(n: int) -> int:
    return sum((i % 5 + 1) * 3 * 4 for i in range(n)) + n * 8


@pytest.mark.parametrize("engine", ENGINES)
def test_figures_add_up(engine: str) -> None:
    n = 103
    loader = DataLoader(Arrays(n, sleep_s=0.0005), batch_size=4, collate_fn=collate_flat, **engine_kwargs(engine))
    began = time.perf_counter()
    inside = 0.0
    entered = time.perf_counter()
    iterator = iter(loader)
    inside += time.perf_counter() - entered
    batches = 0
    while True:
        entered = time.perf_counter()
        try:
            next(iterator)
        except StopIteration:
            inside += time.perf_counter() - entered
            break
        inside += time.perf_counter() - entered
        batches += 1
        time.sleep(0.002)  # the consumer's step
    total = time.perf_counter() - began
    stats = iterator.stats()
    assert stats.samples == n
    assert stats.batches == batches == 26
    assert stats.bytes == expected_bytes(n)
    outside = total - inside
    # the loader's clock reads sit inside the test's: its wait within the time the test spent
    # in its calls, the rest of its epoch around the time the test spent outside them
    assert stats.wait_s <= inside
    assert stats.elapsed_s - stats.wait_s >= outside >= 25 * 0.002
    assert stats.elapsed_s <= total
    assert abs(stats.readiness - (1 - stats.wait_s / stats.elapsed_s)) < 1e-9
    workers = stats.workers
    assert len(workers) == max(stats.num_workers, 1)
    assert sum(w.batches for w in workers) == batches
    for w in workers:
        assert w.restarts == 0
        assert w.fetch_s >= 0.0005 * 4 * w.batches  # each sample sleeps at least 0.5 ms
        assert w.fetch_s + w.collate_s <= w.busy_s + 1e-6
    if engine == "inline":
        assert workers[0].pid == os.getpid()
    elif engine == "threads":
        assert all(w.pid is None for w in workers)
    else:
        assert all(w.pid is not None and w.pid != os.getpid() for w in workers)
    # the epoch ended: elapsed is frozen, and the loader gives the same figures
    time.sleep(0.05)
    assert iterator.stats().elapsed_s == stats.elapsed_s
    assert loader.stats() == iterator.stats()


def test_default_collate_bytes_and_samples_with_a_short_last_batch() -> None:
    class Images(Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> tuple:
            return np.zeros((3, 8, 8), np.uint8), i

    loader = DataLoader(Images(), batch_size=4, num_workers=2)
    for _ in loader:
        pass
    stats = loader.stats()
    assert (stats.batches, stats.samples) == (3, 10)
    assert stats.bytes == 10 * 3 * 8 * 8 + 10 * 8  # the images, and the labels as int64


def test_torch_flavour_counts_tensor_bytes() -> None:
    torch = pytest.importorskip("torch")
    import stoker.torch as st

    loader = st.DataLoader(st.TensorDataset(torch.zeros(20, 5), torch.arange(20)), batch_size=8, num_workers=2)
    batches = list(loader)
    stats = loader.stats()
    assert stats.samples == 20
    assert stats.bytes == sum(b[0].nbytes + b[1].nbytes for b in batches) == 20 * 5 * 4 + 20 * 8


class Held(Dataset):
    """Samples that cannot be fetched before `gate` opens."""

    def __init__(self, n: int, gate: threading.Event) -> None:
        self.n, self.gate = n, gate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        self.gate.wait()
        return np.full(3, i)


def test_wait_reflects_a_slow_loader_and_readiness_a_fast_one() -> None:
    # Only what holds whatever the machine's load: sleeps and holds last at least as long as
    # asked, and the loader's clock reads sit inside the test's.
    # A loader held back 0.3 s: its epoch lasts that long, and its wait is the consumer's time
    # in its calls (all but the loop around them).
    gate = threading.Event()
    slow = DataLoader(Held(8, gate), batch_size=4, num_workers=1, thread_pool=True)
    opener = threading.Timer(0.3, gate.set)
    entered = time.perf_counter()
    iterator = iter(slow)  # the epoch's clock starts here, and its wait with it
    inside = time.perf_counter() - entered
    opener.start()
    while True:
        entered = time.perf_counter()
        try:
            next(iterator)
        except StopIteration:
            break
        finally:
            inside += time.perf_counter() - entered
    opener.join()
    stats = slow.stats()
    assert stats.elapsed_s >= 0.3 and 0 < stats.wait_s <= inside
    assert stats.readiness == pytest.approx(1 - stats.wait_s / stats.elapsed_s)
    # a slow consumer: its own steps count towards the loader's readiness, never as its wait
    fast = DataLoader(Arrays(40), batch_size=4, collate_fn=collate_flat, num_workers=2, thread_pool=True)
    iterator = iter(fast)
    next(iterator)
    for _ in iterator:
        time.sleep(0.02)
    stats = fast.stats()
    assert stats.elapsed_s - stats.wait_s >= 9 * 0.02
    assert stats.readiness == pytest.approx(1 - stats.wait_s / stats.elapsed_s)
    assert stats.ready == 0  # everything was handed out


def test_ready_counts_batches_waiting_for_the_consumer() -> None:
    loader = DataLoader(Arrays(64), batch_size=4, collate_fn=collate_flat, num_workers=2, prefetch_factor=3)
    iterator = iter(loader)
    next(iterator)
    deadline = time.monotonic() + 10
    while iterator.stats().ready < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert iterator.stats().ready == 6  # the window (prefetch_factor x workers), refilled after next()
    next(iterator)
    assert iterator.stats().ready >= 5
    iterator.close()


def test_persistent_workers_count_each_epoch_from_its_iter() -> None:
    loader = DataLoader(Arrays(24), batch_size=4, collate_fn=collate_flat, num_workers=2, persistent_workers=True)
    firsts = []
    for epoch in range(3):
        for _ in loader:
            pass
        stats = loader.stats()
        assert (stats.epoch, stats.batches, stats.samples) == (epoch, 6, 24)
        firsts.append(stats)
    pids = {w.pid for w in firsts[0].workers}
    assert all({w.pid for w in s.workers} == pids for s in firsts)  # the same workers


def test_iterable_dataset_samples_per_replica() -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            info = stoker.get_worker_info()
            worker, count = (0, 1) if info is None else (info.id, info.num_workers)
            return iter(range(worker, 30, count))

    loader = DataLoader(Stream(), batch_size=4, num_workers=2)
    for _ in loader:
        pass
    stats = loader.stats()
    assert stats.samples == 30
    assert stats.batches == 8  # 15 items per replica: 4 + 4 + 4 + 3 each
    assert [w.batches for w in stats.workers] == [4, 4]


def test_a_restarted_worker_is_counted() -> None:
    class KillsOnce(Dataset):
        def __init__(self, marker: str) -> None:
            self.marker = marker

        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> int:
            if i == 21 and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return i

    import tempfile

    marker = os.path.join(tempfile.mkdtemp(), "killed")
    loader = DataLoader(KillsOnce(marker), batch_size=4, num_workers=2, max_worker_restarts=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stoker.WorkerRestartWarning)
        got = [int(x) for b in loader for x in b]
    assert got == list(range(40))
    stats = loader.stats()
    assert stats.samples == 40
    assert sum(w.restarts for w in stats.workers) == 1
    restarted = next(w for w in stats.workers if w.restarts)
    assert restarted.pid is not None


def test_stats_after_the_iterator_is_dropped_and_after_close() -> None:
    loader = DataLoader(Arrays(40), batch_size=4, collate_fn=collate_flat, num_workers=2)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    iterator.close()
    frozen = iterator.stats()
    assert frozen.batches == 3 and frozen.ready == 0
    time.sleep(0.02)
    assert iterator.stats().elapsed_s == frozen.elapsed_s
    del iterator
    assert loader.stats().batches == 3


def test_an_error_in_a_sample_leaves_the_figures_of_what_was_delivered() -> None:
    class Fails(Dataset):
        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> int:
            if i == 9:
                raise KeyError("nine")
            return i

    loader = DataLoader(Fails(), batch_size=2, num_workers=2)
    iterator = iter(loader)
    seen = 0
    with pytest.raises(KeyError):
        for _ in iterator:
            seen += 1
    assert loader.stats().batches == seen == 4
    assert loader.stats().samples == 8


def test_stats_false_keeps_no_figures_and_says_so() -> None:
    loader = DataLoader(Arrays(8), batch_size=4, collate_fn=collate_flat, num_workers=2, stats=False)
    iterator = iter(loader)
    assert len(list(iterator)) == 2
    with pytest.raises(RuntimeError, match="stats=False"):
        iterator.stats()
    with pytest.raises(RuntimeError, match="stats=False"):
        loader.stats()


def test_stats_before_iter_says_so() -> None:
    with pytest.raises(RuntimeError, match="not been iterated"):
        DataLoader(Arrays(8)).stats()


@pytest.mark.parametrize("name", ["stats", "progress"])
def test_flags_must_be_bools(name: str) -> None:
    with pytest.raises(TypeError, match=name):
        DataLoader(Arrays(8), **{name: 1})


def test_progress_needs_stats() -> None:
    with pytest.raises(ValueError, match="stats=False"):
        DataLoader(Arrays(8), progress=True, stats=False)


def test_progress_without_tqdm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    with pytest.raises(ImportError, match=r"stoker\[progress\]"):
        DataLoader(Arrays(8), progress=True)


def test_as_dict_and_str() -> None:
    import json

    loader = DataLoader(Arrays(12), batch_size=4, collate_fn=collate_flat, num_workers=2)
    for _ in loader:
        pass
    stats = loader.stats()
    plain = stats.as_dict()
    assert json.loads(json.dumps(plain))["samples"] == 12
    assert plain["workers"][0]["batches"] + plain["workers"][1]["batches"] == 3
    assert plain["readiness"] == stats.readiness
    line = str(stats)
    assert "\n" not in line
    assert "12 samples" in line and "readiness" in line and "2 process workers" in line


PROGRESS_CHILD = textwrap.dedent(
    """
    import sys, numpy as np, stoker

    class D(stoker.Dataset):
        def __len__(self): return 40
        def __getitem__(self, i): return np.zeros(3)

    if __name__ == "__main__":
        loader = stoker.DataLoader(D(), batch_size=4, num_workers=2, progress=True,
                                   persistent_workers=True, multiprocessing_context=sys.argv[1])
        for epoch in range(2):
            for _ in loader:
                pass
        print("done", flush=True)
    """
)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_progress_draws_one_bar_per_epoch_from_the_main_process(tmp_path, method: str) -> None:
    script = tmp_path / "progress_child.py"
    script.write_text(PROGRESS_CHILD)
    done = subprocess.run(
        [sys.executable, str(script), method],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"
    final = [line for line in done.stderr.replace("\r", "\n").splitlines() if "10/10" in line]
    epochs = {line.split(":")[0] for line in final}
    assert epochs == {"epoch 0", "epoch 1"}, done.stderr
    assert all("samples/s" in line and "readiness" in line for line in final), final
    # no bar was started by a worker: every bar line belongs to one of the two epochs
    assert all(
        line.startswith(("epoch 0", "epoch 1"))
        for line in done.stderr.replace("\r", "\n").splitlines()
        if "batch" in line
    )
