"""`stoker doctor MODULE:FACTORY`: is the data loader the bottleneck, and how should it be set?

The factory returns a dataset or a DataLoader (stoker's, stoker.torch's or torch's). The
doctor measures, within a time budget planned up front:

    profile      dataset[i] in this process over a spread of indices, collate, batch bytes
    headroom     the rate of a "free" loader: a few cached batches replayed to a consumer
    sweep        num_workers 0..usable CPUs x processes/threads, then prefetch factors at
                 the best count: steady-state samples/s, time to first batch, and per
                 worker process USS/PSS (/proc/<pid>/smaps_rollup) after the first batch
                 and at the end of the run
    readiness    with --step-ms: the recommended configuration behind a consumer that
                 sleeps one model step per batch; the fraction of time it did not wait
    traps        Python object containers under fork, global RNGs drawn in __getitem__,
                 a small /dev/shm, CUDA initialised before fork, more workers than CPUs

Every configuration runs through stoker (`stoker.torch.DataLoader` for torch loaders and
torch tensors, `stoker.DataLoader` otherwise) with an endless copy of the user's sampler, so
that no epoch boundary lands inside a measuring window; each iterator is closed before the
next configuration starts, so no worker outlives its row. The parts are separate: loading
the target (`load_target`, `Target`), measuring (`profile_fetch`, `replay_rate`,
`measure_config`, `measure_readiness`), choosing (`choose`), the traps (`find_traps`) and
rendering (`render`, `plot`, `to_json`); `run` plans the budget and ties them together.

The package, one concern per module (imports point down this list): `target` (loading and
describing the target, `Config`), `probe` (the profile in this process, the headroom),
`memory` (worker processes and their memory), `measure` (one configuration, readiness),
`traps`, `sweep` (the budget, the sweep, choosing, `run` and its `Report`), `report` (the
text and the JSON), `plot` (the chart) and `cli` (the `stoker` command). This module re-exports
what the tests use, each name imported on first use: the `stoker` command imports this package
(its module is here), and `stoker --help` needs none of the measuring code, which imports the
loader and numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    name: module
    for module, names in {
        ".measure": (
            "Readiness", "Row", "expected_readiness", "loop_rate", "measure_config", "measure_readiness",
            "row_readiness", "steady_rate",
        ),
        ".memory": ("descendants", "smaps_memory"),
        ".probe": ("MeasureError", "Profile", "batch_len", "profile_fetch", "replay_rate", "touch"),
        ".report": ("recommend_line", "render", "save_json", "table", "to_json"),
        ".sweep": ("Report", "choose", "first_configs", "prefetch_configs", "run", "worker_counts"),
        ".target": ("Config", "DoctorError", "Target", "describe_target", "load_target"),
        ".traps": ("Container", "Trap", "find_traps", "python_containers"),
    }.items()
    for name in names
}

if TYPE_CHECKING:
    from .measure import (
        Readiness,
        Row,
        expected_readiness,
        loop_rate,
        measure_config,
        measure_readiness,
        row_readiness,
        steady_rate,
    )
    from .memory import descendants, smaps_memory
    from .probe import MeasureError, Profile, batch_len, profile_fetch, replay_rate, touch
    from .report import recommend_line, render, save_json, table, to_json
    from .sweep import Report, choose, first_configs, prefetch_configs, run, worker_counts
    from .target import Config, DoctorError, Target, describe_target, load_target
    from .traps import Container, Trap, find_traps, python_containers


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


# `plot` (the function) is not re-exported: its name is its module's (`from .plot import plot`)
__all__ = [
    "Config", "Container", "DoctorError", "MeasureError", "Profile", "Readiness", "Report", "Row",
    "Target", "Trap", "batch_len", "choose", "describe_target", "descendants", "expected_readiness",
    "find_traps", "first_configs", "load_target", "loop_rate", "measure_config", "measure_readiness",
    "prefetch_configs", "profile_fetch", "python_containers", "recommend_line", "render",
    "replay_rate", "row_readiness", "run", "save_json", "smaps_memory", "steady_rate", "table",
    "to_json", "touch", "worker_counts",
]
