"""W10 and W11 of `stoker-bench`: start-up per worker count, and many small batches.

W10: a fresh loader's `iter()` and its first batch, at each worker count (1, 2, 4, 8 unless
given) and start method (fork, forkserver, spawn), for stoker.torch and torch.utils.data
side by side, repetitions interleaved, medians. Each loader is new, so every row pays what a
validation loader, a non-persistent epoch or a short job pays. A least-squares line through
(workers, iter() + first batch) gives a cost per worker and what 14 and 64 workers would cost
on this machine (a fit, not a measurement: a machine with fewer cores than workers also pays
for the workers' own start-up competing with the main process).

W11: small map-style samples, `{"x": i, "y": float(i)}`, batch 256, 200,000 samples, at 0
and 2 workers: samples/s and the main process's CPU per batch over the whole epoch, the two
loaders interleaved.

The datasets are module-level classes so that spawn and forkserver workers can import them.
"""

from __future__ import annotations

import gc
import importlib
import json
import multiprocessing
import os
import resource
import statistics
import sys
import time
import warnings
from typing import Any

START_WORKERS = (1, 2, 4, 8)
METHODS = ("fork", "forkserver", "spawn")
LOADERS = ("torch", "stoker.torch")
SMALL_SAMPLES = 200_000
SMALL_BATCH = 256
SMALL_WORKERS = (0, 2)


class SmallDicts:
    """`{"x": i, "y": float(i)}` for i in range(n)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": i, "y": float(i)}


def _settle(limit_s: float = 5.0) -> None:
    """Wait until the workers of the previous run have exited (both loaders let a worker
    finish exiting after their shutdown returns): its exit must not run beside the next row."""
    deadline = time.monotonic() + limit_s
    me = str(os.getpid())
    keep = _helpers()
    while time.monotonic() < deadline:
        multiprocessing.active_children()  # reaps those multiprocessing started
        alive = False
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
            if entry.isdigit() and int(entry) not in keep:
                try:
                    with open(f"/proc/{entry}/stat", "rb") as stat:
                        fields = stat.read().rsplit(b")", 1)[1].split()
                except OSError:
                    continue
                if fields[1].decode() == me and fields[0] not in (b"Z", b"X"):
                    alive = True
                    break
        if not alive:
            return
        time.sleep(0.005)


def _helpers() -> set[int]:
    """The pids of multiprocessing's long-lived helpers (the forkserver, the resource
    tracker): children that stay."""
    pids = set()
    for module_name, holder, attribute in (
        ("multiprocessing.forkserver", "_forkserver", "_forkserver_pid"),
        ("multiprocessing.resource_tracker", "_resource_tracker", "_pid"),
    ):
        module = sys.modules.get(module_name)
        pid = getattr(getattr(module, holder, None), attribute, None)
        if isinstance(pid, int):
            pids.add(pid)
    return pids


def _module(loader: str) -> Any:
    return importlib.import_module("stoker.torch" if loader == "stoker.torch" else "torch.utils.data")


def start_once(loader: str, method: str, workers: int) -> tuple[float, float]:
    """(iter() ms, iter() to the first batch ms) of a fresh loader, its workers shut down after."""
    module = _module(loader)
    context = multiprocessing.get_context(method)
    data = module.DataLoader(
        SmallDicts(SMALL_BATCH * workers * 4),
        batch_size=SMALL_BATCH,
        num_workers=workers,
        multiprocessing_context=context,
    )
    gc.collect()
    _settle()
    started = time.perf_counter()
    iterator = iter(data)
    made = time.perf_counter()
    next(iterator)
    first = time.perf_counter()
    del iterator, data
    gc.collect()
    return 1000 * (made - started), 1000 * (first - started)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept ms, ms per worker) of the least-squares line through (workers, ms)."""
    xs = [float(x) for x, _ in points]
    ys = [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return mean_y - slope * mean_x, slope


def startup(workers: list[int], methods: list[str], reps: int) -> dict[str, Any]:
    """W10: every (method, workers, loader), repetitions interleaved."""
    measured: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "more workers than CPUs" advice
        for _ in range(reps):
            for method in methods:
                for count in workers:
                    for loader in LOADERS:
                        measured.setdefault((method, count, loader), []).append(start_once(loader, method, count))
    rows: list[dict[str, Any]] = [
        {
            "method": method,
            "workers": count,
            "loader": loader,
            "iter_ms": statistics.median(v[0] for v in values),
            "first_batch_ms": statistics.median(v[1] for v in values),
            "all": values,
        }
        for (method, count, loader), values in measured.items()
    ]
    fits = []
    for method in methods:
        for loader in LOADERS:
            points = [
                (r["workers"], r["first_batch_ms"]) for r in rows if r["method"] == method and r["loader"] == loader
            ]
            if len({x for x, _ in points}) >= 2:
                intercept, slope = fit(points)
                fits.append(
                    {
                        "method": method,
                        "loader": loader,
                        "intercept_ms": intercept,
                        "ms_per_worker": slope,
                        "at_14_ms": intercept + 14 * slope,
                        "at_64_ms": intercept + 64 * slope,
                    }
                )
    return {"reps": reps, "cpus": os.cpu_count(), "rows": rows, "fits": fits}


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def small_epoch(loader: str, workers: int, samples: int) -> tuple[float, float]:
    """(samples/s, main process CPU µs per batch) of one epoch of a fresh loader, start-up included."""
    module = _module(loader)
    data = module.DataLoader(SmallDicts(samples), batch_size=SMALL_BATCH, num_workers=workers)
    gc.collect()
    _settle()
    cpu, started = _cpu_s(), time.perf_counter()
    batches = 0
    for _ in data:
        batches += 1
    elapsed = time.perf_counter() - started
    cpu = _cpu_s() - cpu
    del data
    gc.collect()
    return samples / elapsed, 1e6 * cpu / batches


def small(workers: list[int], reps: int, samples: int) -> dict[str, Any]:
    """W11: both loaders at each worker count, repetitions interleaved."""
    measured: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in range(reps):
        for count in workers:
            for loader in LOADERS:
                measured.setdefault((count, loader), []).append(small_epoch(loader, count, samples))
    rows: list[dict[str, Any]] = [
        {
            "workers": count,
            "loader": loader,
            "samples_per_s": statistics.median(v[0] for v in values),
            "main_us_per_batch": statistics.median(v[1] for v in values),
            "all": values,
        }
        for (count, loader), values in measured.items()
    ]
    return {"samples": samples, "batch": SMALL_BATCH, "reps": reps, "rows": rows}


def table(start: dict[str, Any], many: dict[str, Any]) -> str:
    """Both workloads as text, stoker.torch's ratios against torch's row beside it."""
    lines = [
        f"W10 start-up: a fresh loader's iter() and its first batch (ms from iter()), "
        f"{start['reps']} repetition(s) interleaved, medians; {start['cpus']} CPUs",
        f"{'method':<12}{'workers':>8}{'torch iter':>12}{'stoker':>9}{'torch 1st':>11}{'stoker':>9}{'vs torch':>10}",
    ]
    by = {(r["method"], r["workers"], r["loader"]): r for r in start["rows"]}
    for method, count in sorted(
        {(r["method"], r["workers"]) for r in start["rows"]}, key=lambda k: (METHODS.index(k[0]), k[1])
    ):
        theirs, ours = by[(method, count, "torch")], by[(method, count, "stoker.torch")]
        lines.append(
            f"{method:<12}{count:>8}{theirs['iter_ms']:>12.1f}{ours['iter_ms']:>9.1f}"
            f"{theirs['first_batch_ms']:>11.1f}{ours['first_batch_ms']:>9.1f}"
            f"{ours['first_batch_ms'] / theirs['first_batch_ms']:>9.2f}x"
        )
    for f in start["fits"]:
        lines.append(
            f"fit {f['method']:<11}{f['loader']:<13} iter()+first batch = {f['intercept_ms']:.1f} ms + "
            f"{f['ms_per_worker']:.1f} ms per worker: 14 workers {f['at_14_ms']:.0f} ms, 64 workers {f['at_64_ms']:.0f} ms (fitted)"
        )
    lines += [
        "",
        f"W11 small samples: {{'x': i, 'y': float(i)}}, batch {many['batch']}, {many['samples']:,} samples, "
        f"{many['reps']} repetition(s) interleaved, medians, start-up included",
        f"{'workers':>8}{'torch samples/s':>17}{'stoker':>12}{'vs torch':>10}{'main us/batch: torch':>22}{'stoker':>9}",
    ]
    rows = {(r["workers"], r["loader"]): r for r in many["rows"]}
    for count in sorted({r["workers"] for r in many["rows"]}):
        theirs, ours = rows[(count, "torch")], rows[(count, "stoker.torch")]
        lines.append(
            f"{count:>8}{theirs['samples_per_s']:>17,.0f}{ours['samples_per_s']:>12,.0f}"
            f"{ours['samples_per_s'] / theirs['samples_per_s']:>9.2f}x"
            f"{theirs['main_us_per_batch']:>22.0f}{ours['main_us_per_batch']:>9.0f}"
        )
    return "\n".join(lines)


def main(workers: list[int] | None, reps: int, quick: bool, json_path: str) -> int:
    """Run W10 and W11, print their table and write their JSON."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("stoker-bench: W10/W11 need torch (they run stoker.torch and torch.utils.data): skipped", flush=True)
        return 0
    available = multiprocessing.get_all_start_methods()
    methods = [m for m in METHODS if m in available]
    counts = [w for w in (workers or START_WORKERS) if w > 0] or list(START_WORKERS)
    if quick:
        methods, counts, reps = methods[:1], counts[:2], 1
    start = startup(counts, methods, reps)
    many = small(list(SMALL_WORKERS), reps, 20_000 if quick else SMALL_SAMPLES)
    print(table(start, many), flush=True)
    folder = os.path.dirname(json_path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as out:
        json.dump({"startup": start, "small": many}, out, indent=2)
    print(f"\nwrote {json_path}", file=sys.stderr)
    return 0
