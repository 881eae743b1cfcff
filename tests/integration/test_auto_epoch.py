"""num_workers="auto" on a map-style dataset: the first epoch's first batches are fetched in
the main process, delivered, and timed; then the rest of the epoch moves to the workers
chosen. Nothing is fetched twice, the batches are those of any fixed worker count, and
resume, persistence, faults and shutdown work across the move."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import stoker
from stoker import DataLoader, Dataset, WorkerDiedError
from stoker._core import auto
from stoker._core.loader import usable_cpus

N = 96
BATCH = 4


class Busy(Dataset):
    """4 ms of CPU per sample (16 ms batches: workers pay off on 2 CPUs), an augmentation from
    `sample_rng()` (or numpy's global RNG), and a count of the fetches made in the process that holds it."""

    def __init__(
        self,
        n: int = N,
        busy_s: float = 0.004,
        fail_at: int | None = None,
        kill_at: int | None = None,
        global_rng: bool = False,
        kill_once: str | None = None,
    ):
        self.kill_once = kill_once  # a file that says the kill happened (a restarted worker lives)
        self.n, self.busy_s, self.fail_at, self.kill_at = n, busy_s, fail_at, kill_at
        self.global_rng = global_rng
        self.fetched: list[int] = []
        self.pid = os.getpid()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        end = time.perf_counter() + self.busy_s
        while time.perf_counter() < end:
            pass
        if i == self.fail_at:
            raise OSError(f"sample {i} is unreadable")
        if i == self.kill_at and os.getpid() != self.pid:
            if self.kill_once is None or not os.path.exists(self.kill_once):
                if self.kill_once is not None:
                    open(self.kill_once, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        self.fetched.append(i)
        draw = np.random.randint(1 << 30) if self.global_rng else stoker.sample_rng().integers(1 << 30)
        return np.array([i, draw], np.int64)


@pytest.fixture(autouse=True)
def _no_probe_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe budget is the one wall-clock bound on the head: on a busy machine a preempted
    batch could end it early. Without it the head is PROBE_BATCHES of these 16 ms batches (their
    total passes PROBE_MIN_S), or the whole of a shorter epoch, whatever the machine's load."""
    monkeypatch.setattr(auto, "PROBE_BUDGET_S", float("inf"))


def batches(loader: DataLoader) -> list[list[int]]:
    return [b.tolist() for b in loader]


def auto_loader(dataset: Dataset, **kwargs) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers="auto", generator=7, **kwargs)


def fixed_loader(dataset: Dataset, workers: int, **kwargs) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers, generator=7, **kwargs)


def head_length(loader: DataLoader) -> int:
    """How many batches the first epoch fetched inline, from the choice's own words."""
    reason = loader.stats().choice
    assert reason is not None
    return int(reason.split("median of ")[1].split()[0])


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver", "threads"])
def test_the_epoch_moves_to_workers_without_fetching_twice(context: str) -> None:
    dataset = Busy()
    extra = {"thread_pool": True} if context == "threads" else {"multiprocessing_context": context}
    loader = auto_loader(dataset, **extra)
    iterator = iter(loader)
    # not chosen yet, and the head runs inline; the attribute reads the count "auto" starts from
    assert loader.stats().choice is None and loader.stats().num_workers == 0
    assert loader.num_workers == auto.start_workers(usable_cpus() or 1)
    got = [next(iterator).tolist() for _ in range(auto.PROBE_BATCHES - 1)]
    assert loader.stats().choice is None
    got.append(next(iterator).tolist())
    assert loader.stats().choice is not None and loader.num_workers >= 1  # chosen after the head
    got += [b.tolist() for b in iterator]
    stats = loader.stats()
    head = head_length(loader)
    assert head == auto.PROBE_BATCHES
    # the same batches as a fixed worker count, none lost, none repeated
    assert got == batches(fixed_loader(Busy(), 0)) == batches(fixed_loader(Busy(), 2))
    assert sorted(row[0] for b in got for row in b) == list(range(N))
    assert stats.batches == N // BATCH and stats.samples == N
    assert sum(w.batches for w in stats.workers) == N // BATCH - head  # the workers made the rest
    assert stats.num_workers == loader.num_workers and len(stats.workers) == loader.num_workers
    if context != "threads":
        # the main process fetched only the head; processes fetch from their own copies
        assert len(dataset.fetched) == head * BATCH
        assert all(w.pid not in (None, os.getpid()) for w in stats.workers)


def test_global_rng_draws_match_with_seed_each_batch() -> None:
    got = batches(auto_loader(Busy(global_rng=True), seed_each_batch=True, multiprocessing_context="fork"))
    assert got == batches(fixed_loader(Busy(global_rng=True), 0, seed_each_batch=True))
    assert got == batches(fixed_loader(Busy(global_rng=True), 2, seed_each_batch=True))


def test_the_choice_is_kept_and_later_epochs_start_with_the_workers() -> None:
    dataset = Busy()
    loader = auto_loader(dataset)
    first = batches(loader)
    chosen = loader.num_workers
    dataset.fetched.clear()
    second = batches(loader)
    assert loader.num_workers == chosen and len(second) == len(first) == N // BATCH
    assert dataset.fetched == []  # the second epoch never fetched in the main process
    assert sum(w.batches for w in loader.stats().workers) == N // BATCH


def test_persistent_workers_keep_the_iterator_that_moved() -> None:
    loader = auto_loader(Busy(), persistent_workers=True)
    iterator = iter(loader)
    first = [b.tolist() for b in iterator]
    pids = [w.pid for w in loader.stats().workers]
    again = iter(loader)
    assert again is iterator  # the first epoch's iterator, now running workers
    second = [b.tolist() for b in again]
    assert [w.pid for w in loader.stats().workers] == pids
    plain = fixed_loader(Busy(), 2, persistent_workers=True)  # one base seed for both epochs
    plain_first = batches(plain)
    assert first == plain_first and second == batches(plain)


def test_a_short_first_epoch_chooses_at_its_end() -> None:
    dataset = Busy(n=3 * BATCH)  # 3 batches: fewer than the head, under the probe budget
    loader = auto_loader(dataset)
    first = batches(loader)
    assert len(first) == 3 and len(dataset.fetched) == 3 * BATCH  # all inline
    assert isinstance(loader.num_workers, int)
    assert loader.stats().choice is not None and "median of 3" in loader.stats().choice
    fixed = fixed_loader(Busy(n=3 * BATCH), 0)
    assert first == batches(fixed)
    assert batches(loader) == batches(fixed)  # the next epoch, with the chosen workers


def test_a_short_first_epoch_chooses_at_its_last_batch() -> None:
    """A consumer that takes len(loader) batches and stops (Lightning's loops) never asks for
    the StopIteration; the choice is made when the last batch is handed out."""
    loader = auto_loader(Busy(n=3 * BATCH))
    iterator = iter(loader)
    first = [next(iterator).tolist() for _ in range(len(loader))]
    assert loader.stats().choice is not None and "median of 3" in loader.stats().choice
    del iterator
    assert first == batches(fixed_loader(Busy(n=3 * BATCH), 0))


def test_state_saved_in_the_head_and_after_the_move_resumes_exactly() -> None:
    expected = batches(fixed_loader(Busy(), 0))
    for taken in (2, auto.PROBE_BATCHES + 3):
        loader = auto_loader(Busy())
        iterator = iter(loader)
        seen = [next(iterator).tolist() for _ in range(taken)]
        state = loader.state_dict()
        assert (loader.stats().choice is None) == (taken < auto.PROBE_BATCHES)
        del iterator
        resumed = auto_loader(Busy())
        resumed.load_state_dict(state)
        assert seen + batches(resumed) == expected


def test_an_error_in_the_head_is_raised_at_its_batch_and_the_epoch_goes_on() -> None:
    order = batches(fixed_loader(Busy(), 0))
    bad = order[1][0][0]  # a sample of the second batch, fetched inline
    loader = auto_loader(Busy(fail_at=bad))
    iterator = iter(loader)
    got = [next(iterator).tolist()]
    with pytest.raises(OSError, match=f"sample {bad} is unreadable"):
        next(iterator)
    got += [b.tolist() for b in iterator]
    assert got == order[:1] + order[2:]
    assert isinstance(loader.num_workers, int) and loader.num_workers >= 1


def test_a_worker_killed_after_the_move_is_reported_at_its_batch() -> None:
    order = batches(fixed_loader(Busy(), 0))
    victim_batch = auto.PROBE_BATCHES + 4
    loader = auto_loader(Busy(kill_at=order[victim_batch][0][0]), multiprocessing_context="fork")
    iterator = iter(loader)
    got = []
    with pytest.raises(WorkerDiedError) as raised:
        for batch in iterator:
            got.append(batch.tolist())
    assert got == order[:victim_batch]  # every batch before it was delivered
    assert raised.value.batch == victim_batch


def test_a_killed_worker_is_restarted_after_the_move(tmp_path) -> None:
    order = batches(fixed_loader(Busy(), 0))
    victim = order[auto.PROBE_BATCHES + 2][0][0]
    loader = auto_loader(
        Busy(kill_at=victim, kill_once=str(tmp_path / "killed")), multiprocessing_context="fork", max_worker_restarts=1
    )
    with pytest.warns(stoker.WorkerRestartWarning):
        got = batches(loader)
    assert got == order


@pytest.mark.parametrize("where", ["head", "workers"])
def test_dropping_the_iterator_stops_everything(where: str) -> None:
    loader = auto_loader(Busy(), multiprocessing_context="spawn")
    iterator = iter(loader)
    for _ in range(2 if where == "head" else auto.PROBE_BATCHES + 2):
        next(iterator)
    del iterator  # the leak check (conftest) sees no process, thread, fd or /dev/shm left


def test_stats_off_still_chooses() -> None:
    loader = auto_loader(Busy(), stats=False)
    got = batches(loader)
    assert got == batches(fixed_loader(Busy(), 0))
    assert isinstance(loader.num_workers, int) and loader.num_workers >= 1
