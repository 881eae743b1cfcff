"""`num_workers="auto"` and `prefetch_factor="auto"`: one choice, made in the first epoch.

A map-style loader with `num_workers="auto"` starts its first epoch in the main process: the
first batches are fetched and collated inline, timed, and handed to the consumer like any
others (`Head`); then the choice is made and the rest of the epoch goes to the chosen
workers (or stays inline). Nothing is fetched twice and nothing is thrown away. When the
epoch ends first (a short epoch), the choice is made then and the next epoch uses it. With a
given worker count and only `prefetch_factor="auto"`, or an IterableDataset, the choice is
made at the first `iter()` instead (`choose`): a few probe batches are fetched in the main
process on a shallow copy of the dataset, with the global RNGs put back afterwards.

The choice predicts the batches per second of each worker count from three figures:

    t_b   a batch's fetch + collate time (median of the probes, the first left out)
    c_m   the main process's CPU per batch when workers make them (receiving, building the
          views, the scheduler, the consumer's loop): MAIN_COST_S measured on the
          development machine, scaled by this machine's speed on a fixed Python loop
    U     usable CPUs (the affinity mask)

    t_w   a worker's time per batch: t_b (1 + WORKER_OVERHEAD) + bytes x WORKER_BYTE_S
          (encoding and messages; writing a batch into shared memory from another process
          cost 5x the inline collate's time per byte for 10 MB image batches measured on
          the development machine)

    rate(0) = 1 / t_b                          the main process fetches inline
    rate(n) = min(1 / c_m,                     the main process's own limit
                  n / t_w,
                  U / (t_w + c_m))             all processes share U CPUs

Workers are chosen only when they are predicted to beat inline fetching by MIN_GAIN
(they cost memory and start-up time), and then the fewest that come within 5 % of the
best prediction, capped by the memory available for their batches in flight. The
prefetch factor covers the spread of the probe times (2 when batches take the same time,
up to 8 when some take several times the median), within 5 % of available memory.

An IterableDataset is not probed (its stream is not sampled outside its workers): it
gets min(U - 1, 8) workers (at least 1): the count "auto" assumes before it has measured
anything (`start_workers`).

What the loader's attributes read: `num_workers` and `prefetch_factor` are ints (`Auto`) at all
times, as torch's are, because frameworks and torch's own checks compare them and pass them on.
Until the choice they read the counts assumed before measuring (`start_workers`, and prefetch
2, torch's default), also while a map-style head runs inline: a count of at least 1 keeps them
a set torch's constructor accepts beside `persistent_workers=True`, a `multiprocessing_context`
or a given `prefetch_factor`. After it they read the counts chosen. An `Auto` remembers that
it came from "auto": a DataLoader given one asks for "auto" again, so a loader re-created
from another's attributes (Lightning injecting its sampler, accelerate's rebuild around a
shard) makes its own choice instead of taking the provisional count for a given one.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .fetch import MapFetcher
from .protocol import ReplicaBatch
from .seeding import restore_globals, seed_main_globals
from .stats import Work, array_bytes

if TYPE_CHECKING:
    from .arena import Arena

PROBE_BUDGET_S = 0.2  # probing stops after this much fetch time (at least one batch is probed)
PROBE_BATCHES = 4  # the first is left out of the median (cold caches) ...
PROBE_MIN_S = 0.02  # ... and cheap batches are timed until they add up to this
PROBE_MAX_BATCHES = 32
MAIN_COST_S = 250e-6  # c_m on the development machine, where SPEED_LOOP took REFERENCE_LOOP_S
REFERENCE_LOOP_S = 0.7e-3
WORKER_OVERHEAD = 0.25  # a worker's extra cost per batch over inline: encoding, messages
WORKER_BYTE_S = 0.5e-9  # and per byte of the batch's arrays
MIN_GAIN = 1.25  # workers must beat inline fetching by this factor to be chosen
NEAR_BEST = 0.95
MAX_PREFETCH = 8
PROBE_SIZE = 32  # samples per probe batch when the loader has no batch_size
ITERABLE_MAX_WORKERS = 8
START_PREFETCH = 2  # prefetch_factor="auto" before the choice (torch's default), and for a stream


class Auto(int):
    """A count that "auto" gave (`num_workers`, `prefetch_factor`): an int to whatever reads it
    (comparisons, arithmetic, `isinstance(value, int)`, JSON), and "auto" to a DataLoader it is
    given to."""

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)


def start_workers(cpus: int) -> int:
    """The worker count "auto" assumes before anything is measured (and gives an
    IterableDataset): one less than the usable CPUs, at least 1, at most 8."""
    return min(max(cpus - 1, 1), ITERABLE_MAX_WORKERS)


@dataclass(frozen=True)
class Choice:
    """What "auto" chose, and the evidence as one line (`LoaderStats.choice`)."""

    num_workers: int
    prefetch_factor: int | None
    reason: str


@functools.cache
def speed_loop() -> float:
    """Seconds this machine takes for a fixed piece of Python work (best of 3; measured once
    per process, in about 2 ms)."""
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        table: dict[int, tuple[int, str]] = {}
        for i in range(5_000):
            table[i & 255] = (i, str(i))
        best = min(best, time.perf_counter() - start)
    return best


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def predicted_rate(workers: int, batch_s: float, main_s: float, cpus: int, nbytes: int = 0) -> float:
    """Batches per second the model predicts for `workers` (0: inline)."""
    if workers == 0:
        return 1.0 / batch_s
    worker_s = batch_s * (1 + WORKER_OVERHEAD) + nbytes * WORKER_BYTE_S
    return min(1.0 / main_s, workers / worker_s, cpus / (worker_s + main_s))


def choose_workers(batch_s: float, main_s: float, cpus: int, cap: int, nbytes: int = 0) -> tuple[int, float, float]:
    """(workers, predicted rate, inline rate) for a batch's cost and bytes, the main
    process's cost and the CPUs."""
    inline = predicted_rate(0, batch_s, main_s, cpus)
    rates = {n: predicted_rate(n, batch_s, main_s, cpus, nbytes) for n in range(1, max(cap, 0) + 1)}
    if not rates or max(rates.values()) < MIN_GAIN * inline:
        return 0, inline, inline
    best = max(rates.values())
    workers = min(n for n, rate in rates.items() if rate >= NEAR_BEST * best)
    return workers, rates[workers], inline


def choose_prefetch(times: list[float], batch_bytes: int, workers: int, memory: int | None) -> int:
    """Enough batches in flight per worker to cover the slow probes, within 5 % of memory.
    The first probe is left out when there are others: it pays for cold caches and
    first-touch page faults that the loader's reused memory does not."""
    warm = times[1:] if len(times) > 2 else times
    median = statistics.median(warm)
    high = sorted(warm)[int(0.8 * (len(warm) - 1))]  # one slow outlier does not count
    spread = high / median if median > 0 else 1.0
    prefetch = min(MAX_PREFETCH, max(2, math.ceil(2 * spread)))
    if memory is not None and batch_bytes > 0 and workers > 0:
        prefetch = max(1, min(prefetch, int(0.05 * memory // (batch_bytes * workers))))
    return prefetch


def probe_indices(length: int, batch: int, count: int) -> list[list[int]]:
    """`count` batches of consecutive indices spread over the dataset."""
    if length <= 0:
        return []
    step = max(length // max(count, 1), 1)
    return [[(k * step + j) % length for j in range(min(batch, length))] for k in range(count)]


def probe(dataset: Any, collate_fn: Callable[[Any], Any], batch: int, auto_collation: bool) -> tuple[list[float], int]:
    """Fetch and collate probe batches in this process: (seconds per batch, bytes of one)."""
    try:
        length = len(dataset)
    except TypeError:
        return [], 0
    fetcher = MapFetcher(copy.copy(dataset), auto_collation, collate_fn)
    saved = seed_main_globals(0, 0, 0)
    times: list[float] = []
    nbytes = 0
    began = time.perf_counter()
    try:
        for index in probe_indices(length, batch, PROBE_BATCHES):
            start = time.perf_counter()
            made = fetcher.fetch(index if auto_collation else index[0])
            if isinstance(made, ReplicaBatch):  # a dataset that keeps a state: the batch alone
                made = made.batch
            times.append(time.perf_counter() - start)
            nbytes = max(nbytes, array_bytes(made))
            if time.perf_counter() - began > PROBE_BUDGET_S:
                break
    finally:
        restore_globals(saved)
    return times, nbytes


def choose(
    dataset: Any,
    *,
    iterable: bool,
    collate_fn: Callable[[Any], Any],
    auto_collation: bool,
    batch_size: int | None,
    cpus: int,
    workers: int | None,
    prefetch_factor: int | None,
    auto_prefetch: bool,
) -> Choice:
    """The loader's choice at its first `iter()`: `workers` None means num_workers="auto"
    (else the given count)."""
    if iterable:
        n = workers if workers is not None else start_workers(cpus)
        prefetch = START_PREFETCH if auto_prefetch else prefetch_factor
        reason = (
            f"num_workers={n}, prefetch_factor={prefetch if n else None} (auto: an IterableDataset "
            f"is not probed outside its workers; {cpus} usable CPUs)"
        )
        return Choice(n, prefetch if n else None, reason)
    batch = batch_size if batch_size is not None else (PROBE_SIZE if auto_collation else 1)
    try:
        times, nbytes = probe(dataset, collate_fn, batch, auto_collation)
    except Exception as exc:  # the real fetch reports it, at its batch
        n = workers if workers is not None else start_workers(cpus)
        reason = f"num_workers={n} (auto: probing a batch raised {type(exc).__name__}; {cpus} usable CPUs)"
        return Choice(n, (START_PREFETCH if auto_prefetch else prefetch_factor) if n else None, reason)
    return decide(
        times, nbytes, cpus=cpus, workers=workers, prefetch_factor=prefetch_factor, auto_prefetch=auto_prefetch
    )


def decide(
    times: list[float],
    nbytes: int,
    *,
    cpus: int,
    workers: int | None,
    prefetch_factor: int | None,
    auto_prefetch: bool,
    source: str = "",
) -> Choice:
    """The choice from measured batches: their fetch + collate seconds and the largest one's
    bytes. `workers` None means num_workers="auto" (else the given count); `source` says
    where the times come from, for the reason."""
    if not times:
        return Choice(0, None, "num_workers=0 (auto: the dataset is empty)")
    memory = available_memory()
    batch_s = max(statistics.median(times[1:] if len(times) > 2 else times), 1e-7)
    main_s = MAIN_COST_S * speed_loop() / REFERENCE_LOOP_S
    cap = cpus
    if memory is not None and nbytes > 0:
        cap = max(1, min(cap, int(0.25 * memory // (nbytes * 4))))  # 4 batches each, at most 1/4 of memory
    if workers is None:
        n, rate, inline = choose_workers(batch_s, main_s, cpus, cap, nbytes)
    else:
        n, rate, inline = workers, predicted_rate(workers, batch_s, main_s, cpus, nbytes), 1.0 / batch_s
    prefetch = choose_prefetch(times, nbytes, n, memory) if auto_prefetch else prefetch_factor
    if n == 0:
        prefetch = None
    why = (
        f"a batch takes {batch_s * 1e3:.2f} ms to fetch and collate here (median of {len(times)}"
        f"{source}, slowest {max(times) * 1e3:.2f} ms, {nbytes / 1e6:.1f} MB), the main process "
        f"~{main_s * 1e3:.2f} ms to receive one; "
        f"{cpus} usable CPUs: predicted {rate:,.0f} batches/s against {inline:,.0f} inline"
    )
    return Choice(n, prefetch, f"num_workers={n}, prefetch_factor={prefetch} (auto: {why})")


@dataclass(frozen=True)
class AutoStart:
    """A first epoch that starts inline and then moves to the workers "auto" chooses: what
    the iterator needs to make the choice and to start them."""

    cpus: int
    auto_prefetch: bool
    prefetch_factor: int | None  # as given, when not "auto"
    persistent: bool  # persistent_workers was asked for (it applies if workers are chosen)
    arena: Arena | None  # the loader's shared-memory arena, for process workers
    on_choice: Callable[[Choice, Any], None]  # tells the loader (with the iterator)


class Head:
    """The timed first batches of an "auto" epoch, fetched inline and delivered."""

    def __init__(self, start: AutoStart) -> None:
        self.start = start
        self.times: list[float] = []
        self.nbytes = 0

    def add(self, work: Work | None) -> None:
        """A delivered batch's timing (None: it raised, and says nothing of the cost)."""
        if work is not None:
            self.times.append(work[2] + work[3])
            self.nbytes = max(self.nbytes, work[1])

    def done(self) -> bool:
        """Enough is measured to choose."""
        count, total = len(self.times), sum(self.times)
        return (
            (count >= PROBE_BATCHES and total >= PROBE_MIN_S) or total >= PROBE_BUDGET_S or count >= PROBE_MAX_BATCHES
        )

    def decide(self) -> Choice:
        if not self.times:  # every batch raised (or the epoch was empty): nothing measured
            return Choice(0, None, "num_workers=0 (auto: the first epoch gave no batch to measure)")
        return decide(
            self.times,
            self.nbytes,
            cpus=self.start.cpus,
            workers=None,
            prefetch_factor=self.start.prefetch_factor,
            auto_prefetch=self.start.auto_prefetch,
            source=" first batches, fetched in the main process and delivered",
        )
