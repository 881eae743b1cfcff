"""`stoker bench`: standard synthetic workloads through stoker and torch.utils.data.

Every workload runs each loader (`stoker`, `stoker.torch`, and `torch.utils.data` when torch
is installed) at each number of workers, with repetitions interleaved (the repetition loop
is outermost) so that drifts of a noisy machine hit every loader alike. A run creates a
fresh DataLoader and goes through one epoch; its rate is the steady state in the middle of
the epoch (W5 measures start-up; the rate with start-up is kept in the JSON), and over the
same window the main process's CPU time per batch is recorded. Figures are medians with
min-max over the repetitions.

Two measurements of stoker against itself ride in the same repetitions: W1 in pairs of epochs
with `stats=True` and `stats=False` (what live statistics cost: the median over the pairs of
off/on - 1), and W1-W3 with `num_workers="auto", prefetch_factor="auto"` against the best
hand-picked number of workers (see benchmarks/README.md).

Nothing here sets OMP_NUM_THREADS or the like, or calls torch.set_num_threads: the loaders
are measured in the user's default environment, and the report records what it saw.

Workloads (the issue's names):
  W1 tiny dict samples      {"id": int, "x": 4 float32}, batch 256
  W2 images                 3x224x224 uint8, batch 64
  W3 CPU-heavy samples      ~2 ms of Python work each, batch 16
  W4 iterable stream        128 float32 per sample, sharded with get_worker_info(), batch 256
  W5 time to first batch    dataset holding a 10 MB / 200 MB array, fork, spawn and forkserver,
                            2 workers; and "torch-free": stoker alone (10 MB) in a fresh Python
                            process that never imports torch
  W6 epoch boundary         persistent workers, 2 workers: a boundary's gap and throughput cost
  W7 ImageNet-sized tensors random 224x224 crops + flips of 1000 3x256x256 uint8 images as
                            torch tensors, shuffled, batch 256 and 64, prefetch_factor=4
                            (stoker.torch and torch.utils.data only)
  W8 images, 1 GB           as W2, over 7,000 distinct images (1.05 GB), so that reads miss the
                            caches; GB/s against one-core and two-thread memcpy

W2 and W8 at 1 or more workers also record, for `stoker`, the shared-memory arena's reserved
bytes at each batch's arrival: their most over the steady-state window, in batches, against the
prefetch window + 2 (see benchmarks/README.md).
"""

from __future__ import annotations

import collections
import functools
import gc
import importlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np

import stoker
from stoker._core.loader import usable_cpus
from stoker._core.stats import array_bytes

IMAGE_SHAPE = (3, 224, 224)
IMAGE_BYTES = int(np.prod(IMAGE_SHAPE))


# ------------------------------------------------------------------ datasets
class TinyDicts:
    """W1: many tiny samples; per-sample and per-batch overhead dominate."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.x = np.random.default_rng(0).random((1024, 4), dtype=np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "x": self.x[i % 1024]}


DISTINCT_IMAGES = 256


class Images:
    """W2/W6: 3x224x224 uint8 images; bandwidth dominates."""

    def __init__(self, n: int, images: np.ndarray | None = None) -> None:
        self.n = n
        # 256 distinct images (38 MB) so that reads come from memory, not from the CPU's
        # caches, as they do for the memcpy ceiling they are compared against.
        if images is None:
            images = np.random.default_rng(0).integers(0, 255, (DISTINCT_IMAGES, *IMAGE_SHAPE), dtype=np.uint8)
        self.images = images

    def resized(self, n: int) -> Images:
        """The same images, `n` samples long."""
        return Images(n, self.images)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return self.images[i % DISTINCT_IMAGES]


class LargeImages:
    """W8: W2's images, every sample its own memory: sample i is image `i % len(images)`, so an
    epoch of `len(images)` samples reads each image once, in order, and the whole set (1.05 GB
    at 7,000 images) is far larger than any cache."""

    def __init__(self, images: np.ndarray, n: int | None = None) -> None:
        self.images = images
        self.n = len(images) if n is None else n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return self.images[i % len(self.images)]


def w8_images(n: int) -> np.ndarray:
    """W8's `n` distinct 3x224x224 uint8 images, made once per run: 256 images from a seeded RNG,
    repeated with 1 added (mod 256) to every byte at each repetition, so that no two images are
    equal and each is its own memory, written at memory speed rather than at the RNG's."""
    base = np.random.default_rng(8).integers(0, 256, (DISTINCT_IMAGES, *IMAGE_SHAPE), dtype=np.uint8)
    images = np.empty((n, *IMAGE_SHAPE), np.uint8)
    for k, start in enumerate(range(0, n, DISTINCT_IMAGES)):
        stop = min(n, start + DISTINCT_IMAGES)
        np.add(base[: stop - start], np.uint8(k % 256), out=images[start:stop])
    return images


def w8_samples(sizes: Sizes, workers: int) -> int:
    """W8's epoch: every image once, and more (W2's rule, `w2_samples`) only when many workers
    need a longer epoch for a steady-state window (more than 12 at the default size)."""
    return max(sizes.w8_images, 64 * (32 + 16 * workers))


def w2_samples(sizes: Sizes, workers: int) -> int:
    """W2's epoch: at least `sizes.w2` images, and long enough for a steady-state window at
    many workers (the same rule in batches as W7's, `w7_batches`, with the default prefetch)."""
    return max(sizes.w2, 64 * (32 + 16 * workers))


def _busy(rounds: int) -> int:
    total = 0
    for i in range(rounds):
        total += i * i % 7
    return total


def calibrate_busy(target_s: float = 0.002) -> int:
    """Rounds of `_busy` that take about `target_s` on this machine."""
    rounds = 10_000
    while True:
        start = time.perf_counter()
        _busy(rounds)
        took = time.perf_counter() - start
        if took > 0.02:
            return max(1, int(rounds * target_s / took))
        rounds *= 2


class CpuHeavy:
    """W3: each sample costs ~2 ms of Python work; workers should scale with cores."""

    def __init__(self, n: int, rounds: int) -> None:
        self.n, self.rounds = n, rounds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(8, _busy(self.rounds), np.int64)


class HoldsArray:
    """W5: a dataset holding one large array; what start-up costs under spawn."""

    def __init__(self, nbytes: int) -> None:
        self.data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> np.ndarray:
        return self.data[i * 64 : i * 64 + 64]


W7_SOURCE_SHAPE = (3, 256, 256)
W7_CROP = 224
W7_CROP_BYTES = 3 * W7_CROP * W7_CROP
W7_PREFETCH = 4
W7_BATCH_SIZES = (256, 64)
W7_LOADERS = ("stoker.torch", "torch")  # plain stoker would produce the same tensors


def w7_sources(n: int) -> np.ndarray:
    """W7's source images: `n` distinct 3x256x256 uint8 images from a seeded RNG (196 MB at
    n=1000). Made once per bench run and shared by every loader and configuration."""
    return np.random.default_rng(7).integers(0, 256, (n, *W7_SOURCE_SHAPE), dtype=np.uint8)


class ImageNetCrops:
    """W7: an ImageNet-sized tensor pipeline without the decoding.

    Sample `i` is a random 224x224 crop of source image `i % len(sources)`, flipped
    horizontally with probability 1/2, as a torch tensor (`torch.from_numpy` of the crop, a
    non-contiguous view; the flip copies), and its label, a Python int. The randomness comes
    from torch's global RNG, which the loaders seed in each worker, so a sample is
    deterministic given `torch.manual_seed` (in the process that fetches it).
    """

    def __init__(self, sources: np.ndarray, n: int) -> None:
        self.sources, self.n = sources, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        sources = self.sources
        label = i % len(sources)
        height, width = sources.shape[2:]
        top = int(torch.randint(0, height - W7_CROP + 1, (1,)))
        left = int(torch.randint(0, width - W7_CROP + 1, (1,)))
        image = torch.from_numpy(sources[label, :, top : top + W7_CROP, left : left + W7_CROP])
        if int(torch.randint(0, 2, (1,))):
            image = image.flip(-1)
        return image, label


def w7_batches(sizes: Sizes, workers: int) -> int:
    """Batches in one W7 epoch: enough that, after `W7_PREFETCH * workers + 1` batches are left
    out at each end (see `steady_window`), the steady-state window still spans several rounds
    of batches of every worker."""
    return max(sizes.w7_min_batches, sizes.w7_base_batches + sizes.w7_batches_per_worker * workers)


def _worker_info() -> Any:
    info: Any = stoker.get_worker_info()  # stoker's WorkerInfo, else torch's
    if info is None and "torch" in sys.modules:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
    return info


class _StreamBody:
    """W4: an iterable of 128-float32 rows, sharded across workers."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rows = np.random.default_rng(0).random((256, 128), dtype=np.float32)

    def __iter__(self) -> Iterator[np.ndarray]:
        info = _worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        rows = self.rows
        for i in range(start, self.n, step):
            yield rows[i & 255]

    def __len__(self) -> int:
        return self.n


class StokerStream(_StreamBody, stoker.IterableDataset):
    pass


def _torch_stream_class() -> type:
    import torch.utils.data

    return type("TorchStream", (_StreamBody, torch.utils.data.IterableDataset), {"__module__": __name__})


def __getattr__(name: str) -> Any:
    """`TorchStream` (W4's dataset for torch.utils.data), made on first use: a module-level
    name, so that spawn can pickle it, but made lazily, so that importing this module does not
    import torch (W5's spawn and forkserver workers of plain stoker import it to rebuild
    `HoldsArray`)."""
    if name == "TorchStream":
        made = globals().get(name)
        if made is None:
            made = globals()[name] = _torch_stream_class()
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------- loaders
def loader_modules(with_torch: bool) -> dict[str, Any]:
    """The loaders to compare: name -> module with a DataLoader."""
    mods: dict[str, Any] = {"stoker": stoker}
    if with_torch:
        try:
            import torch
            import torch.utils.data
        except ImportError:
            return mods
        mods["stoker.torch"] = importlib.import_module("stoker.torch")
        mods["torch"] = torch.utils.data
    return mods


def _iterable_for(name: str, n: int) -> Any:
    if name == "torch":  # the "torch" loader is there only when torch imports
        return __getattr__("TorchStream")(n)
    return StokerStream(n)


# ------------------------------------------------------------------ results
AUTO: Final = "auto"  # the `workers` of the rows run with num_workers="auto", prefetch_factor="auto"
AUTO_REF: Final = "auto ref"  # the variant of the hand-picked epochs run next to each auto epoch
AUTO_BLOCKS = 2  # blocks of (auto, each hand-picked worker count) per repetition
Workers = int | str  # a number of workers, or AUTO
Key = tuple[str, str, Workers, str]  # (workload, loader, workers, variant)


@dataclass
class Result:
    workload: str
    loader: str
    workers: Workers
    variant: str = ""
    unit: str = "samples/s"
    values: list[float] = field(default_factory=list)
    bytes_per_sample: int = 0
    extra: dict[str, list[float]] = field(default_factory=dict)
    choices: list[str] = field(default_factory=list)  # AUTO rows: what the loader chose, per repetition

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def main_us_per_batch(self) -> float | None:
        """Median over the repetitions of the main process's CPU µs per batch (samples/s rows)."""
        values = self.extra.get("main_us_per_batch")
        return statistics.median(values) if values else None

    def gbps(self) -> float | None:
        if self.unit != "samples/s" or not self.bytes_per_sample:
            return None
        return self.median * self.bytes_per_sample / 1e9


@dataclass
class Sizes:
    w1: int = 200_000
    w2: int = 4096
    w3: int = 512
    w4: int = 200_000
    w5_mb: tuple[int, ...] = (10, 200)
    w6_images: int = 1024
    w6_epochs: int = 16
    # W7: distinct source images; batches per epoch = max(min, base + per_worker * workers),
    # at either batch size (see w7_batches and benchmarks/README.md)
    w7_sources: int = 1000
    w7_min_batches: int = 40
    w7_base_batches: int = 32
    w7_batches_per_worker: int = 16
    # W1 with stats=True against stats=False: at least this many interleaved pairs of epochs per
    # number of workers (spread evenly over the repetitions, see `pairs_per_rep`)
    stats_pairs: int = 15
    # W8: distinct images, each read once per epoch (7,000 x 150,528 bytes = 1.05 GB)
    w8_images: int = 7000

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            w1=20_000, w2=1024, w3=256, w4=20_000, w5_mb=(10, 50), w6_images=256, w6_epochs=3,
            w7_sources=200, w7_min_batches=6, w7_base_batches=4, w7_batches_per_worker=4, stats_pairs=2,
            w8_images=448,  # 67 MB
        )


def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """One core's memcpy bandwidth: bytes copied per second, best of `reps`."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def memcpy_threads_gbps(threads: int = 2, nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Memcpy bandwidth of `threads` threads at once: each copies its share of one `nbytes`
    buffer with `np.copyto` (which releases the GIL), all started together; bytes copied per
    second from the start to the last thread's end, best of `reps`."""
    import threading

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    bounds = [nbytes * k // threads for k in range(threads + 1)]
    best = float("inf")
    for _ in range(reps):
        ready = threading.Barrier(threads + 1)

        def copy(lo: int, hi: int, ready: threading.Barrier = ready) -> None:
            ready.wait()
            np.copyto(dst[lo:hi], src[lo:hi])

        workers = [threading.Thread(target=copy, args=(lo, hi)) for lo, hi in itertools.pairwise(bounds)]
        for thread in workers:
            thread.start()
        ready.wait()
        start = time.perf_counter()
        for thread in workers:
            thread.join()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


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
        capture_output=True, text=True, timeout=300, check=False,
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


# -------------------------------------------------------------------- runner
@dataclass
class Plan:
    workloads: list[str]
    workers: list[int]
    reps: int
    sizes: Sizes
    with_torch: bool


# typed Any: the bench's datasets are duck-typed, and "auto" is tried on a stoker that may not
# take it yet (see `auto_unsupported`)
_DataLoader: Any = stoker.DataLoader
AUTO_WORKLOADS = ("W1", "W2", "W3")  # run with num_workers="auto", prefetch_factor="auto" too


def auto_unsupported() -> str | None:
    """None when stoker.DataLoader takes `num_workers="auto", prefetch_factor="auto"`, else why
    not (the error it raised at construction, which starts nothing)."""
    try:
        loader: Any = _DataLoader(TinyDicts(16), batch_size=4, num_workers=AUTO, prefetch_factor=AUTO)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    del loader
    return None


def _jobs(
    plan: Plan,
    mods: dict[str, Any],
    busy_rounds: int,
    sources: np.ndarray | None = None,
    rep: int = 0,
    auto: bool = False,
    large: np.ndarray | None = None,
) -> list[tuple[str, str, Workers, str, Callable[[], Any]]]:
    """(workload, loader, workers, variant, measure) for repetition `rep`.

    `sources` are W7's source images, made once per run (`w7_sources`); W7 runs only through
    the torch-flavoured loaders, and only when they are in `mods`. `large` are W8's images,
    made once per run (`w8_images`); W8 runs when they are given. The `stoker` rows of W2 and
    W8 with workers also read the arena (`ArenaUse`). With W1, each number of
    workers also gets `pairs_per_rep` pairs of stoker epochs with stats on and off (variant
    "stats", one job per pair, which of the two goes first alternating from pair to pair);
    with `auto`, W1-W3 also run stoker with `num_workers="auto", prefetch_factor="auto"`
    (workers AUTO), after the hand-picked rows of the same repetition.
    """
    s = plan.sizes
    jobs: list[Any] = []
    tiny, images, heavy = TinyDicts(s.w1), Images(s.w2), CpuHeavy(s.w3, busy_rounds)
    per_rep = pairs_per_rep(s, plan.reps)
    # one W2 epoch for every row (the auto rows' from-iter()-to-end rates are compared with
    # the hand-picked rows'), long enough for a steady-state window at the most workers run
    # or that "auto" may choose (usable CPUs)
    w2 = images.resized(w2_samples(s, max([*plan.workers, usable_cpus() or 1])))
    # W8: one epoch size for every row too (every image once at up to 12 workers)
    w8 = LargeImages(large, w8_samples(s, max(plan.workers))) if large is not None else None
    for workers in plan.workers:
        for name, mod in mods.items():

            def add(
                workload: str,
                make: Callable[[], Any],
                name: str = name,
                workers: int = workers,
                variant: str = "",
                prefetch: int = 2,
                arena: bool = False,
            ) -> None:
                jobs.append((workload, name, workers, variant, lambda: _epoch_rate(make, workers, prefetch, arena)))

            reads_arena = name == "stoker" and workers > 0

            if "W1" in plan.workloads:

                def make_w1(mod: Any = mod, w: int = workers) -> Any:
                    return mod.DataLoader(tiny, batch_size=256, num_workers=w)

                add("W1", make_w1)
                if name == "stoker":

                    def make_w1_stats(stats: bool, w: int = workers) -> Any:
                        return _DataLoader(tiny, batch_size=256, num_workers=w, stats=stats)

                    for pair in range(rep * per_rep, (rep + 1) * per_rep):
                        on_first = pair % 2 == 0
                        measure = functools.partial(_stats_pair, make_w1_stats, workers, on_first)
                        jobs.append(("W1", name, workers, "stats", measure))
            if "W2" in plan.workloads:

                def make_w2(mod: Any = mod, w: int = workers, w2: Images = w2) -> Any:
                    return mod.DataLoader(w2, batch_size=64, num_workers=w)

                add("W2", make_w2, arena=reads_arena)
            if "W3" in plan.workloads:

                def make_w3(mod: Any = mod, w: int = workers) -> Any:
                    return mod.DataLoader(heavy, batch_size=16, num_workers=w)

                add("W3", make_w3)
            if "W4" in plan.workloads:

                def make_w4(mod: Any = mod, w: int = workers, name: str = name) -> Any:
                    return mod.DataLoader(_iterable_for(name, s.w4), batch_size=256, num_workers=w)

                add("W4", make_w4)
            if "W7" in plan.workloads and sources is not None and name in W7_LOADERS:
                for batch_size in W7_BATCH_SIZES:
                    crops = ImageNetCrops(sources, batch_size * w7_batches(s, workers))

                    def make_w7(mod: Any = mod, w: int = workers, b: int = batch_size, crops: Any = crops) -> Any:
                        prefetch = {"prefetch_factor": W7_PREFETCH} if w > 0 else {}
                        return mod.DataLoader(crops, batch_size=b, shuffle=True, num_workers=w, **prefetch)

                    add("W7", make_w7, variant=f"b{batch_size}", prefetch=W7_PREFETCH)
            if "W8" in plan.workloads and w8 is not None:

                def make_w8(mod: Any = mod, w: int = workers, data: LargeImages = w8) -> Any:
                    return mod.DataLoader(data, batch_size=64, num_workers=w)

                add("W8", make_w8, arena=reads_arena)
    if auto:
        # the same datasets as the hand-picked rows
        auto_data = {"W1": (tiny, 256), "W2": (w2, 64), "W3": (heavy, 16)}
        for workload in AUTO_WORKLOADS:
            if workload not in plan.workloads:
                continue
            data, batch_size = auto_data[workload]

            def make_auto(data: Any = data, batch_size: int = batch_size) -> Any:
                return _DataLoader(data, batch_size=batch_size, num_workers=AUTO, prefetch_factor=AUTO)

            # the auto epoch back to back with one epoch of each hand-picked worker count (the
            # same loader as the workload's rows), the order alternating over repetitions, so
            # that each block gives one ratio against the best of its own epochs
            block: list[Any] = []
            for workers in plan.workers:

                def make_ref(data: Any = data, batch_size: int = batch_size, w: int = workers) -> Any:
                    return _DataLoader(data, batch_size=batch_size, num_workers=w)

                block.append((workload, "stoker", workers, AUTO_REF, functools.partial(_epoch_rate, make_ref, workers)))
            block.append((workload, "stoker", AUTO, "", functools.partial(_epoch_rate, make_auto, None, None)))
            for k in range(AUTO_BLOCKS):
                jobs.extend(block if (rep * AUTO_BLOCKS + k) % 2 == 0 else block[::-1])
    if "W5" in plan.workloads and any(w > 0 for w in plan.workers):
        methods = w5_methods()
        for mb in s.w5_mb:
            holder = HoldsArray(mb << 20)
            for method in methods:
                for name, mod in mods.items():
                    def make(mod: Any = mod, method: str = method, holder: HoldsArray = holder) -> Any:
                        return mod.DataLoader(holder, batch_size=4, num_workers=2, multiprocessing_context=method)

                    jobs.append(("W5", name, 2, f"{method} {mb} MB", lambda make=make: _first_batch_s(make)))
        # stoker alone in a fresh process that never imports torch, the smallest dataset
        small = min(s.w5_mb)
        for method in methods:
            jobs.append(
                ("W5", "stoker", 2, f"{TORCH_FREE} {method} {small} MB", functools.partial(torch_free_first_batch, method, small))
            )
    if "W6" in plan.workloads and any(w > 0 for w in plan.workers):
        for name, mod in mods.items():

            def make_persistent(n: int, mod: Any = mod) -> Any:
                return mod.DataLoader(Images(n), batch_size=64, num_workers=2, persistent_workers=True)

            jobs.append(
                (
                    "W6",
                    name,
                    2,
                    "cost",
                    lambda make=make_persistent: _epoch_boundary(make, s.w6_images, s.w6_epochs, 64),
                )
            )
    return jobs


def run(plan: Plan, progress: bool = True) -> dict[str, Any]:
    """Run the plan; returns the JSON-ready report."""
    mods = loader_modules(plan.with_torch)
    machine = environment()
    busy_rounds = calibrate_busy()
    ceiling = memcpy_gbps()
    machine["memcpy_gbps"] = ceiling
    ceiling2 = machine["memcpy2_gbps"] = memcpy_threads_gbps(2)
    sources = None
    if "W7" in plan.workloads and any(name in mods for name in W7_LOADERS):
        sources = w7_sources(plan.sizes.w7_sources)
    large = w8_images(plan.sizes.w8_images) if "W8" in plan.workloads else None
    if "W5" in plan.workloads and "forkserver" in w5_methods() and any(w > 0 for w in plan.workers):
        # the server is started once per process, by whichever loader comes first: started
        # here, neither W5 loader pays for it (the torch-free case, a fresh process, does)
        import multiprocessing.forkserver

        multiprocessing.forkserver.ensure_running()
    unsupported = auto_unsupported() if any(w in plan.workloads for w in AUTO_WORKLOADS) else None
    auto = any(w in plan.workloads for w in AUTO_WORKLOADS) and unsupported is None
    results: dict[Key, Result] = {}
    first = _jobs(plan, mods, busy_rounds, sources, 0, auto, large)
    total = len(first) * plan.reps  # every repetition has the same jobs
    bar = _progress(total) if progress else None
    for rep in range(plan.reps):
        jobs = first if rep == 0 else _jobs(plan, mods, busy_rounds, sources, rep, auto, large)
        for workload, name, workers, variant, measure in jobs:
            if bar is not None:
                bar.set_description(f"{workload} {name} w={workers} {variant}".strip())
            _record(results, (workload, name, workers, variant), measure())
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    del sources, first, large
    rows = list(results.values())
    return {
        "machine": machine,
        "busy_rounds_per_2ms": busy_rounds,
        "reps": plan.reps,
        "sizes": asdict(plan.sizes),
        "results": [
            asdict(r) | {"median": r.median, "gbps": r.gbps(), "main_us_per_batch": r.main_us_per_batch}
            for r in rows
        ],
        "w3_scaling": w3_scaling(rows),
        "arena": arena_use(rows),
        "stats_overhead": stats_overhead(rows),
        "auto": {
            "run": auto,
            "note": None if unsupported is None else f'num_workers="auto" not run: this stoker refuses it ({unsupported})',
            "workloads": auto_vs_best(rows),
        },
        "targets": targets(rows, ceiling, ceiling2),
    }


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def environment() -> dict[str, Any]:
    """What the run saw: CPUs, torch's thread count in the main process, thread variables.

    torch is looked at when it is imported: always when it is among the loaders (`--no-torch`
    does not import it just to report on it)."""
    machine: dict[str, Any] = {
        "cpus": usable_cpus(),
        "os_cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": None,
        "torch_threads": None,
    }
    torch = sys.modules.get("torch")  # imported by loader_modules unless --no-torch
    if torch is not None:
        machine["torch"] = torch.__version__
        machine["torch_threads"] = torch.get_num_threads()
    for name in THREAD_VARIABLES:
        machine[name] = os.environ.get(name, "unset")
    # spawn and forkserver workers import stoker afresh: without cached bytecode they compile it
    import importlib.util

    from stoker._core import loader

    machine["stoker_bytecode_cached"] = os.path.exists(importlib.util.cache_from_source(loader.__file__))
    machine["PYTHONDONTWRITEBYTECODE"] = os.environ.get("PYTHONDONTWRITEBYTECODE", "unset")
    return machine


def environment_line(machine: dict[str, Any]) -> str:
    """One line of what `environment` recorded."""
    torch = (
        f"torch {machine['torch']} with {machine['torch_threads']} threads in the main process"
        if machine.get("torch")
        else "torch not loaded"
    )
    variables = " ".join(f"{name}={machine.get(name, 'unset')}" for name in THREAD_VARIABLES)
    bytecode = ""
    if "stoker_bytecode_cached" in machine:
        bytecode = (
            f", stoker's bytecode {'cached' if machine['stoker_bytecode_cached'] else 'not cached'} "
            f"(PYTHONDONTWRITEBYTECODE={machine.get('PYTHONDONTWRITEBYTECODE', 'unset')})"
        )
    return (
        f"environment (as found, nothing set by the bench): {machine.get('cpus')} usable CPUs "
        f"(os.cpu_count() {machine.get('os_cpu_count')}), {torch}, {variables}{bytecode}"
    )


def _result(results: dict[Key, Result], key: Key) -> Result:
    result = results.get(key)
    if result is None:
        workload = key[0]
        result = results[key] = Result(*key)
        if workload in ("W2", "W8"):
            result.bytes_per_sample = IMAGE_BYTES
        elif workload == "W4":
            result.bytes_per_sample = 128 * 4
        elif workload == "W7":
            result.bytes_per_sample = W7_CROP_BYTES
        elif workload == "W5":
            result.unit = "s to first batch"
        elif workload == "W6":
            result.unit = "boundary / batch"
    return result


def _record(results: dict[Key, Result], key: Key, value: Any) -> None:
    """Adds one measurement; W6's two measures of a boundary become two rows, and so do the two
    epochs of a stats pair ("stats on", "stats off": value i of each is pair i)."""
    workload, name, workers, _ = key
    if workload == "W6":
        cost = _result(results, key)
        cost.values.append(value["cost_s"] / value["batch_s"])
        gap = _result(results, (workload, name, workers, "gap"))
        gap.values.append(value["gap_s"] / value["median_gap_s"])
        for row in (cost, gap):
            for field_name, seconds in value.items():
                row.extra.setdefault(field_name, []).append(seconds)
    elif workload == "W5" and isinstance(value, dict):  # the torch-free case, from its subprocess
        row = _result(results, key)
        row.values.append(float(value["first_batch_s"]))
        for field_name in ("torch_imported", "import_s", "make_s"):
            row.extra.setdefault(field_name, []).append(float(value[field_name]))
    elif workload == "W5":
        _result(results, key).values.append(float(value))
    elif isinstance(value, StatsPair):
        for variant, timing in (("stats on", value.on), ("stats off", value.off)):
            row = _record_timing(results, (workload, name, workers, variant), timing)
            row.extra.setdefault("on_first", []).append(float(value.on_first))
    else:
        row = _record_timing(results, key, value)
        if value.chosen is not None:
            chosen: Chosen = value.chosen
            row.choices.append(chosen.choice)
            row.extra.setdefault("chosen_workers", []).append(float(chosen.num_workers))
            # 0: none (0 workers)
            row.extra.setdefault("chosen_prefetch", []).append(float(chosen.prefetch_factor or 0))


def _record_timing(results: dict[Key, Result], key: Key, timing: EpochTiming) -> Result:
    windowed = timing.steady is not None
    result = _result(results, key)
    result.values.append(timing.steady if timing.steady is not None else timing.whole)
    main_us = timing.main_us if timing.main_us is not None else timing.whole_main_us
    result.extra.setdefault("main_us_per_batch", []).append(main_us)
    result.extra.setdefault("with_startup", []).append(timing.whole)
    result.extra.setdefault("main_us_per_batch_with_startup", []).append(timing.whole_main_us)
    result.extra.setdefault("windowed", []).append(float(windowed))
    result.extra.setdefault("first_batch_s", []).append(timing.first_s)
    if timing.arena is not None:
        use = timing.arena
        result.extra.setdefault("arena_bytes", []).append(float(use.arena_bytes))
        result.extra.setdefault("arena_batch_bytes", []).append(float(use.batch_bytes))
        result.extra.setdefault("arena_batches", []).append(use.batches)
        result.extra.setdefault("arena_window", []).append(float(use.window))
    return result


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="run", file=sys.stderr, leave=False)


# ------------------------------------------------------------------- targets
def _find(rows: list[Result], workload: str, loader: str, workers: Workers, variant: str = "") -> Result | None:
    for r in rows:
        if (r.workload, r.loader, r.workers, r.variant) == (workload, loader, workers, variant):
            return r
    return None


W7_TARGET_AT_14 = 1.5  # stoker.torch vs torch at 14 workers (a 16-core machine)
STATS_OVERHEAD_MAX = 0.02  # stats=True vs stats=False on W1, median of the pairs' off/on - 1
AUTO_VS_BEST_MIN = 0.85  # num_workers="auto" over the best hand-picked number of workers
W7_BATCH_COST_GROWTH = 1.25  # main-process µs/batch at b256 over b64, at most


W8_VS_TORCH = 5.0  # stoker.torch vs torch at 2 workers, samples/s
MEMCPY_SHARE = 0.70  # W2's and W8's GB/s over the one-core memcpy ceiling, at least


def arena_use(rows: list[Result]) -> list[dict[str, Any]]:
    """Per W2/W8 row that read the arena (stoker, workers >= 1): the arena's reserved bytes at
    their most over each epoch's steady-state window, in batches, against the prefetch window
    + 2; `batches` is the most over the repetitions."""
    out = []
    for r in rows:
        per_rep = r.extra.get("arena_batches")
        if not per_rep or r.variant:
            continue
        window = int(r.extra["arena_window"][0])
        out.append(
            {
                "workload": r.workload,
                "loader": r.loader,
                "workers": r.workers,
                "batches": max(per_rep),
                "per_rep": list(per_rep),
                "arena_bytes": max(r.extra["arena_bytes"]),
                "batch_bytes": max(r.extra["arena_batch_bytes"]),
                "window": window,
                "limit": window + 2,
            }
        )
    return out


def targets(rows: list[Result], ceiling: float, ceiling2: float | None = None) -> list[dict[str, Any]]:
    """The issue's targets, stoker.torch vs torch.utils.data, as measured: W1-W6 and W8 at
    num_workers=2, W7 at every number of workers >= 1; W5's torch-free start-up and the arena's
    size, stoker alone. `ceiling`: one core's memcpy GB/s; `ceiling2`: two threads' (W8's second
    line, for information: `met` None)."""
    out: list[dict[str, Any]] = []

    def ratio_target(
        name: str, workload: str, need: float, variant: str = "", lower_is_better: bool = False, workers: int = 2
    ) -> None:
        ours = _find(rows, workload, "stoker.torch", workers, variant)
        theirs = _find(rows, workload, "torch", workers, variant)
        if ours is None or theirs is None:
            return
        ratio = theirs.median / ours.median if lower_is_better else ours.median / theirs.median
        met = ratio >= need
        if lower_is_better:
            shown = f"{ours.median / theirs.median:.3f}x torch's time (target <= {1 / need:.2f}x)"
        else:
            shown = f"{ratio:.2f}x torch (target >= {need:g}x)"
        out.append({"target": name, "met": met, "value": ratio, "shown": shown})

    ratio_target("W2 images samples/s vs torch", "W2", 5.0)
    w2 = _find(rows, "W2", "stoker.torch", 2)
    if w2 is not None:
        share = w2.gbps() / ceiling  # type: ignore[operator]
        out.append(
            {
                "target": "W2 images GB/s vs one-core memcpy",
                "met": share >= 0.70,
                "value": share,
                "shown": f"{w2.gbps():.2f} GB/s = {share:.0%} of {ceiling:.1f} GB/s (target >= 70%)",
            }
        )
    ratio_target("W1 tiny samples/s vs torch", "W1", 4.0)
    ratio_target("W4 iterable samples/s vs torch", "W4", 2.0)
    for entry in w3_scaling(rows):
        if (entry["loader"], entry["workers"]) != ("stoker.torch", 2):
            continue
        scaling = entry["scaling"]
        out.append(
            {
                "target": "W3 CPU-heavy two-worker scaling",
                "met": scaling >= 0.90,
                "value": scaling,
                "shown": f"{scaling:.0%} of ideal (target >= 90%)",
            }
        )
    for method in W5_METHODS:
        big = [r.variant for r in rows if r.workload == "W5" and r.variant.startswith(f"{method} ")]
        if big:
            largest = max(big, key=lambda v: int(v.split()[1]))
            need = 1 / W5_VS_TORCH
            ratio_target(f"W5 {largest} time to first batch vs torch", "W5", need, largest, lower_is_better=True)
    for method in ("spawn", "forkserver"):  # fork: for reference, in the table
        for r in rows:
            if r.workload != "W5" or not r.variant.startswith(f"{TORCH_FREE} {method} "):
                continue
            imported = int(sum(r.extra.get("torch_imported", [])))
            flag = f"; FLAGGED: torch was imported in {imported} of {len(r.values)} runs" if imported else ""
            out.append(
                {
                    "target": f"W5 {r.variant.removeprefix(TORCH_FREE + ' ')} time to first batch, fresh process "
                    "without torch (stoker)",
                    "met": r.median < TORCH_FREE_MAX_S and not imported,
                    "value": r.median,
                    "shown": f"{r.median:.3f} s ({min(r.values):.3f}-{max(r.values):.3f}), torch "
                    f"{'imported' if imported else 'not imported'}{flag} (target < {TORCH_FREE_MAX_S:g} s)",
                }
            )
    gap = _find(rows, "W6", "stoker.torch", 2, "gap")
    if gap is not None:
        seconds = statistics.median(gap.extra["gap_s"])
        batch = statistics.median(gap.extra["median_gap_s"])
        out.append(
            {
                "target": "W6 epoch boundary: last batch of epoch k to first of k+1",
                "met": gap.median <= 1.0,
                "value": gap.median,
                "shown": f"{seconds * 1e3:.2f} ms = {gap.median:.2f} median batch gaps "
                f"({batch * 1e3:.2f} ms) (target <= 1)",
            }
        )
    cost = _find(rows, "W6", "stoker.torch", 2, "cost")
    if cost is not None:
        seconds = statistics.median(cost.extra["cost_s"])
        out.append(
            {
                "target": "W6 epoch boundary: throughput cost (E epochs vs one long epoch)",
                "met": cost.median <= 1.0,
                "value": cost.median,
                "shown": f"{seconds * 1e3:.2f} ms = {cost.median:.2f} batch times (target <= 1)",
            }
        )
    w7_workers = sorted(
        {r.workers for r in rows if r.workload == "W7" and isinstance(r.workers, int) and r.workers > 0}
    )
    for workers in w7_workers:
        need = W7_TARGET_AT_14 if workers == 14 else 1.0
        ratio_target(f"W7 b256 w={workers}", "W7", need, "b256", workers=workers)
    if w7_workers:
        workers = w7_workers[-1]
        b256, b64 = _find(rows, "W7", "stoker.torch", workers, "b256"), _find(rows, "W7", "stoker.torch", workers, "b64")
        if b256 is not None and b64 is not None and b256.main_us_per_batch and b64.main_us_per_batch:
            growth = b256.main_us_per_batch / b64.main_us_per_batch
            out.append(
                {
                    "target": f"W7 main-process CPU per batch, b256 vs b64 (stoker.torch, w={workers})",
                    "met": growth <= W7_BATCH_COST_GROWTH,
                    "value": growth,
                    "shown": f"{b256.main_us_per_batch:.0f} µs vs {b64.main_us_per_batch:.0f} µs "
                    f"= {growth:.2f}x (target <= {W7_BATCH_COST_GROWTH:g}x)",
                }
            )
    ratio_target("W8 images 1 GB samples/s vs torch", "W8", W8_VS_TORCH)
    w8 = _find(rows, "W8", "stoker.torch", 2)
    if w8 is not None:
        gbps = w8.gbps() or 0.0
        share = gbps / ceiling
        out.append(
            {
                "target": "W8 images 1 GB GB/s vs one-core memcpy",
                "met": share >= MEMCPY_SHARE,
                "value": share,
                "shown": f"{gbps:.2f} GB/s = {share:.0%} of {ceiling:.1f} GB/s (target >= {MEMCPY_SHARE:.0%})",
            }
        )
        if ceiling2:
            share2 = gbps / ceiling2
            out.append(
                {
                    "target": "W8 images 1 GB GB/s vs two-thread memcpy",
                    "met": None,
                    "value": share2,
                    "shown": f"{gbps:.2f} GB/s = {share2:.0%} of {ceiling2:.1f} GB/s (for information, no target)",
                }
            )
    for entry in arena_use(rows):
        out.append(
            {
                "target": f"{entry['workload']} arena at steady state w={entry['workers']} ({entry['loader']}, "
                "reserved bytes / batch bytes)",
                "met": entry["batches"] <= entry["limit"],
                "value": entry["batches"],
                "shown": f"{entry['arena_bytes'] / 1e6:.1f} MB = {entry['batches']:.2f} batches of "
                f"{entry['batch_bytes'] / 1e6:.2f} MB (repetitions: {' '.join(f'{v:.2f}' for v in entry['per_rep'])}) "
                f"(target <= window {entry['window']} + 2 = {entry['limit']})",
            }
        )
    for entry in stats_overhead(rows):
        overhead = entry["overhead"]
        out.append(
            {
                "target": f"W1 stats overhead w={entry['workers']} (stoker, stats=True vs stats=False)",
                "met": overhead < STATS_OVERHEAD_MAX,
                "value": overhead,
                "shown": f"{overhead:+.1%} (median of {entry['pairs']} pairs; {_fmt_rate(entry['on'])} samples/s on, "
                f"{_fmt_rate(entry['off'])} off) (target < {STATS_OVERHEAD_MAX:.0%})",
            }
        )
    for entry in auto_vs_best(rows):
        ratio = entry["ratio"]
        out.append(
            {
                "target": f"{entry['workload']} auto vs best hand-picked (stoker)",
                "met": ratio >= AUTO_VS_BEST_MIN,
                "value": ratio,
                "shown": f"{ratio:.2f}x of the best hand-picked epoch next to it (median of "
                f"{len(entry.get('per_block', [])) or 1} blocks), from iter() to the end, the choice and "
                f"start-up included (steady state: {entry['steady_ratio']:.2f}x of w={entry['steady_best_workers']}) "
                f"(target >= {AUTO_VS_BEST_MIN:g}x)",
            }
        )
    return out


def stats_overhead(rows: list[Result]) -> list[dict[str, Any]]:
    """Per number of workers, what stats=True costs on W1 (stoker): the pairs' samples/s on
    and off (medians), each pair's off/on - 1 and their median (`pair_overhead`)."""
    out = []
    for on in rows:
        if (on.workload, on.loader, on.variant) != ("W1", "stoker", "stats on"):
            continue
        off = _find(rows, "W1", "stoker", on.workers, "stats off")
        if off is None or len(off.values) != len(on.values):
            continue
        out.append(
            {
                "workers": on.workers,
                "pairs": len(on.values),
                "overhead": pair_overhead(on.values, off.values),
                "per_pair": [b / a - 1 for a, b in zip(on.values, off.values)],
                "on": on.median,
                "off": off.median,
                "main_us_on": on.main_us_per_batch,
                "main_us_off": off.main_us_per_batch,
            }
        )
    return out


def auto_vs_best(rows: list[Result]) -> list[dict[str, Any]]:
    """Per workload of W1-W3 run with num_workers="auto": its samples/s against the best
    hand-picked setting, from iter() to the end of the epoch (the loader's choice and worker
    start-up included, as they are for the hand-picked epochs' start-up) and, for reference, in
    the steady state; and the choices. Each auto epoch ran in a block with one epoch of every
    hand-picked worker count (`AUTO_REF`): `ratio` is the median over blocks of the auto
    epoch's rate over the best epoch of its block."""
    out = []
    for workload in AUTO_WORKLOADS:
        auto = _find(rows, workload, "stoker", AUTO)
        picked = [r for r in rows if (r.workload, r.loader, r.variant) == (workload, "stoker", AUTO_REF)]
        if auto is None or not picked:
            continue

        def whole(r: Result) -> float:
            return statistics.median(r.extra["with_startup"])

        def first(r: Result) -> float | None:
            return statistics.median(r.extra["first_batch_s"]) if r.extra.get("first_batch_s") else None

        blocks = min(len(r.extra["with_startup"]) for r in [auto, *picked])
        per_block = [
            auto.extra["with_startup"][k] / max(r.extra["with_startup"][k] for r in picked) for k in range(blocks)
        ]
        best = max(picked, key=whole)
        steady_best = max(picked, key=lambda r: r.median)
        out.append(
            {
                "workload": workload,
                "auto": whole(auto),
                "best": whole(best),
                "best_workers": best.workers,
                "ratio": statistics.median(per_block),
                "per_block": per_block,
                "auto_first_s": first(auto),
                "best_first_s": first(best),
                "auto_steady": auto.median,
                "steady_best": steady_best.median,
                "steady_best_workers": steady_best.workers,
                "steady_ratio": auto.median / steady_best.median,
                "chosen_workers": [int(w) for w in auto.extra.get("chosen_workers", [])],
                "choices": list(auto.choices),
            }
        )
    return out


def w3_scaling(rows: list[Result]) -> list[dict[str, Any]]:
    """W3 scaling per loader: samples/s at N workers / (N * samples/s at 0 workers)."""
    out = []
    for r in rows:
        base = _find(rows, "W3", r.loader, 0)
        if (
            r.workload == "W3" and r.variant == "" and isinstance(r.workers, int) and r.workers > 0
            and base is not None
        ):
            out.append(
                {"loader": r.loader, "workers": r.workers, "scaling": r.median / (r.workers * base.median)}
            )
    return out


# ------------------------------------------------------------------- output
def _fmt_rate(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.1f}"


def _fmt_us(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


NAME_WIDTH = 32  # the table's workload column: "W5 torch-free forkserver 200 MB"


def table(report: dict[str, Any]) -> str:
    """The human-readable table of a report."""
    lines = []
    header = (
        f"{'workload':<{NAME_WIDTH}}{'loader':<14}{'workers':>7}  {'median':>10}  {'min-max':>19}  {'GB/s':>6}  "
        f"{'vs torch':>8}  {'main µs/batch':>13}"
    )
    lines.append(header)
    lines.append("-" * len(header))
    rows = report["results"]
    index = {(r["workload"], r["loader"], r["workers"], r["variant"]): r for r in rows}
    for r in rows:
        lo, hi = min(r["values"]), max(r["values"])
        torch_row = index.get((r["workload"], "torch", r["workers"], r["variant"]))
        vs = ""
        if torch_row is not None and r["loader"] != "torch":
            if r["unit"] == "samples/s":
                vs = f"{r['median'] / torch_row['median']:.2f}x"
            elif r["unit"] == "s to first batch":
                vs = f"{r['median'] / torch_row['median']:.2f}x t"
        if r["unit"] == "samples/s":
            med, span = _fmt_rate(r["median"]), f"{_fmt_rate(lo)}-{_fmt_rate(hi)}"
        elif r["unit"] == "s to first batch":
            med, span = f"{r['median']:.3f}s", f"{lo:.3f}-{hi:.3f}s"
        else:
            med, span = f"{r['median']:.2f}", f"{lo:.2f}-{hi:.2f}"
        gb = f"{r['gbps']:.2f}" if r["gbps"] is not None else ""
        name = f"{r['workload']} {r['variant']}".strip()
        us = _fmt_us(r.get("main_us_per_batch"))
        lines.append(
            f"{name:<{NAME_WIDTH}}{r['loader']:<14}{r['workers']:>7}  {med:>10}  {span:>19}  {gb:>6}  {vs:>8}  {us:>13}"
        )
    if report.get("w3_scaling"):
        lines.append("")
        lines.append("W3 scaling (samples/s at N workers / (N x samples/s at 0 workers)):")
        for entry in report["w3_scaling"]:
            lines.append(f"  {entry['loader']:<14}{entry['workers']:>3} workers  {entry['scaling']:.0%}")
    if report.get("arena"):
        lines.append("")
        lines.append(
            "arena (stoker): shared-memory slots reserved, at their most over the steady-state window, "
            "in batches (most over the repetitions), against prefetch_factor x workers + 2:"
        )
        for entry in report["arena"]:
            lines.append(
                f"  {entry['workload']} w={entry['workers']:<3} {entry['arena_bytes'] / 1e6:7.1f} MB = "
                f"{entry['batches']:.2f} x {entry['batch_bytes'] / 1e6:.2f} MB  (limit {entry['limit']})"
            )
    torch_free = [r for r in rows if r["workload"] == "W5" and r["variant"].startswith(TORCH_FREE)]
    if torch_free:
        lines.append("")
        lines.append(
            "W5 torch-free (stoker in a fresh `python -c` that imports stoker and numpy, never torch; "
            "iter() + first next()):"
        )
        for r in torch_free:
            imported = int(sum(r["extra"].get("torch_imported", [])))
            lines.append(
                f"  {r['variant']:<30} {r['median']:.3f} s; import {statistics.median(r['extra']['import_s']):.3f} s, "
                f"dataset + loader {statistics.median(r['extra']['make_s']):.3f} s; "
                + (f"FLAGGED: torch imported in {imported} of {len(r['values'])} runs" if imported else "torch not imported")
            )
    if report.get("stats_overhead"):
        lines.append("")
        lines.append(
            "W1 stats overhead (stoker, stats=True vs stats=False: pairs of epochs back to back, the first of "
            "each pair alternating; median over the pairs of off/on - 1):"
        )
        for entry in report["stats_overhead"]:
            pairs = " ".join(f"{x:+.1%}" for x in entry["per_pair"])
            lines.append(
                f"  w={entry['workers']:<3} on {_fmt_rate(entry['on']):>7}/s  off {_fmt_rate(entry['off']):>7}/s  "
                f"main µs/batch on {_fmt_us(entry['main_us_on'])} off {_fmt_us(entry['main_us_off'])}  "
                f"overhead {entry['overhead']:+.1%}  (pairs: {pairs})"
            )
    auto = report.get("auto") or {}
    if auto.get("note"):
        lines.append("")
        lines.append(auto["note"])
    if auto.get("workloads"):
        lines.append("")
        lines.append(
            'auto (stoker, num_workers="auto", prefetch_factor="auto") vs the best hand-picked stoker epoch '
            "run next to it (one epoch of each worker count, the order alternating), samples/s from iter() "
            "to the end (the choice and start-up included); ratio = median over the blocks:"
        )
        for entry in auto["workloads"]:
            first = ""
            if entry.get("auto_first_s") is not None and entry.get("best_first_s") is not None:
                first = f"; first batch after {entry['auto_first_s'] * 1e3:.0f} ms vs {entry['best_first_s'] * 1e3:.0f} ms"
            lines.append(
                f"  {entry['workload']}  auto {_fmt_rate(entry['auto'])}/s vs {_fmt_rate(entry['best'])}/s at "
                f"w={entry['best_workers']} (medians): {entry['ratio']:.2f}x "
                f"(blocks: {' '.join(f'{v:.2f}' for v in entry.get('per_block', []))}; "
                f"steady state {entry['steady_ratio']:.2f}x){first}; "
                f"chose num_workers {', '.join(map(str, entry['chosen_workers']))}"
            )
            for choice, count in collections.Counter(entry["choices"]).items():
                lines.append(f"      {count}x: {choice}")
    lines.append("")
    lines.append(
        "W1-W4, W7, W8: steady-state samples/s in the middle of one epoch of a fresh loader, and the main "
        "process's CPU time per batch (all its threads, not its workers) over the same window (the JSON "
        "also has iter()-to-end figures, start-up included); W5: seconds to first batch (t = time ratio); "
        "W6 gap: last batch of an epoch to the next epoch's first, in median batch gaps; "
        "W6 cost: E epochs vs one epoch of E times the samples, in batch times."
    )
    short = sorted(
        {
            " ".join(part for part in (r["workload"], r["variant"], f"w={r['workers']}") if part)
            for r in rows
            if 0.0 in r["extra"].get("windowed", [])
        }
    )
    if short:
        lines.append(
            "epochs too short for a steady-state window, rate from iter() to the end instead: "
            + ", ".join(short)
        )
    two = report["machine"].get("memcpy2_gbps")
    lines.append(
        f"memcpy ceiling (one core): {report['machine']['memcpy_gbps']:.1f} GB/s"
        + (f"; two threads at once: {two:.1f} GB/s" if two else "")
    )
    lines.append(environment_line(report["machine"]))
    if report["targets"]:
        lines.append("")
        lines.append(
            "targets (stoker.torch vs torch.utils.data: W1-W6 and W8 at num_workers=2, W7 at each; "
            "W5 torch-free, arena, stats overhead and auto: stoker alone or against itself):"
        )
        for t in report["targets"]:
            label = "INFO  " if t["met"] is None else "MET   " if t["met"] else "MISSED"
            lines.append(f"  {label} {t['target']}: {t['shown']}")
    return "\n".join(lines)


STATS_VARIANTS = ("stats on", "stats off")  # drawn in their own panel, not with the samples/s


def chart(report: dict[str, Any], path: str) -> bool:
    """The report's chart (see `figure`) as a PNG; False when matplotlib is missing or there is
    nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = figure(report)
    if fig is None:
        return False
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def figure(report: dict[str, Any]) -> Any:
    """A matplotlib figure of a report, or None when it has nothing to draw. Top row: samples/s
    per workload and loader (the auto rows in their workload's panel). Bottom row, when
    measured: W1's stats overhead per number of workers (each pair a dot, the median a bar, the
    2 % line), "auto" over the best hand-picked setting per workload (the 0.85 line), and the
    arena in batches per W2/W8 row against its window + 2."""
    import matplotlib.pyplot as plt

    rows = [
        r for r in report["results"]
        if r["unit"] == "samples/s" and r["variant"] not in STATS_VARIANTS and r["variant"] != AUTO_REF
    ]

    def panel(r: dict[str, Any]) -> str:
        return f"{r['workload']} {r['variant']}".strip()

    workloads = sorted({panel(r) for r in rows})
    overhead = report.get("stats_overhead") or []
    auto = (report.get("auto") or {}).get("workloads") or []
    arena = report.get("arena") or []
    below = int(bool(overhead)) + int(bool(auto)) + int(bool(arena))
    if not workloads and not below:
        return None
    columns = max(len(workloads), below, 1)
    fig = plt.figure(figsize=(4 * columns, 3.6 * (int(bool(workloads)) + int(bool(below)))), layout="constrained")
    subfigs = fig.subfigures(int(bool(workloads)) + int(bool(below)), 1, squeeze=False)[:, 0]
    if workloads:
        axes = subfigs[0].subplots(1, len(workloads), squeeze=False)[0]
        for ax, workload in zip(axes, workloads):
            mine = [r for r in rows if panel(r) == workload]
            labels = [f"{r['loader']}\nw={r['workers']}" for r in mine]
            bars = ax.bar(range(len(mine)), [r["median"] for r in mine], color=[_colour(r["loader"]) for r in mine])
            for bar, r in zip(bars, mine):
                if r["workers"] == AUTO:
                    bar.set_hatch("//")
            ax.set_xticks(range(len(mine)), labels, fontsize=6, rotation=90)
            ax.set_title(workload)
            ax.set_ylabel("samples/s")
    if below:
        axes = iter(subfigs[-1].subplots(1, below, squeeze=False)[0])
        if overhead:
            ax = next(axes)
            xs = range(len(overhead))
            ax.bar(xs, [100 * e["overhead"] for e in overhead], color=_colour("stoker"), label="median")
            for x, entry in zip(xs, overhead):
                ax.plot([x] * len(entry["per_pair"]), [100 * v for v in entry["per_pair"]], "k.", markersize=4)
            ax.axhline(100 * STATS_OVERHEAD_MAX, color="#c0392b", linestyle="--", label="target < 2 %")
            ax.axhline(0, color="black", linewidth=0.5)
            ax.set_xticks(xs, [f"w={e['workers']}" for e in overhead])
            ax.set_ylabel("off / on - 1, % (> 0: stats on slower)")
            ax.set_title(f"W1 stats overhead (pairs, median of {overhead[0]['pairs']})")
            ax.legend(fontsize=6)
        if auto:
            ax = next(axes)
            xs = range(len(auto))
            ax.bar(xs, [e["ratio"] for e in auto], color=_colour("stoker"))
            for x, entry in zip(xs, auto):
                chosen = ",".join(map(str, sorted(set(entry["chosen_workers"]))))
                ax.annotate(f"chose w={chosen}\nbest w={entry['best_workers']}", (x, entry["ratio"]),
                            ha="center", va="bottom", fontsize=6)
            ax.axhline(AUTO_VS_BEST_MIN, color="#c0392b", linestyle="--", label=f"target >= {AUTO_VS_BEST_MIN:g}")
            ax.set_xticks(xs, [e["workload"] for e in auto])
            ax.set_ylim(0, max(1.15, *(e["ratio"] * 1.15 for e in auto)))
            ax.set_ylabel("auto / best hand-picked (iter() to end)")
            ax.set_title('num_workers="auto" vs best hand-picked')
            ax.legend(fontsize=6, loc="lower right")
        if arena:
            ax = next(axes)
            xs = range(len(arena))
            ax.bar(xs, [e["batches"] for e in arena], color=_colour("stoker"), label="arena / batch bytes")
            ax.scatter(xs, [e["limit"] for e in arena], color="#c0392b", marker="_", s=400, label="target: window + 2")
            ax.set_xticks(xs, [f"{e['workload']}\nw={e['workers']}" for e in arena])
            ax.set_ylabel("batches")
            ax.set_title("arena at steady state (stoker)")
            ax.legend(fontsize=6, loc="lower right")
    return fig


def _colour(loader: str) -> str:
    return {"stoker": "#e07b39", "stoker.torch": "#c0392b", "torch": "#7f8c8d"}.get(loader, "#333333")


def save_json(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
