"""How `stoker-bench` times one run: an epoch's steady-state window, its samples/s and the main
process's CPU per batch (`_epoch_rate`), the arena over the window, the stats-on/off pairs,
W5's time to the first batch (the torch-free case in a fresh process) and W6's epoch boundary."""

from __future__ import annotations

import gc
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stoker._core.stats import array_bytes

from .workloads import Sizes


@dataclass
class EpochTiming:
    """One epoch of a fresh loader: the steady-state figures (None when the epoch is too short
    for a window, see `steady_window`) and the same figures from iter() to the end."""

    steady: float | None  # samples/s over the window
    whole: float  # samples/s from iter() to the last batch, start-up included
    main_us: float | None  # main process CPU µs per batch over the window
    whole_main_us: float  # main process CPU µs per batch from iter() to the last batch
    first_s: float = 0.0  # from iter() to the first batch: start-up (and the "auto" probe)
    chosen: Chosen | None = None  # what a loader made with num_workers="auto" chose
    arena: ArenaUse | None = None  # with `arena=True`: the shared-memory arena over the window


@dataclass(frozen=True)
class ArenaUse:
    """A stoker loader's shared-memory arena over an epoch's steady-state window: the most
    bytes its slots held (`Arena.reserved_bytes`, read at each batch's arrival), the largest
    batch's array bytes (`array_bytes`), and the prefetch window (prefetch_factor x workers)."""

    arena_bytes: int
    batch_bytes: int
    window: int

    @property
    def batches(self) -> float:
        """The arena in batches."""
        return self.arena_bytes / self.batch_bytes if self.batch_bytes else float("nan")

    @property
    def limit(self) -> int:
        """The issue's bound in batches: the prefetch window + 2."""
        return self.window + 2


def arena_bytes(loader: Any) -> int:
    """Bytes of the shared-memory slots a stoker loader's arena holds now (0 before it has one)."""
    arena = getattr(loader, "_arena", None)  # kept by the loader across epochs (`_shared_memory`)
    return 0 if arena is None else int(arena.reserved_bytes())


@dataclass(frozen=True)
class Chosen:
    """What `num_workers="auto", prefetch_factor="auto"` chose, read from the loader after its
    first epoch."""

    num_workers: int
    prefetch_factor: int | None
    choice: str  # the loader's own words (`loader.stats().choice`)


def _chosen(loader: Any) -> Chosen:
    stats = loader.stats()
    workers = loader.num_workers if isinstance(loader.num_workers, int) else stats.num_workers
    prefetch = stats.prefetch_factor if isinstance(stats.prefetch_factor, int) else None
    return Chosen(workers, prefetch, stats.choice or "(the loader stated no choice)")


def _epoch_rate(
    make: Callable[[], Any], workers: int | None, prefetch: int | None = 2, arena: bool = False
) -> EpochTiming:
    """Rates and main-process CPU per batch of one epoch of a fresh loader.

    At every batch's arrival the wall clock (`perf_counter`) and the main process's CPU time
    (`process_time`: all of its threads, not its children) are read together. The steady-state
    figures come from the middle of the epoch (see `steady_window`, whose margin follows the
    loader's `prefetch`); the whole-epoch ones include worker start-up, which is what W5
    measures.

    `workers=None`: the loader was made with `num_workers="auto", prefetch_factor="auto"`; its
    choice (probe included) happens inside the timed epoch, and is read from the loader after
    it (`Chosen`), and the window follows the chosen workers and prefetch.

    `arena=True` (a stoker loader with process workers): after the clocks, each arrival also
    reads the arena's reserved bytes and the batch's array bytes (a few µs per batch), for
    `ArenaUse` over the window.
    """
    loader = make()
    arrivals: list[float] = []
    cpu: list[float] = []
    sizes: list[int] = []
    held: list[int] = []
    batch_bytes = 0
    cpu_start, start = time.process_time(), time.perf_counter()
    for batch in loader:
        arrivals.append(time.perf_counter())
        cpu.append(time.process_time())
        sizes.append(_batch_len(batch))
        if arena:
            held.append(arena_bytes(loader))
            batch_bytes = max(batch_bytes, array_bytes(batch))
        # dropped before waiting for the next one, so that the loader can reuse its memory
        del batch
    chosen = None
    if workers is None:
        chosen = _chosen(loader)
        workers, prefetch = chosen.num_workers, chosen.prefetch_factor
    del loader
    gc.collect()
    window = steady_window(len(arrivals), workers, 2 if prefetch is None else prefetch)
    use = None
    if arena and held:
        first, last = window if window is not None else (0, len(held) - 1)
        in_flight = (2 if prefetch is None else prefetch) * max(1, workers)
        use = ArenaUse(max(held[first : last + 1]), batch_bytes, in_flight)
    return EpochTiming(
        steady=None if window is None else window_rate(arrivals, sizes, window),
        whole=sum(sizes) / (arrivals[-1] - start),
        main_us=None if window is None else us_per_batch(cpu, window),
        whole_main_us=(cpu[-1] - cpu_start) / len(cpu) * 1e6,
        first_s=arrivals[0] - start,
        chosen=chosen,
        arena=use,
    )


@dataclass(frozen=True)
class StatsPair:
    """Two W1 epochs back to back, the same loader but for `stats=True` / `stats=False`."""

    on: EpochTiming
    off: EpochTiming
    on_first: bool


def _stats_pair(make: Callable[[bool], Any], workers: int, on_first: bool) -> StatsPair:
    """One pair: an epoch of `make(stats)` for stats on and off, in the order `on_first` says."""
    timings = {}
    for stats in (True, False) if on_first else (False, True):

        def make_one(stats: bool = stats) -> Any:
            return make(stats)

        timings[stats] = _epoch_rate(make_one, workers)
    return StatsPair(on=timings[True], off=timings[False], on_first=on_first)


def pairs_per_rep(sizes: Sizes, reps: int) -> int:
    """Stats pairs in each repetition: at least `sizes.stats_pairs` in all, the same number in
    every repetition (6 pairs with the default 5 and 3 repetitions)."""
    return -(-sizes.stats_pairs // reps)


def pair_overhead(on: list[float], off: list[float]) -> float:
    """What stats=True costs: the median over pairs of `off / on - 1` (0.01: stats on is 1 %
    slower), where `on[i]` and `off[i]` (samples/s) are the two epochs of pair i. The median of
    per-pair ratios, not the ratio of medians, so that a slow patch of the machine that hits one
    pair moves one ratio, not both medians.

    Raises ValueError when the lists are empty or of different lengths.
    """
    if not on or len(on) != len(off):
        raise ValueError(f"pairs need as many stats-on as stats-off epochs, got {len(on)} and {len(off)}")
    return statistics.median(b / a - 1 for a, b in zip(on, off))


def steady_window(n: int, workers: int, prefetch: int = 2) -> tuple[int, int] | None:
    """(first, last): the two batch arrivals, out of `n`, that bound an epoch's steady state.

    Timing from the first batch's arrival would count batches the workers prefetched while
    the first one was on its way as if they came free, and timing from the start would count
    worker start-up. Leaving out `prefetch * workers + 1` batches (what the loader keeps in
    flight, plus one) or a tenth of the epoch, whichever is more, at each end avoids both;
    spanning a multiple of `workers` batches keeps the window in phase with workers that
    finish their batches together. None when the window would span fewer than `4 * workers`
    batches.
    """
    step = max(1, workers)
    margin = max(prefetch * step + 1, n // 10)
    first, last = margin, n - 1 - margin
    last -= (last - first) % step
    if last - first < 4 * step:
        return None
    return first, last


def window_rate(arrivals: list[float], sizes: list[int], window: tuple[int, int]) -> float:
    """Samples/s of the batches that arrived after `window[0]`, up to and including `window[1]`."""
    first, last = window
    return sum(sizes[first + 1 : last + 1]) / (arrivals[last] - arrivals[first])


def us_per_batch(clock: list[float], window: tuple[int, int]) -> float:
    """µs of `clock` (seconds, read at each batch's arrival) per batch over `window`."""
    first, last = window
    return (clock[last] - clock[first]) / (last - first) * 1e6


def steady_rate(arrivals: list[float], sizes: list[int], workers: int, prefetch: int = 2) -> float | None:
    """Samples/s over the steady-state window of an epoch (see `steady_window`), or None."""
    window = steady_window(len(arrivals), workers, prefetch)
    return None if window is None else window_rate(arrivals, sizes, window)


def _batch_len(batch: Any) -> int:
    """Samples in a batch: the length of its first leaf (W7's batches are [images, labels])."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    elif isinstance(batch, (list, tuple)):
        batch = batch[0]
    return len(batch)


def _first_batch_s(make: Callable[[], Any]) -> float:
    loader = make()
    start = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    took = time.perf_counter() - start
    del iterator, loader
    gc.collect()
    return took


W5_METHODS = ("fork", "spawn", "forkserver")
TORCH_FREE = "torch-free"  # W5's variant: a fresh process that imports stoker and numpy, never torch
TORCH_FREE_MAX_S = 0.3  # its time to the first batch under spawn and forkserver, at most
W5_VS_TORCH = 0.25  # stoker.torch's time to the first batch (largest dataset) over torch's, at most
# The torch-free case's subprocess: stoker and numpy only (the dataset is stoker's own
# ArrayDataset, so that spawn and forkserver workers import nothing else to rebuild it).
_TORCH_FREE_CODE = """
import sys, time
started = time.perf_counter()
import json
import numpy as np
import stoker
imported = time.perf_counter()
method, mb, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = np.random.default_rng(0).integers(0, 255, mb << 20, dtype=np.uint8).reshape(-1, 64)
loader = stoker.DataLoader(
    stoker.ArrayDataset(rows), batch_size=4, num_workers=workers, multiprocessing_context=method
)
start = time.perf_counter()
iterator = iter(loader)
next(iterator)
took = time.perf_counter() - start
torch_imported = "torch" in sys.modules
del iterator, loader
print(json.dumps({"first_batch_s": took, "torch_imported": torch_imported,
                  "import_s": imported - started, "make_s": start - imported}), flush=True)
"""


def w5_methods() -> tuple[str, ...]:
    """W5's start methods that this platform has (forkserver and fork are POSIX only)."""
    import multiprocessing

    available = multiprocessing.get_all_start_methods()
    return tuple(m for m in W5_METHODS if m in available)


def torch_free_first_batch(method: str, mb: int, workers: int = 2) -> dict[str, Any]:
    """W5's torch-free case: a fresh Python (this interpreter, `-c`, the environment as found)
    imports numpy and stoker only, makes a `stoker.ArrayDataset` over `mb` MB of uint8 (rows of
    64 bytes, like `HoldsArray`'s samples) and `stoker.DataLoader(batch_size=4,
    num_workers=workers, multiprocessing_context=method)`, and times `iter()` and the first
    `next()` with `perf_counter`. Returns the subprocess's JSON: `first_batch_s`,
    `torch_imported` ("torch" in sys.modules after the first batch), `import_s` (numpy and
    stoker) and `make_s` (the array and the loader)."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _TORCH_FREE_CODE, method, str(mb), str(workers)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"W5 torch-free {method}: the subprocess failed ({done.returncode}): {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _epoch_boundary(make: Callable[[int], Any], samples: int, epochs: int, batch_size: int) -> dict[str, float]:
    """What an epoch boundary costs with persistent workers, two ways, in seconds.

    cost_s / batch_s: `epochs` epochs of `samples` are timed against one epoch of
    `epochs * samples` from the same kind of loader; the difference spread over the
    `epochs - 1` boundaries is what a boundary costs in throughput, against the long epoch's
    time per batch.
    gap_s / median_gap_s: in the same timed epochs, the median time from the last batch of
    epoch k to the first batch of epoch k+1 (max in max_gap_s), against the median time
    between consecutive batches within an epoch.
    Both loaders first run two epochs untimed, so that neither pays for its start-up or for
    its shared-memory arena growing to its working size (a one-time cost). The two are timed
    alternately, best of three.
    """

    def epochs_of(loader: Any, rounds: int) -> tuple[float, list[list[float]]]:
        arrivals: list[list[float]] = []
        start = time.perf_counter()
        for _ in range(rounds):
            mine: list[float] = []
            for batch in loader:
                _batch_len(batch)
                mine.append(time.perf_counter())
                del batch
            arrivals.append(mine)
        return time.perf_counter() - start, arrivals

    split, whole = make(samples), make(samples * epochs)
    epochs_of(split, 2)
    epochs_of(whole, 2)
    several, once = float("inf"), float("inf")
    gaps: list[float] = []
    within: list[float] = []
    for _ in range(3):
        took, arrivals = epochs_of(split, epochs)
        several = min(several, took)
        for previous, current in itertools.pairwise(arrivals):
            gaps.append(current[0] - previous[-1])
        for mine in arrivals:
            within.extend(b - a for a, b in itertools.pairwise(mine))
        once = min(once, epochs_of(whole, 1)[0])
    del split, whole
    gc.collect()
    batches = epochs * samples // batch_size
    return {
        "cost_s": (several - once) / (epochs - 1),
        "batch_s": once / batches,
        "gap_s": statistics.median(gaps),
        "max_gap_s": max(gaps),
        "median_gap_s": statistics.median(within),
    }
