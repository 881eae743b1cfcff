"""`stoker-bench`'s runner: the `Plan`, the jobs of each repetition (`_jobs`: every workload,
loader and number of workers, the stats pairs and the "auto" blocks), running them
interleaved (`run`) and recording each measurement into its result row."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import stoker
from stoker._core.loader import usable_cpus

from .machine import environment, memcpy_gbps, memcpy_threads_gbps
from .measure import (
    TORCH_FREE,
    Chosen,
    EpochTiming,
    StatsPair,
    _epoch_boundary,
    _epoch_rate,
    _first_batch_s,
    _stats_pair,
    pairs_per_rep,
    torch_free_first_batch,
    w5_methods,
)
from .results import (
    AUTO,
    AUTO_REF,
    AUTO_WORKLOADS,
    Key,
    Result,
    Workers,
    arena_use,
    auto_vs_best,
    stats_overhead,
    targets,
    w3_scaling,
)
from .workloads import (
    IMAGE_BYTES,
    W7_BATCH_SIZES,
    W7_CROP_BYTES,
    W7_LOADERS,
    W7_PREFETCH,
    CpuHeavy,
    HoldsArray,
    ImageNetCrops,
    Images,
    LargeImages,
    Sizes,
    TinyDicts,
    _iterable_for,
    calibrate_busy,
    loader_modules,
    w2_samples,
    w7_batches,
    w7_sources,
    w8_images,
    w8_samples,
)

AUTO_BLOCKS = 2  # blocks of (auto, each hand-picked worker count) per repetition


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
                (
                    "W5",
                    "stoker",
                    2,
                    f"{TORCH_FREE} {method} {small} MB",
                    functools.partial(torch_free_first_batch, method, small),
                )
            )
    if "W6" in plan.workloads and any(w > 0 for w in plan.workers):
        for name, mod in mods.items():
            # stoker's opt-in next-epoch prefetch (auto_reload=True) beside its default, which
            # starts each epoch at iter() as torch does
            reloads = (False, True) if name.startswith("stoker") else (False,)
            for reload in reloads:

                def make_persistent(n: int, mod: Any = mod, reload: bool = reload) -> Any:
                    extra = {"auto_reload": True} if reload else {}
                    return mod.DataLoader(Images(n), batch_size=64, num_workers=2, persistent_workers=True, **extra)

                jobs.append(
                    (
                        "W6",
                        name,
                        2,
                        "cost auto_reload" if reload else "cost",
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
            asdict(r) | {"median": r.median, "gbps": r.gbps(), "main_us_per_batch": r.main_us_per_batch} for r in rows
        ],
        "w3_scaling": w3_scaling(rows),
        "arena": arena_use(rows),
        "stats_overhead": stats_overhead(rows),
        "auto": {
            "run": auto,
            "note": None
            if unsupported is None
            else f'num_workers="auto" not run: this stoker refuses it ({unsupported})',
            "workloads": auto_vs_best(rows),
        },
        "targets": targets(rows, ceiling, ceiling2),
    }


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
        gap = _result(results, (workload, name, workers, key[3].replace("cost", "gap")))
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
    # disable=None: no bar when stderr is not a terminal (a log)
    return tqdm(total=total, unit="run", file=sys.stderr, leave=False, disable=None)
