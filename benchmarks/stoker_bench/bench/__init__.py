"""`stoker-bench`: standard synthetic workloads through stoker and torch.utils.data.

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

The package, one concern per module (imports point down this list): `workloads` (datasets,
epoch sizes, the loaders compared), `machine` (memcpy ceilings, the environment), `measure`
(how one run is timed), `results` (result rows, derived figures and targets), `runner` (the
plan's jobs, run interleaved), `report` (the table, the JSON) and `chart` (the PNG). This
module re-exports what the CLI, the other benches and the tests use.
"""

from __future__ import annotations

from .chart import chart, figure
from .machine import environment, environment_line, memcpy_gbps, memcpy_threads_gbps
from .measure import (
    Chosen,
    EpochTiming,
    _batch_len,
    _epoch_rate,
    arena_bytes,
    pair_overhead,
    pairs_per_rep,
    steady_rate,
    steady_window,
    torch_free_first_batch,
    us_per_batch,
    w5_methods,
    window_rate,
)
from .report import save_json, table
from .results import (
    AUTO,
    AUTO_REF,
    Result,
    arena_use,
    auto_vs_best,
    stats_overhead,
    targets,
    w3_scaling,
)
from .runner import AUTO_BLOCKS, Plan, _jobs, auto_unsupported, run
from .workloads import (
    IMAGE_BYTES,
    IMAGE_SHAPE,
    W7_BATCH_SIZES,
    W7_CROP,
    W7_PREFETCH,
    ImageNetCrops,
    Images,
    LargeImages,
    Sizes,
    w7_batches,
    w7_sources,
    w8_images,
    w8_samples,
)

__all__ = [
    "AUTO",
    "AUTO_BLOCKS",
    "AUTO_REF",
    "IMAGE_BYTES",
    "IMAGE_SHAPE",
    "W7_BATCH_SIZES",
    "W7_CROP",
    "W7_PREFETCH",
    "Chosen",
    "EpochTiming",
    "ImageNetCrops",
    "Images",
    "LargeImages",
    "Plan",
    "Result",
    "Sizes",
    "_batch_len",
    "_epoch_rate",
    "_jobs",
    "arena_bytes",
    "arena_use",
    "auto_unsupported",
    "auto_vs_best",
    "chart",
    "environment",
    "environment_line",
    "figure",
    "memcpy_gbps",
    "memcpy_threads_gbps",
    "pair_overhead",
    "pairs_per_rep",
    "run",
    "save_json",
    "stats_overhead",
    "steady_rate",
    "steady_window",
    "table",
    "targets",
    "torch_free_first_batch",
    "us_per_batch",
    "w3_scaling",
    "w5_methods",
    "w7_batches",
    "w7_sources",
    "w8_images",
    "w8_samples",
    "window_rate",
]
