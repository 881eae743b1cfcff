"""Feeding JAX: stoker.jax's DataLoader against Grain's two pipelines, same data, same transform, same run.

Two workloads, each through three loaders at 0, 2 and 4 workers, repetitions interleaved (the
loaders' order rotates from one repetition to the next), medians reported:

- `images`, ImageNet-like: a map-style source of uint8 images 256x256x3 read from a memmapped
  .npy (512 distinct images, 100 MB; item i is image i % 512; written once per run under a
  temporary folder), each item a random 224x224 crop and a horizontal flip (probability 1/2)
  in numpy, drawn from the sample's own RNG (`np.random.default_rng((0, index))`), plus an
  int32 label; shuffled, batches of 256 (every loader drops a last partial one).
- `packing`: token documents (int32 ids, lognormal lengths of median 300 tokens, sigma 1.2,
  cut to 1..2,048 so that no packer has to split one), already in a random order (drawn
  i.i.d.), so no loader shuffles them; packed into rows of seq_len 2,048, batches of 32 rows.
  stoker: `stoker.mix.PackedDataset(TokenDataset, seq_len, window_size=K, fields="jax")`
  (best-fit, the default, over windows of K rows; the pieces of a window that do not fit are
  carried to the next; rows of int32 `input_ids`, `segment_ids`, `positions`, `labels` and
  `cu_seqlens` (seq_len + 1), the rows a function of the document stream alone) read in stream
  order by `StreamSampler`. Grain's `MapDataset`: `FirstFitPackIterDataset` (Grain's
  recommended packer, first-fit online over K bins: each document goes into the first bin it
  fits; when it fits none, all K bins are emitted, shuffled (Grain's default
  `shuffle_bins=True`), and packing restarts with it; rows of `tokens`, `tokens_segment_ids`
  and `tokens_positions`: three fields to stoker's five), in each `mp_prefetch` worker over
  its slice of the documents, so Grain's rows depend on its worker count. Grain's
  `DataLoader` packs only with `grain.experimental.PackAndBatchOperation` (deprecated by
  Grain; first-fit into the batch's rows, a batch emitted when a document fits none of them:
  K = the batch size), run in each worker over its share of the documents. K is the batch's
  32 rows for all three (`--bins` changes it for stoker and the MapDataset): with more bins
  than a batch has rows, Grain's packers work in bursts of K rows between which batches come
  from the buffer, and a short epoch times the bursts rather than the packing. Items are rows;
  the table also gives real (non-padding) tokens/s and utilisation, which differ by packer.

The loaders, as their users write them (the user's default environment: no thread variable
is set; each loader's own defaults otherwise, e.g. Grain's 16 read threads per process):

- stoker: `stoker.jax.DataLoader(dataset, batch_size, shuffle=True, generator=0,
  num_workers=N, drop_last=True)` with the default sharding (the batch axis over every device)
  and `device_prefetch=2`; workers started by forkserver (stoker.jax's default).
- Grain DataLoader: `grain.DataLoader(data_source=..., sampler=grain.samplers.IndexSampler(n,
  shuffle=True, num_epochs=1, seed=0), operations=[Map, Batch], worker_count=N)`, each batch
  then `jax.device_put(batch, sharding)` with stoker's sharding. Its workers are spawned.
- Grain MapDataset: `grain.MapDataset.source(src).shuffle(seed=0).map(f).to_iter_dataset()
  .batch(B, drop_remainder=True)`, `.mp_prefetch(MultiprocessingOptions(num_workers=N))` when
  N > 0, then `jax.device_put`. The batch comes after `to_iter_dataset`: before it, Grain's
  read-ahead (500 elements by default) would hold up to 500 batches (19 GB of images).

Per cell (a loader, a workload, a number of workers N):

- items/s: steady: the items of the timed batches over the time from the arrival of the
  batch before them to the arrival of the last of them, batches being left out at both ends
  of the epoch. At the start: one from each worker (then every worker has started; Grain
  starts them one after another, each importing jax, seconds each on a busy 2-core
  machine), then as many as the loader that makes the most ahead may hold made by then
  (stoker: `prefetch_factor` 2 per worker and `device_prefetch` 2; Grain: 3 batches per
  worker, in its output queue, in the main process's buffer for it and being sent, and a
  read-ahead of 500 transformed images per process; for packing Grain reads documents
  ahead, packed after). At the end: as many again (at least 2), what the loaders hand over
  without making more, faster than steady (stoker, placing 2 batches ahead, also runs the
  epoch's end, workers joined and memory given back, before its last two; the JSON has the
  time from the last timed batch to the end as `end_s`). At 0, 2 and 4 workers: 3 + 2, 12 +
  10 and 24 + 20 image batches, 3 + 2, 8 + 6 and 16 + 12 packing batches. The timed batches
  are whole rounds of the workers (a multiple of N: the workers make their batches in step,
  so they arrive in bursts of N, and a window of part of a burst times one too many or too
  few). Each image epoch is its untimed batches and 8 timed ones (so its length grows with
  N); the packing epoch is the 5,000 documents' rows (about 38 batches). Every batch is on
  the devices when counted (the loop calls `jax.block_until_ready` on it, as a step that
  uses it would wait for it).
- from 1st: items/s from the first batch's arrival (to the same end), as issue 46 words it:
  it counts the other workers' start (against the loader) and the batches made ahead
  meanwhile (for it);
- 1st batch s: from building the loader (for packing, stoker's `PackedDataset` too: it packs
  the epoch's lengths when built) to the first batch on the devices (Grain's spawned workers
  import jax again; stoker's forkserver workers import no jax); warm s: to the max(1, N)-th
  batch, when every worker has delivered one;
- CPU/batch: `time.process_time()` of the consuming process over the timed batches, per batch.
  `process_time` counts every thread of the process (the loader's threads, JAX's transfer
  threads, Grain's read threads when N = 0), not the workers: that is "main-process CPU"
  here, the CPU the training process loses to its input pipeline.
- packing also: real tokens/s (from each batch's segment ids, counted by the loop for every
  loader alike) and utilisation (real tokens over row tokens).

Ratios are stoker / Grain DataLoader and stoker / Grain MapDataset at each N: over 1 is stoker
faster for items/s; under 1 is stoker cheaper for CPU/batch. The goal of issue 46, printed
with whether it is met: at 2 workers, stoker's items/s at least 2x each Grain pipeline's, and
its CPU per batch at most theirs. A measurement that raises is its cell's error (type and a
note number, the first line under the table). The machine's cores are printed: 4 workers on
2 cores are oversubscribed, and those rows say what such a machine gives.

JAX runs on its default backend: on a machine without an accelerator, one CPU device, as a
user's laptop or CPU host; `--devices N` sets `XLA_FLAGS=--xla_force_host_platform_device_count=N`
for a mesh of N CPU devices (the header says which). Unmeasured here: the feed into a jitted
step on an accelerator.

Results go to stdout and `bench-results/jax_feed.json` (`--out`).
Run: `python benchmarks/jax_feed.py [--quick] [--workers 0,2,4] [--repeats 3] [--devices N]`
(also run by `make bench`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

WORKLOADS = ("images", "packing")
LOADERS = ("stoker", "grain DataLoader", "grain MapDataset")
GRAIN = LOADERS[1:]
SIDE, CROP = 256, 224
SEQ_LEN = 2048
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XLA_FLAGS")
GOAL_WORKERS = 2


@dataclass
class Sizes:
    """How much each measurement runs; `--quick` makes every figure from a tiny run."""

    image_window: int  # image batches timed after the untimed ones (see `untimed`)
    image_batch: int
    pool: int  # distinct images in the memmapped file
    documents: int  # token documents of the packing epoch
    rows_batch: int
    bins: int  # K: stoker's window of rows, Grain MapDataset's packing bins
    repeats: int
    stock: bool  # leave out of the timing the batches the loaders may have made ahead


# What the loaders make ahead by default. stoker: `prefetch_factor` batches per worker and
# `device_prefetch` placed. Grain, per worker: its output queue (`per_worker_buffer_size` 1,
# or the DataLoader's `worker_buffer_size` 1), the main process's buffer for that worker (1)
# and the batch being sent; and per process its read-ahead (`ReadOptions.prefetch_buffer_size`
# elements: transformed images; for packing, documents that are packed after it).
STOKER_AHEAD = 2
GRAIN_AHEAD_PER_WORKER = 3
GRAIN_READ_AHEAD = 500
# The last batches are not timed either: the loaders hand over what they made ahead without
# making more (faster than steady), and the epoch's end (workers joined, shared memory given
# back) is a cost per epoch, which stoker, placing 2 batches ahead, runs before it hands over
# its last two.
TAIL = STOKER_AHEAD


def ahead(workload: str, workers: int, batch: int) -> int:
    """Batches that the loader that makes the most ahead may hold made at once."""
    stoker = STOKER_AHEAD * workers + STOKER_AHEAD
    grain = GRAIN_AHEAD_PER_WORKER * workers
    if workload == "images":
        grain += -(-max(1, workers) * GRAIN_READ_AHEAD // batch)
    return max(stoker, grain)


def _rounds(batches: int, workers: int) -> int:
    """`batches` rounded up to whole rounds of the workers (a multiple of max(1, workers))."""
    return -(-batches // max(1, workers)) * max(1, workers)


def untimed(workload: str, workers: int, batch: int, stock: bool) -> tuple[int, int]:
    """Batches left out of the steady timing, (at the start, at the end), in whole rounds of
    the workers. At the start: one from each worker (all have started), then (`stock`) as
    many as the loaders may hold made ahead, so that the timed batches are made while timed,
    not drawn from a stock filled during the start. At the end: as many again (or TAIL), the
    stock they hand over without making more."""
    warm = max(1, workers)
    if not stock:
        return warm, TAIL
    made = ahead(workload, workers, batch)
    return _rounds(warm + made, workers), _rounds(max(TAIL, made), workers)


def image_items(workers: int, sizes: Sizes) -> int:
    """The image epoch at `workers` workers: the untimed batches and `image_window` timed ones."""
    start, end = untimed("images", workers, sizes.image_batch, sizes.stock)
    return (start + sizes.image_window + end) * sizes.image_batch


FULL = Sizes(image_window=8, image_batch=256, pool=512, documents=5000, rows_batch=32, bins=32, repeats=3, stock=True)
QUICK = Sizes(image_window=4, image_batch=16, pool=16, documents=600, rows_batch=8, bins=8, repeats=1, stock=False)


# -- the data, the same for every loader ----------------------------------------------------------


class ImageSource:
    """Item i: {"image": image i % pool of the memmapped (pool, 256, 256, 3) uint8 .npy,
    "index": i}. The file is opened lazily in each process (pickles as its path)."""

    def __init__(self, path: str, items: int) -> None:
        self.path, self.items = path, items
        self._array: np.ndarray | None = None

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._array is None:
            self._array = np.load(self.path, mmap_mode="r")
        index = int(index)
        return {"image": self._array[index % len(self._array)], "index": index}

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "items": self.items, "_array": None}


def crop_flip(element: dict[str, Any]) -> dict[str, Any]:
    """A random 224 crop and a horizontal flip (p = 1/2), from the sample's own RNG."""
    rng = np.random.default_rng((0, element["index"]))
    top, left = rng.integers(0, SIDE - CROP + 1, size=2)
    image = element["image"][top : top + CROP, left : left + CROP]
    if rng.random() < 0.5:
        image = image[:, ::-1]
    return {"image": np.ascontiguousarray(image), "label": np.int32(element["index"] % 1000)}


class StokerImages:
    """The map-style dataset stoker reads: the source's item i, cropped and flipped."""

    def __init__(self, source: ImageSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return crop_flip(self.source[index])


class DocumentSource:
    """Item i: {"tokens": document i} (int32) of a concatenation and its offsets."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray) -> None:
        self.tokens, self.offsets = tokens, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        return {"tokens": self.tokens[self.offsets[index] : self.offsets[index + 1]]}


def make_images(folder: str, pool: int) -> str:
    path = os.path.join(folder, "images.npy")
    images = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(pool, SIDE, SIDE, 3))
    rng = np.random.default_rng(0)
    for i in range(pool):
        images[i] = rng.integers(0, 256, size=(SIDE, SIDE, 3), dtype=np.uint8)
    images.flush()
    del images
    return path


def make_documents(count: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    lengths = np.clip(np.rint(rng.lognormal(np.log(300), 1.2, count)), 1, SEQ_LEN).astype(np.int64)
    offsets = np.zeros(count + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(1, 32000, size=int(offsets[-1]), dtype=np.int32)
    return tokens, offsets


# -- Grain's transform: a subclass of Grain's Map, made on first use ------------------------------


def __getattr__(name: str) -> Any:
    # `import grain` imports jax, which must come after --devices has set XLA_FLAGS, so Grain's
    # subclass is made when first asked for, here and in Grain's spawned workers (which
    # unpickle it by name from this module).
    if name == "GrainCropFlip":
        import grain

        class GrainCropFlip(grain.transforms.Map):
            """crop_flip as Grain's Map transform."""

            def map(self, element: dict[str, Any]) -> dict[str, Any]:
                return crop_flip(element)

        GrainCropFlip.__module__ = __name__
        globals()[name] = GrainCropFlip
        return GrainCropFlip
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- the loaders -----------------------------------------------------------------------------------


@dataclass
class Data:
    """What every loader reads in this run."""

    image_path: str
    tokens: np.ndarray
    offsets: np.ndarray
    sizes: Sizes


@dataclass
class Pipeline:
    """One loader over one workload: an iterator of batches, what puts a batch on the devices,
    the rows of a batch, the real tokens of a batch (packing), and the items its epoch gives."""

    batches: Iterator[Any]
    place: Callable[[Any], Any]
    rows: Callable[[Any], int]
    real_tokens: Callable[[Any], int] | None


def _nonzero(array: Any) -> int:
    return int(np.count_nonzero(np.asarray(array)))


def stoker_pipeline(workload: str, workers: int, data: Data) -> Pipeline:
    from stoker.jax import DataLoader

    s = data.sizes
    if workload == "images":
        dataset: Any = StokerImages(ImageSource(data.image_path, image_items(workers, s)))
        loader = DataLoader(
            dataset, batch_size=s.image_batch, shuffle=True, generator=0, num_workers=workers, drop_last=True
        )
        return Pipeline(iter(loader), lambda b: b, lambda b: int(b["image"].shape[0]), None)
    from stoker.mix import PackedDataset, StreamSampler, TokenDataset

    rows = PackedDataset(TokenDataset(data.tokens, data.offsets), SEQ_LEN, window_size=s.bins, fields="jax")
    loader = DataLoader(rows, batch_size=s.rows_batch, sampler=StreamSampler(rows), num_workers=workers, drop_last=True)
    return Pipeline(
        iter(loader), lambda b: b, lambda b: int(b["input_ids"].shape[0]), lambda b: _nonzero(b["segment_ids"])
    )


def _device_put(sharding: Any) -> Callable[[Any], Any]:
    import jax

    return lambda batch: jax.device_put(batch, sharding)


def grain_pipeline(loader: str, workload: str, workers: int, data: Data, sharding: Any) -> Pipeline:
    import grain
    import grain.experimental as ge

    s = data.sizes
    place = _device_put(sharding)
    if workload == "images":
        source: Any = ImageSource(data.image_path, image_items(workers, s))
        rows: Callable[[Any], int] = lambda b: int(b["image"].shape[0])  # noqa: E731
        if loader == "grain DataLoader":
            dl = grain.DataLoader(
                data_source=source,
                sampler=grain.samplers.IndexSampler(len(source), shuffle=True, num_epochs=1, seed=0),
                operations=[__getattr__("GrainCropFlip")(), grain.transforms.Batch(s.image_batch, drop_remainder=True)],
                worker_count=workers,
            )
            return Pipeline(iter(dl), place, rows, None)
        ds = (
            grain.MapDataset.source(source)
            .shuffle(seed=0)
            .map(__getattr__("GrainCropFlip")())
            .to_iter_dataset()
            .batch(s.image_batch, drop_remainder=True)
        )
        if workers:
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        return Pipeline(iter(ds), place, rows, None)
    docs = DocumentSource(data.tokens, data.offsets)
    if loader == "grain DataLoader":
        dl = grain.DataLoader(
            data_source=docs,
            sampler=grain.samplers.IndexSampler(len(docs), shuffle=False, num_epochs=1, seed=0),
            operations=[ge.PackAndBatchOperation(length_struct={"tokens": SEQ_LEN}, batch_size=s.rows_batch)],
            worker_count=workers,
        )
        # batches are (data, segment ids, positions), each {"tokens": (B, seq_len)}
        return Pipeline(iter(dl), place, lambda b: int(b[0]["tokens"].shape[0]), lambda b: _nonzero(b[1]["tokens"]))
    ds = ge.FirstFitPackIterDataset(
        grain.MapDataset.source(docs).to_iter_dataset(), length_struct={"tokens": SEQ_LEN}, num_packing_bins=s.bins
    ).batch(s.rows_batch, drop_remainder=True)
    if workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return Pipeline(iter(ds), place, lambda b: int(b["tokens"].shape[0]), lambda b: _nonzero(b["tokens_segment_ids"]))


def describe(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _close(iterator: Any) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def measure(loader: str, workload: str, workers: int, data: Data, sharding: Any) -> dict[str, Any]:
    """One epoch of one loader: the figures of a cell, or {"error": ...} when it raises."""
    import jax

    pipeline: Pipeline | None = None
    try:
        gc.collect()
        start = time.perf_counter()
        if loader == "stoker":
            pipeline = stoker_pipeline(workload, workers, data)
        else:
            pipeline = grain_pipeline(loader, workload, workers, data, sharding)
        arrivals: list[tuple[float, float, int, int]] = []  # (time, CPU, items, real tokens) so far
        items = tokens = 0
        for host in pipeline.batches:
            batch = jax.block_until_ready(pipeline.place(host))
            del host
            items += pipeline.rows(batch)
            if pipeline.real_tokens:
                tokens += pipeline.real_tokens(batch)
            del batch
            arrivals.append((time.perf_counter(), time.process_time(), items, tokens))
        warm = max(1, workers)  # one batch from each worker: every worker has started
        batch = data.sizes.image_batch if workload == "images" else data.sizes.rows_batch
        skip, tail = untimed(workload, workers, batch, data.sizes.stock)
        finished = time.perf_counter()
        # whole rounds of the workers: they make their batches in step, so batches arrive in
        # bursts of N, and a window that is not a whole number of bursts times one burst too many or too few
        timed = (len(arrivals) - skip - tail) // warm * warm
        if timed < 1:
            raise RuntimeError(
                f"the epoch gave {len(arrivals)} batches: none to time after the first {skip} and before the last {tail}"
            )
        end, cpu_end, items_end, tokens_end = arrivals[skip - 1 + timed]
        at, cpu_at, items_at, tokens_at = arrivals[skip - 1]
        first_at, _, first_items, _ = arrivals[0]
        figures = {
            "items_per_s": (items_end - items_at) / (end - at),
            "items_per_s_from_first": (items_end - first_items) / (end - first_at),
            "first_batch_s": first_at - start,
            "warm_s": arrivals[warm - 1][0] - start,
            "cpu_ms_per_batch": (cpu_end - cpu_at) * 1e3 / timed,
            "end_s": finished - end,  # the untimed last batches and the epoch's end
            "items": items,
            "timed_batches": timed,
        }
        if pipeline.real_tokens:
            figures["tokens_per_s"] = (tokens_end - tokens_at) / (end - at)
            figures["utilisation"] = tokens / (items * SEQ_LEN)
        return figures
    except Exception as error:
        return {"error": describe(error)}
    finally:
        if pipeline is not None:
            _close(pipeline.batches)
        del pipeline
        gc.collect()


# -- the run ------------------------------------------------------------------------------------


def machine(jax: Any) -> dict[str, Any]:
    import grain

    import stoker

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "os_cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "python": sys.version.split()[0],
        "stoker": stoker.__version__,
        "jax": jax.__version__,
        "grain": getattr(grain, "__version__", "?"),
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        **{name: os.environ.get(name, "unset") for name in THREAD_VARIABLES},
    }


def run(sizes: Sizes, workers_list: list[int], workloads: list[str]) -> dict[str, Any]:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    # stoker.jax.DataLoader's default: the batch axis over every device of a 1-D mesh "data"
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    raw: dict[str, list[dict[str, Any]]] = {}
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="jax_feed_") as folder:
        tokens, offsets = make_documents(sizes.documents)
        data = Data(make_images(folder, sizes.pool), tokens, offsets, sizes)
        turn = 0
        for _ in range(sizes.repeats):
            for workload in workloads:
                for workers in workers_list:
                    order = LOADERS[turn % 3 :] + LOADERS[: turn % 3]
                    turn += 1
                    for loader in order:
                        key = f"{workload}|{workers}|{loader}"
                        began = time.perf_counter()
                        figures = measure(loader, workload, workers, data, sharding)
                        raw.setdefault(key, []).append(figures)
                        shown = figures.get("error") or f"{figures['items_per_s']:,.0f} items/s"
                        print(f"  {key}: {shown} ({time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)
    report = summarise(raw, workloads, workers_list)
    report.update(machine=machine(jax), sizes=asdict(sizes), workers=workers_list, workloads=workloads)
    report["machine"]["load_average_1min_before"] = load_before
    return report


def summarise(raw: dict[str, list[dict[str, Any]]], workloads: list[str], workers_list: list[int]) -> dict[str, Any]:
    """Medians per cell (or its first error), ratios and the goal, in the report's JSON shape."""
    cells: list[dict[str, Any]] = []
    for workload in workloads:
        for workers in workers_list:
            row: dict[str, Any] = {"workload": workload, "workers": workers}
            for loader in LOADERS:
                runs = raw[f"{workload}|{workers}|{loader}"]
                error = next((r["error"] for r in runs if "error" in r), None)
                if error:
                    row[loader] = {"error": error}
                    continue
                row[loader] = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "items"}
                row[loader]["items"] = runs[0]["items"]
                row[loader]["per_rep_items_per_s"] = [r["items_per_s"] for r in runs]
                row[loader]["per_rep_cpu_ms_per_batch"] = [r["cpu_ms_per_batch"] for r in runs]
            for grain_loader in GRAIN:
                row[f"stoker / {grain_loader}"] = {
                    key: _ratio(row["stoker"], row[grain_loader], key)
                    for key in ("items_per_s", "cpu_ms_per_batch", "tokens_per_s")
                    if workload == "packing" or key != "tokens_per_s"
                }
            cells.append(row)
    goal = []
    for row in cells:
        if row["workers"] != GOAL_WORKERS:
            continue
        for grain_loader in GRAIN:
            ratios = row[f"stoker / {grain_loader}"]
            speed, cpu = ratios["items_per_s"], ratios["cpu_ms_per_batch"]
            goal.append(
                {
                    "workload": row["workload"],
                    "against": grain_loader,
                    "items_per_s_ratio": speed,
                    "cpu_ratio": cpu,
                    "met": speed is not None and cpu is not None and speed >= 2.0 and cpu <= 1.0,
                }
            )
    return {"cells": cells, "goal": goal}


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    if key in a and key in b and b[key]:
        return float(a[key] / b[key])
    return None


# -- the report -----------------------------------------------------------------------------------


class Notes:
    """Errors shown in cells as `Type [k]`, listed under the tables with their first line."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def cell(self, error: str) -> str:
        if error not in self.lines:
            self.lines.append(error)
        return f"{error.split(':', 1)[0]} [{self.lines.index(error) + 1}]"


def _table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print(f"\n{title}")
    line = "  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


FIGURES = {
    "images": (
        ("items_per_s", ",.0f"),
        ("items_per_s_from_first", ",.0f"),
        ("first_batch_s", ".2f"),
        ("warm_s", ".2f"),
        ("cpu_ms_per_batch", ".2f"),
    ),
    "packing": (
        ("items_per_s", ",.0f"),
        ("items_per_s_from_first", ",.0f"),
        ("first_batch_s", ".2f"),
        ("warm_s", ".2f"),
        ("cpu_ms_per_batch", ".2f"),
        ("tokens_per_s", ",.0f"),
        ("utilisation", ".1%"),
    ),
}
HEADERS = {
    "images": ("items/s", "from 1st", "1st batch s", "warm s", "CPU ms/batch"),
    "packing": ("rows/s", "from 1st", "1st batch s", "warm s", "CPU ms/batch", "tokens/s", "utilisation"),
}
RATIOS = {"images": ("items_per_s", "cpu_ms_per_batch"), "packing": ("items_per_s", "tokens_per_s", "cpu_ms_per_batch")}
HEADER_OF = {"items_per_s": "items/s", "tokens_per_s": "tokens/s", "cpu_ms_per_batch": "CPU"}


def print_report(report: dict[str, Any]) -> None:
    m, s = report["machine"], report["sizes"]
    print("Feeding JAX: stoker.jax.DataLoader against grain.DataLoader and grain.MapDataset (+ jax.device_put)")
    print(
        f"stoker {m['stoker']}, jax {m['jax']} ({m['backend']}, {m['devices']} device(s)), grain {m['grain']}, "
        f"python {m['python']}; os.cpu_count() = {m['os_cpu_count']}, usable CPUs {m['usable_cpus']}; "
        + ", ".join(f"{v}={m[v]}" for v in THREAD_VARIABLES)
    )
    if m.get("load_average_1min") is not None:
        print(
            f"load average (1 min) {m['load_average_1min_before']:.1f} before the run, {m['load_average_1min']:.1f} "
            "after: other processes share these CPUs when it is above 0"
        )
    over = [w for w in report["workers"] if w > (m["usable_cpus"] or 1)]
    if over:
        print(
            f"NOTE: {', '.join(map(str, over))} workers on {m['usable_cpus']} usable CPUs are oversubscribed: "
            "those rows say what this machine gives, not what as many cores would"
        )
    notes = Notes()

    def show(figures: dict[str, Any], key: str, fmt: str) -> str:
        if "error" in figures:
            return notes.cell(figures["error"])
        return format(figures[key], fmt) if key in figures else "-"

    def ratio(value: float | None, *cells: dict[str, Any]) -> str:
        if value is not None:
            return f"{value:.2f}x"
        error = next((c["error"] for c in cells if "error" in c), None)
        return notes.cell(error) if error else "n/a"  # n/a: a figure of zero (none measured)

    for workload in report["workloads"]:
        rows = []
        for row in report["cells"]:
            if row["workload"] != workload:
                continue
            for n in LOADERS:
                line = [str(row["workers"]), n]
                line += [show(row[n], key, fmt) for key, fmt in FIGURES[workload]]
                if n == "stoker":
                    line += ["base"] * len(RATIOS[workload])
                else:
                    ratios = row[f"stoker / {n}"]
                    line += [ratio(ratios[key], row["stoker"], row[n]) for key in RATIOS[workload]]
                rows.append(line)
        headers = ["N", "loader", *HEADERS[workload]]
        headers += [f"stoker / this: {HEADER_OF[key]}" for key in RATIOS[workload]]
        if workload == "images":
            sizes = Sizes(**s)
            epochs = ", ".join(str(image_items(n, sizes) // sizes.image_batch) for n in report["workers"])
            what = (
                f"images: 256x256x3 uint8 -> 224 crop + flip, batch {s['image_batch']}, epochs of {epochs} batches, "
                f"the last {s['image_window']} timed"
            )
        else:
            what = (
                f"packing: {s['documents']:,} documents into rows of {SEQ_LEN} (items are rows), batch "
                f"{s['rows_batch']} rows, K = {s['bins']}; tokens/s: real (non-padding) tokens"
            )
        _table(
            f"{what}; N workers; median of {s['repeats']}; stoker / this: over 1 is stoker faster (items/s, "
            "tokens/s), under 1 is stoker cheaper (CPU)",
            headers,
            rows,
        )
    print(
        f"\ngoal (issue 46): at {GOAL_WORKERS} workers, stoker's items/s >= 2x Grain's and its main-process "
        "CPU per batch <= Grain's"
    )
    if not report["goal"]:
        print(f"  not measured: {GOAL_WORKERS} workers are not among --workers {report['workers']}")
    for g in report["goal"]:
        print(
            f"  {g['workload']:8} vs {g['against']:16}: items/s {ratio(g['items_per_s_ratio'])}, "
            f"CPU/batch {ratio(g['cpu_ratio'])}: {'met' if g['met'] else 'NOT met'}"
        )
    if notes.lines:
        print("\nerrors:")
        for k, text in enumerate(notes.lines, 1):
            print(f"[{k}] {text if len(text) <= 300 else text[:297] + '...'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (a smoke test)")
    parser.add_argument("--workers", default="0,2,4", help="numbers of workers, comma-separated (default 0,2,4)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per cell (default 3; 1 with --quick)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="images,packing (default both)")
    parser.add_argument(
        "--bins",
        type=int,
        default=None,
        help="K: stoker's window of rows and Grain MapDataset's bins (default: the batch's rows)",
    )
    parser.add_argument(
        "--devices", type=int, default=None, help="N CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N)"
    )
    parser.add_argument("--out", default="bench-results/jax_feed.json")
    args = parser.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    workloads = [w for w in args.workloads.split(",") if w]
    if any(w not in WORKLOADS for w in workloads):
        parser.error(f"--workloads should name some of {WORKLOADS}, but got {args.workloads!r}")
    sizes = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error(f"--repeats should be >= 1, but got {args.repeats}")
        sizes = Sizes(**{**asdict(sizes), "repeats": args.repeats})
    if args.bins is not None:
        sizes = Sizes(**{**asdict(sizes), "bins": args.bins})
    if args.devices is not None:
        if "jax" in sys.modules:
            raise RuntimeError("--devices must be set before jax is imported: run the script in a fresh process")
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    from absl import flags as absl_flags

    absl_flags.FLAGS.mark_as_parsed()  # Grain's DataLoader with workers reads absl flags
    started = time.perf_counter()
    report = run(sizes, workers, workloads)
    report["quick"] = args.quick
    report["wall_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"\nwall time {report['wall_s']:.0f} s; wrote {out}")
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
