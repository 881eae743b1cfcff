"""The doctor's run: the budget planned up front, the sweep of configurations (worker counts and
kinds, then prefetch factors at the best, then repeats of the fastest; `_Sweep`), choosing the
cheapest near the fastest (`choose`), and the `Report` that gathers it all (`run`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._base.hooks import ReportsToDoctor, follows
from .._core.loader import usable_cpus
from .measure import (
    Readiness,
    Row,
    _rate,
    _seconds,
    expected_readiness,
    loop_rate,
    measure_config,
    measure_readiness,
    row_readiness,
)
from .memory import _start_helpers
from .probe import Profile, profile_fetch, replay_rate
from .target import Config, Target
from .traps import Container, Trap, find_traps, python_containers, rngs_drawn_in_fetch

MIN_WINDOW_S = 0.3  # a steady-state window shorter than this measures noise
NEAR_BEST = 0.03  # a cheaper configuration within 3 % of the fastest is preferred
REPEATS = 3  # windows planned for measuring the best rows again
CONTENDERS = 3  # how many of the fastest rows are measured again


def choose(
    rows: Sequence[Row], tolerance: float = NEAR_BEST, step_ms: float | None = None, batch_size: int = 1
) -> Row | None:
    """The fastest measured row, or the cheapest (fewer workers, threads over processes,
    smaller prefetch) among those within `tolerance` of it; rates as `loop_rate` counts them."""
    scored = [(r, loop_rate(r, step_ms, batch_size) or 0.0) for r in rows if r.samples_per_s]
    if not scored:
        return None
    best = max(rate for _, rate in scored)
    near = [r for r, rate in scored if rate >= (1 - tolerance) * best]
    return min(near, key=lambda r: r.config.cost())


def worker_counts(cpus: int) -> list[int]:
    """0..cpus, or 0, 1, 2, 4, 8, ... and cpus itself on larger machines."""
    if cpus <= 8:
        return list(range(cpus + 1))
    counts = [0, 1]
    while counts[-1] * 2 < cpus:
        counts.append(counts[-1] * 2)
    return [*counts, cpus]


def first_configs(target: Target, cpus: int) -> tuple[list[Config], list[str]]:
    """The worker-count sweep (processes, then threads) and the user's own setting if it is
    not among them; with notes on what is left out and why."""
    notes: list[str] = []
    counts = worker_counts(cpus)
    configs = [Config(n) for n in counts]
    if target.iterable:
        notes.append("iterable dataset: num_workers varied with processes only (each replica's stream as it is)")
    elif target.seed_each_batch:
        notes.append("thread workers not tried: the loader uses seed_each_batch=True, which thread_pool refuses")
    else:
        configs += [Config(n, thread_pool=True) for n in counts if n]
    if target.current is not None and target.current not in configs:
        configs.append(target.current)
    if target.auto is not None:
        notes.append(f"your loader has {target.auto}: it chooses at iter(), so no row is your current setting")
    return configs, notes


def prefetch_configs(best: Config, tried: Iterable[Config]) -> list[Config]:
    """Prefetch factors 2, 4, 8 at the best worker count and kind (none at 0 workers)."""
    if best.num_workers == 0:
        return []
    seen = set(tried)
    configs = [Config(best.num_workers, best.thread_pool, p) for p in (2, 4, 8)]
    return [c for c in configs if c not in seen]


@dataclass
class Report:
    """Everything the doctor found; `to_json` writes it."""

    spec: str
    source: str
    measured_with: str
    dataset: str
    dataset_len: int | None
    batch_size: int
    shuffle: bool
    cpus: int
    start_method: str
    budget_s: float
    current: Config | None
    step_ms: float | None = None
    profile: Profile | None = None
    rows: list[Row] = field(default_factory=list)
    recommended: Row | None = None
    free_rate: float | None = None
    readiness: Readiness | None = None
    traps: list[Trap] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stream: list[str] = field(default_factory=list)  # a stoker.mix dataset's mix and packing
    containers: list[Container] = field(default_factory=list)
    load_average: tuple[float | None, float | None] = (None, None)  # 1-minute, before and after the run
    elapsed_s: float = 0.0

    def best(self) -> Row | None:
        measured = [r for r in self.rows if r.samples_per_s]
        return max(measured, key=lambda r: r.samples_per_s or 0.0) if measured else None

    def row(self, config: Config | None) -> Row | None:
        for r in self.rows:
            if config is not None and r.config == config and r.samples_per_s:
                return r
        return None


def _load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _say(message: str) -> None:
    print(f"doctor: {message}", file=sys.stderr, flush=True)


class _Sweep:
    """Runs configurations into a report's rows until `end` (perf_counter seconds), sizing
    each window from the time left and what is still to come."""

    def __init__(self, target: Target, report: Report, end: float) -> None:
        self.target = target
        self.report = report
        self.end = end
        # seconds a configuration costs besides its window (start-up, first batch, close),
        # per worker-weight: a first guess (spawn and forkserver workers import the user's
        # modules again), then what was measured
        spawned = report.start_method != "fork"
        self.overhead = {"main": 0.05, "threads": 0.1, "processes": 1.5 if spawned else 0.3}

    def cost_s(self, config: Config) -> float:
        return self.overhead[config.kind] * (1 + 0.2 * config.num_workers)

    def fits(self, config: Config) -> bool:
        return self.end - time.perf_counter() >= self.cost_s(config) + MIN_WINDOW_S

    def measure(self, config: Config, still_to_come: int) -> Row | None:
        """Measure `config` in a window of its share of the time left (`still_to_come`:
        configurations after it); None, with a note, when it does not fit."""
        label = f"num_workers={config.num_workers} {config.kind}" + (
            f" prefetch_factor={config.prefetch_factor}" if config.num_workers else ""
        )
        if not self.fits(config) and self.report.rows:  # the first one runs anyway: a table of none says nothing
            needs = self.cost_s(config) + MIN_WINDOW_S
            self.report.notes.append(f"skipped {label}: no time left in the budget (needs ~{needs:.1f} s)")
            _say(f"{label}: skipped, no time left")
            return None
        left = self.end - time.perf_counter()
        window = max(left / (1 + still_to_come) - self.cost_s(config), MIN_WINDOW_S)
        row = measure_config(self.target, config, window)
        row.current = config == self.target.current
        spent = (row.first_batch_s or 0.0) + (row.close_s or 0.0)
        weight = 1 + 0.2 * config.num_workers
        self.overhead[config.kind] = max(self.overhead[config.kind] * 0.5, spent / weight)
        _say(
            f"{label}: {_rate(row.samples_per_s)} samples/s, first batch {_seconds(row.first_batch_s)}"
            + (f", USS {row.uss_first_mb:.0f} MB/worker" if row.uss_first_mb is not None else "")
        )
        return row

    def run(self, configs: Sequence[Config], later: int = 0) -> None:
        """Measure each configuration once, as new rows (`later`: how many will follow)."""
        for k, config in enumerate(configs):
            row = self.measure(config, len(configs) - k - 1 + later)
            if row is not None:
                self.report.rows.append(row)

    def repeat(self, step_ms: float | None) -> None:
        """With the time left, measure the CONTENDERS fastest rows again, in turn (fewest
        runs first), and keep each one's median: one window is noisy on a busy machine, and
        a lucky one should not decide alone."""
        while True:
            scored = [(r, loop_rate(r, step_ms, self.report.batch_size) or 0.0) for r in self.report.rows]
            top = [r for r, rate in sorted(scored, key=lambda x: -x[1])[:CONTENDERS] if rate > 0]
            contenders = sorted(top, key=lambda r: (len(r.rates), r.config.cost()))
            if len(contenders) < 2 or not self.fits(contenders[0].config):
                return
            row = contenders[0]
            again = self.measure(row.config, len(contenders) - 1)
            if again is None:
                return
            row.merge(again)


def stream_lines(dataset: Any) -> list[str]:
    """What a `stoker.mix` dataset reports of itself (achieved mix proportions, packing
    utilisation over its first epoch); a failure to report is a line too, never an abort."""
    if not follows(dataset, ReportsToDoctor) or not callable(dataset.stoker_doctor_lines):
        return []
    try:
        return [str(line) for line in dataset.stoker_doctor_lines()]
    except Exception as exc:  # the report is an extra: the measurement goes on without it
        return [f"{type(dataset).__name__} could not report its mix/packing: {type(exc).__name__}: {exc}"]


def run(
    target: Target,
    seconds: float,
    step_ms: float | None = None,
    started: float | None = None,
    reserve_s: float = 0.3,
    cpus: int | None = None,
) -> Report:
    """Measure `target` within `seconds` (counted from `started`, default now); `reserve_s`
    is kept back for what follows (rendering, a chart)."""
    started = time.perf_counter() if started is None else started
    deadline = started + seconds
    cpus = cpus or usable_cpus() or 1
    method = target.start_method()
    flavour = "stoker.torch.DataLoader" if target.flavour == "torch" else "stoker.DataLoader"
    try:
        length: int | None = len(target.dataset)
    except TypeError:
        length = None
    report = Report(
        target.spec,
        target.source,
        flavour,
        type(target.dataset).__name__,
        length,
        target.batch_size or 1,
        target.shuffle,
        cpus,
        method,
        seconds,
        target.current,
        step_ms=step_ms,
    )
    # The budget, planned up front: the profile ~6 %, the headroom ~2 %, the readiness run
    # ~12 % (with --step-ms), a little for closing down; the sweep has the rest.
    profile_s = min(max(0.06 * seconds, 0.2), 3.0)
    replay_s = min(max(0.02 * seconds, 0.1), 0.5)
    readiness_s = min(max(0.12 * seconds, 1.0), 8.0) if step_ms else 0.0
    teardown_s = reserve_s + 0.02 * seconds

    busy = _load_average()
    loading_s = time.perf_counter() - started
    if loading_s > 0.25 * seconds:
        report.notes.append(
            f"importing the module and calling the factory took {loading_s:.1f} s of the {seconds:g} s budget"
        )
    report.stream = stream_lines(target.dataset)
    rngs = rngs_drawn_in_fetch(target)
    report.containers = python_containers(target.dataset)
    _say(f"profiling dataset[i] in this process (~{profile_s:.1f} s)")
    report.profile = profile_fetch(target, target.make_loader(Config(0)).collate_fn, profile_s)
    report.batch_size = report.profile.batch_size
    report.free_rate = replay_rate(report.profile.batches, report.batch_size, replay_s)
    report.profile.batches = []

    _start_helpers(method)
    configs, notes = first_configs(target, cpus)
    report.notes.extend(notes)
    sweep = _Sweep(target, report, deadline - teardown_s - (readiness_s + 0.3 if step_ms else 0.0))
    # after the worker sweep: prefetch factors at the best count, then repeats of the rows
    # within 10 % of the best (one window is noisy on a busy machine)
    later = (0 if target.iterable else 2) + REPEATS
    each = (sweep.end - time.perf_counter()) / (len(configs) + later)
    _say(
        f"budget {seconds:g} s: {len(configs)} configurations, then prefetch factors and repeats of the "
        f"best, ~{each:.1f} s each" + (f"; readiness run ~{readiness_s:.1f} s" if step_ms else "")
    )
    sweep.run(configs, later=later)
    first = choose(report.rows, step_ms=step_ms, batch_size=report.batch_size)
    if first is not None and not target.iterable:
        sweep.run(prefetch_configs(first.config, [r.config for r in report.rows]), later=REPEATS)
    sweep.repeat(step_ms)
    report.recommended = chosen = choose(report.rows, step_ms=step_ms, batch_size=report.batch_size)

    if step_ms and chosen is not None:
        report.readiness = readiness = expected_readiness(report.rows, report.batch_size, step_ms, cpus)
        readiness.recommended_expected = row_readiness(chosen, step_ms, report.batch_size)
        left = deadline - teardown_s - time.perf_counter() - sweep.cost_s(chosen.config)
        # the sweep may have overrun on a busy machine: a short window still answers, unless
        # the run is already well past its budget
        if left >= -0.1 * seconds:
            window = min(readiness_s, max(left, 0.5))
            _say(f"readiness: the recommended configuration behind a {step_ms:g} ms step for {window:.1f} s")
            readiness.measured, readiness.measured_window_s, readiness.wait_ms_per_batch = measure_readiness(
                target, chosen.config, step_ms, window
            )
            readiness.config = chosen.config
        else:
            report.notes.append("readiness not measured: no time left in the budget")
    report.traps = find_traps(target, report.rows, chosen, report.profile, rngs, report.containers, cpus)
    report.load_average = (busy, _load_average())
    if busy is not None and busy > 0.5 * cpus:
        report.notes.append(
            f"the machine was busy before the run (load average {busy:.2f} over the last minute on {cpus} "
            "CPUs): other work shares the CPUs with the workers, so the figures are noisy"
        )
    report.elapsed_s = time.perf_counter() - started
    return report
