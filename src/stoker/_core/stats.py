"""Live statistics of a loader iterator: `LoaderStats`, and how the figures are gathered.

Each worker times its own work and sends the figures with the batch they describe (the
`work` field of `protocol.Done`), so statistics cost no message of their own:

    worker:  Done(task_id, payload, work=(samples, bytes, fetch_s, collate_s, busy_s))
    main:    received → that worker's busy/fetch/collate/batches
             handed to the consumer → batches, samples, bytes
             time inside iter() and next() → wait_s

`busy_s` of a reply covers its fetch and collate plus the sending of the worker's previous
reply (a reply cannot carry the time it takes to send itself), and the time of tasks that
failed, so over a run it adds up to the time the worker was not idle.

`DataLoader(progress=True)` draws these figures as one tqdm bar per epoch (`EpochBar`), in
the main process only. tqdm is optional (`pip install stoker[progress]`); the loader calls
`require_tqdm()` when it is made, so a missing tqdm is an error at construction, not in the
middle of a run.
"""

from __future__ import annotations

import importlib
import sys
import time
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

import numpy as np

Work = tuple[int, int, float, float, float]
"""What a worker reports with a batch: (samples, array bytes, fetch_s, collate_s, busy_s)."""

clock = time.perf_counter


@dataclass(frozen=True)
class WorkerStats:
    """One worker's figures since the iterator's epoch began (with `num_workers=0`: the
    main process, which fetches inline).

    The loader makes it; `LoaderStats.workers` holds one per worker.

    Args:
        worker: The worker's number.
        pid: The worker's process id; None for a thread worker (or the main process).
        batches: The batches it made (received by the main process).
        busy_s: Seconds it spent fetching, collating and sending.
        fetch_s: Seconds in the dataset (`__getitem__`, `__getitems__` or the replica's
            iterator).
        collate_s: Seconds in the collate_fn.
        restarts: The times it was replaced after dying (`max_worker_restarts`).
    """

    worker: int
    pid: int | None  # None: a thread worker
    batches: int  # batches it made (received by the main process)
    busy_s: float  # time it spent fetching, collating and sending
    fetch_s: float  # time in the dataset (`__getitem__` / `__getitems__` / the replica's iterator)
    collate_s: float  # time in the collate_fn
    restarts: int  # times it was replaced after dying (max_worker_restarts)


@dataclass(frozen=True)
class LoaderStats:
    """A loader iterator's figures for the epoch it is delivering, since the `iter()` that
    began it.

    `readiness` is 1 - wait_s / elapsed_s: the share of the time the consumer did not wait
    for the loader (1.0: it never waited; low: the loader is the bottleneck).

    The loader makes it: `DataLoader.stats()` (or the iterator's `stats()`) returns one.
    `str()` gives a one-line summary; `as_dict()` plain values for logging.

    Args:
        epoch: The loader's epoch number.
        batches: The batches handed to the consumer.
        samples: The samples in those batches.
        bytes: The bytes of the numpy arrays and tensors in those batches.
        elapsed_s: Seconds since `iter()`; frozen when the epoch ends or the iterator
            stops.
        wait_s: Seconds the consumer spent inside `iter()` and `next()`.
        readiness: 1 - wait_s / elapsed_s.
        ready: The batches that have arrived and are not handed out yet.
        workers: One `WorkerStats` per worker (the main process's with num_workers=0).
        num_workers: The loader's number of workers.
        prefetch_factor: The loader's prefetch factor (None with num_workers=0).
        thread_pool: Whether the workers are threads rather than processes.
        choice: What `num_workers="auto"` or `prefetch_factor="auto"` chose, and why;
            None when neither was asked for. Defaults to None.
    """

    epoch: int  # the loader's epoch number
    batches: int  # batches handed to the consumer
    samples: int  # samples in those batches
    bytes: int  # bytes of the numpy arrays / tensors in those batches
    elapsed_s: float  # since iter(); frozen when the epoch ends or the iterator stops
    wait_s: float  # time the consumer spent inside iter() and next()
    readiness: float
    ready: int  # batches that have arrived and are not handed out yet
    workers: tuple[WorkerStats, ...]
    num_workers: int
    prefetch_factor: int | None
    thread_pool: bool
    choice: str | None = None  # what num_workers="auto" / prefetch_factor="auto" chose, and why

    @property
    def samples_per_s(self) -> float:
        """Samples handed to the consumer per second of elapsed time."""
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Array bytes handed to the consumer per second of elapsed time."""
        return self.bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def workers_busy(self) -> float:
        """The workers' mean busy time as a share of the elapsed time."""
        if not self.workers or self.elapsed_s <= 0:
            return 0.0
        return sum(w.busy_s for w in self.workers) / (len(self.workers) * self.elapsed_s)

    def as_dict(self) -> dict[str, Any]:
        """Plain values for logging (JSON-serialisable), with the derived rates.

        Returns:
            The fields as a dict, `workers` as a list of dicts, plus `samples_per_s`,
            `bytes_per_s` and `workers_busy`.
        """
        out = asdict(self)
        out["workers"] = [asdict(w) for w in self.workers]
        out["samples_per_s"] = self.samples_per_s
        out["bytes_per_s"] = self.bytes_per_s
        out["workers_busy"] = self.workers_busy
        return out

    def __str__(self) -> str:
        fetch = sum(w.fetch_s for w in self.workers)
        collate = sum(w.collate_s for w in self.workers)
        busy = sum(w.busy_s for w in self.workers)
        split = f" (fetch {fetch / busy:.0%}, collate {collate / busy:.0%})" if busy > 0 else ""
        restarts = sum(w.restarts for w in self.workers)
        who = (
            "main process"
            if self.num_workers == 0
            else (f"{self.num_workers} {'thread' if self.thread_pool else 'process'} workers")
        )
        return (
            f"epoch {self.epoch}: {self.batches} batches, {self.samples} samples "
            f"({self.samples_per_s:,.0f}/s, {_size(self.bytes_per_s)}/s) in {self.elapsed_s:.2f} s; "
            f"readiness {self.readiness:.2f} (waited {self.wait_s:.2f} s); {self.ready} ready; "
            f"{who} busy {self.workers_busy:.0%}{split}" + (f"; {restarts} restarts" if restarts else "")
        )


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class Recorder:
    """The main process's running totals for one epoch of one iterator."""

    __slots__ = (
        "batches",
        "busy",
        "bytes",
        "choice",
        "collate",
        "ending",
        "epoch",
        "fetch",
        "made",
        "num_workers",
        "pids",
        "prefetch_factor",
        "restarts",
        "samples",
        "start",
        "stopped",
        "thread_pool",
        "wait_s",
    )

    def __init__(
        self,
        epoch: int,
        num_workers: int,
        prefetch_factor: int | None,
        thread_pool: bool,
        pids: list[int | None],
        choice: str | None = None,
    ) -> None:
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.thread_pool = thread_pool
        self.choice = choice
        self.begin(epoch, clock(), pids)

    def begin(self, epoch: int, start: float, pids: list[int | None]) -> None:
        """Count a new epoch from `start` (the consumer's `iter()`), with these workers."""
        self.epoch = epoch
        self.start = start
        self.stopped: float | None = None
        self.ending = False  # the epoch ended: the clock stops when the current next() returns
        self.wait_s = 0.0
        self.batches = 0
        self.samples = 0
        self.bytes = 0
        self._reset_workers(pids)

    def workers_changed(self, num_workers: int, prefetch_factor: int | None, pids: list[int | None]) -> None:
        """num_workers="auto" moved the epoch to these workers: the epoch's totals go on, the
        per-worker figures count from now."""
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self._reset_workers(pids)

    def _reset_workers(self, pids: list[int | None]) -> None:
        n = max(self.num_workers, 1)
        self.made = [0] * n
        self.busy = [0.0] * n
        self.fetch = [0.0] * n
        self.collate = [0.0] * n
        self.restarts = [0] * n
        self.pids = pids

    def received(self, worker_id: int, work: Work) -> None:
        """A worker's batch arrived."""
        self.made[worker_id] += 1
        self.busy[worker_id] += work[4]
        self.fetch[worker_id] += work[2]
        self.collate[worker_id] += work[3]

    def delivered(self, work: Work) -> None:
        """A batch was handed to the consumer."""
        self.batches += 1
        self.samples += work[0]
        self.bytes += work[1]

    def leave_next(self, entered: float) -> None:
        """The consumer's next() call that began at `entered` returns."""
        now = clock()
        self.wait_s += now - entered
        if self.ending and self.stopped is None:
            self.stopped = now

    def stop(self) -> None:
        """The epoch ended or the iterator stopped: elapsed time no longer grows."""
        if self.stopped is None:
            self.stopped = clock()

    def snapshot(self, ready: int) -> LoaderStats:
        end = self.stopped if self.stopped is not None else clock()
        elapsed = max(end - self.start, 0.0)
        wait = min(self.wait_s, elapsed)
        workers = tuple(
            WorkerStats(
                worker=i,
                pid=self.pids[i] if i < len(self.pids) else None,
                batches=self.made[i],
                busy_s=self.busy[i],
                fetch_s=self.fetch[i],
                collate_s=self.collate[i],
                restarts=self.restarts[i],
            )
            for i in range(len(self.made))
        )
        return LoaderStats(
            epoch=self.epoch,
            batches=self.batches,
            samples=self.samples,
            bytes=self.bytes,
            elapsed_s=elapsed,
            wait_s=wait,
            readiness=1.0 - wait / elapsed if elapsed > 0 else 1.0,
            ready=ready,
            workers=workers,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            thread_pool=self.thread_pool,
            choice=self.choice,
        )


# ------------------------------------------------------------- progress bar
REFRESH_S = 0.5  # how often the bar's samples/s and readiness are recomputed


def require_tqdm() -> Any:
    """The tqdm module, or an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module("tqdm")
    except ImportError as exc:
        raise ImportError(
            "DataLoader(progress=True) draws its bar with tqdm, which is not installed; "
            "install it with: pip install 'stoker[progress]' (or pip install tqdm)"
        ) from exc


_BARS: dict[type, type] = {}


def _bar_class(tqdm: Any) -> Any:
    """tqdm's bar class without its monitor thread. tqdm starts one with the first bar and
    keeps it for the rest of the process; a loader's next epoch would fork its workers while
    it runs (on Python 3.12+, a DeprecationWarning at each fork). The monitor only refreshes
    bars whose dynamic `miniters` skip updates; ours updates with `miniters=1`."""
    base = tqdm.tqdm
    if base not in _BARS:
        _BARS[base] = type("EpochTqdm", (base,), {"monitor_interval": 0})
    return _BARS[base]


class EpochBar:
    """A bar over one epoch's batches, with samples/s and readiness from the iterator's
    statistics."""

    def __init__(self, total: int | None, epoch: int) -> None:
        bar = _bar_class(require_tqdm())
        self._bar = bar(total=total, desc=f"epoch {epoch}", unit="batch", dynamic_ncols=True, miniters=1)
        self._next_refresh = clock() + REFRESH_S

    def advance(self, recorder: Recorder | None) -> None:
        """One batch was handed out."""
        self._bar.update(1)
        if recorder is not None and clock() >= self._next_refresh:
            self._next_refresh = clock() + REFRESH_S
            self._bar.set_postfix_str(_figures(recorder), refresh=False)

    def close(self, recorder: Recorder | None) -> None:
        if recorder is not None:
            self._bar.set_postfix_str(_figures(recorder), refresh=False)
        self._bar.close()


def _figures(recorder: Recorder) -> str:
    stats = recorder.snapshot(ready=0)
    return f"{stats.samples_per_s:,.0f} samples/s, readiness {stats.readiness:.2f}"


# ------------------------------------------------------------- array bytes
def _zero(obj: Any) -> int:
    return 0


def _nbytes(obj: Any) -> int:
    return int(obj.nbytes)


def _mapping(obj: Any) -> int:
    return sum([array_bytes(v) for v in obj.values()])


def _sequence(obj: Any) -> int:
    return sum([array_bytes(v) for v in obj])


def _dataclass(obj: Any) -> int:
    return sum([array_bytes(getattr(obj, f.name)) for f in fields(obj)])


_HANDLERS: dict[type, Any] = {
    np.ndarray: _nbytes,
    dict: _mapping,
    list: _sequence,
    tuple: _sequence,
    int: _zero,
    float: _zero,
    str: _zero,
    bytes: _zero,
    bool: _zero,
    type(None): _zero,
}


def _handler(kind: type) -> Any:
    torch = sys.modules.get("torch")
    if issubclass(kind, np.ndarray) or (torch is not None and issubclass(kind, torch.Tensor)):
        return _nbytes
    if issubclass(kind, (str, bytes, bytearray, memoryview, np.generic)):
        return _zero
    if hasattr(kind, "items") and hasattr(kind, "values"):
        return _mapping
    if issubclass(kind, (list, tuple)):
        return _sequence
    if is_dataclass(kind):
        return _dataclass
    return _zero


def array_bytes(obj: Any) -> int:
    """Bytes of the numpy arrays and torch tensors in a batch (dicts, lists, tuples and
    dataclasses are walked; anything else counts 0)."""
    kind = type(obj)
    handler = _HANDLERS.get(kind)
    if handler is None:
        handler = _HANDLERS[kind] = _handler(kind)
    return int(handler(obj))
