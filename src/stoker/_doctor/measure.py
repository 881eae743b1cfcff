"""One configuration measured: its steady-state samples/s, time to first batch and worker memory
(`measure_config`, `Row`); the readiness of a model of --step-ms behind it, measured
(`measure_readiness`) and expected (`expected_readiness`, `Readiness`); the rate a training loop
gets from a row (`loop_rate`)."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .memory import _mean_memory, descendants
from .probe import batch_len, touch
from .target import Config, Target

READINESS_TARGET = 0.95


@dataclass
class Row:
    """One configuration's figures (None where not measured)."""

    config: Config
    samples_per_s: float | None = None
    first_batch_s: float | None = None
    batches: int = 0
    window_s: float = 0.0
    close_s: float | None = None
    workers_seen: int = 0
    uss_first_mb: float | None = None
    pss_first_mb: float | None = None
    uss_end_mb: float | None = None
    pss_end_mb: float | None = None
    current: bool = False
    note: str = ""
    rates: list[float] = field(default_factory=list)  # one per measurement; samples_per_s is their median
    restarted: bool = False  # new workers during the window (an iterable's epochs): no growth figure

    def merge(self, again: Row) -> None:
        """Count another measurement of the same configuration (a repeat on a noisy machine)."""
        if again.samples_per_s:
            self.rates.append(again.samples_per_s)
            self.samples_per_s = float(np.median(self.rates))
            self.batches += again.batches
            self.window_s += again.window_s

    @property
    def uss_growth_mb(self) -> float | None:
        if self.uss_first_mb is None or self.uss_end_mb is None or self.restarted:
            return None
        return self.uss_end_mb - self.uss_first_mb


def steady_rate(arrivals: Sequence[float], sizes: Sequence[int], skip: int) -> float | None:
    """Samples/s between batch `skip` and the last one. `arrivals[i]`: when batch i arrived
    (s, any origin); `sizes[i]`: its samples. The first batches are start-up (every worker
    began at once, the arena's slots are still being made), so the window starts at batch
    `skip`, or at a third of the batches when there are few. None with fewer than two."""
    last = len(arrivals) - 1
    if last < 1:
        return None
    start = min(skip, last // 3)
    span = arrivals[last] - arrivals[start]
    if span <= 0:
        return None
    return sum(sizes[start + 1 : last + 1]) / span


def measure_config(target: Target, config: Config, window_s: float) -> Row:
    """Run one configuration: time to its first batch, then a steady window of `window_s`
    with a consumer that touches each batch; worker memory after the first batch and at
    the end. The iterator is closed (workers joined) before this returns."""
    row = Row(config)
    default_size = target.batch_size or 1
    loader = target.make_loader(config)
    before = descendants()
    start = time.perf_counter()
    iterator = iter(loader)
    try:
        arrivals: list[float] = []
        sizes: list[int] = []
        try:
            batch = next(iterator)
        except StopIteration:
            row.note = "the dataset gave no batch"
            return row
        now = time.perf_counter()
        row.first_batch_s = now - start
        arrivals.append(now)
        sizes.append(batch_len(batch, default_size))
        touch(batch)
        del batch
        workers: set[int] = set()
        if config.kind == "processes":
            workers = descendants() - before
            row.workers_seen = len(workers)
            memory = _mean_memory(workers)
            if memory is not None:
                row.uss_first_mb, row.pss_first_mb = memory
        end = time.perf_counter() + window_s
        restarts = 0
        while time.perf_counter() < end:
            try:
                batch = next(iterator)
            except StopIteration:  # an iterable dataset's epoch ended: begin the next
                iterator.close()
                iterator = iter(loader)
                restarts += 1
                if workers:
                    workers = descendants() - before
                continue
            arrivals.append(time.perf_counter())
            sizes.append(batch_len(batch, default_size))
            touch(batch)
            del batch
        if workers:
            memory = _mean_memory(workers)
            if memory is not None:
                row.uss_end_mb, row.pss_end_mb = memory
        row.batches = len(arrivals)
        row.window_s = arrivals[-1] - arrivals[0]
        rate = steady_rate(arrivals, sizes, config.num_workers * (config.prefetch_factor or 1))
        if rate is None:  # a single batch in the window: count from iter()
            rate = sum(sizes) / (arrivals[-1] - start)
            row.note = "one batch only: rate includes start-up"
        if restarts:
            row.note = f"{restarts} epoch restart(s) inside the window, start-ups included"
            row.restarted = True
        row.samples_per_s = rate
        row.rates = [rate]
    finally:
        closing = time.perf_counter()
        iterator.close()
        del iterator, loader
        gc.collect()
        row.close_s = time.perf_counter() - closing
    return row


@dataclass
class Readiness:
    """How well the recommended configuration keeps a model of --step-ms fed."""

    step_ms: float
    needed_per_s: float
    expected: float
    workers_needed: int | None
    workers_needed_how: str
    recommended_expected: float | None = None
    measured: float | None = None
    measured_window_s: float | None = None
    wait_ms_per_batch: float | None = None
    config: Config | None = None


def measure_readiness(target: Target, config: Config, step_ms: float, window_s: float) -> tuple[float, float, float]:
    """Run `config` behind a consumer that sleeps `step_ms` per batch (a model step on an
    accelerator) for `window_s`, after a warm-up of num_workers + 1 batches (start-up is
    reported as the time to the first batch). Returns (readiness: the fraction of the time
    not spent waiting inside next(), the window, wait in ms per batch)."""
    loader = target.make_loader(config)
    iterator = iter(loader)
    try:
        for _ in range(config.num_workers + 2):
            touch(next(iterator))
            time.sleep(step_ms / 1000)
        waited = 0.0
        batches = 0
        start = time.perf_counter()
        end = start + window_s
        while time.perf_counter() < end:
            asked = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                iterator.close()
                iterator = iter(loader)
                continue
            waited += time.perf_counter() - asked
            batches += 1
            touch(batch)
            del batch
            time.sleep(step_ms / 1000)
        total = time.perf_counter() - start
    finally:
        iterator.close()
        del iterator, loader
        gc.collect()
    return 1 - waited / total, total, waited * 1000 / max(batches, 1)


def loop_rate(row: Row, step_ms: float | None, batch_size: int) -> float | None:
    """Samples/s a training loop gets from this row. Without a model step, the measured rate.
    With one, num_workers=0 loads in the loop's own thread, so each batch costs its loading
    time plus the step; worker threads and processes overlap the step, so their measured
    rate stands (the ranking is by what they can deliver)."""
    rate = row.samples_per_s
    if not rate or not step_ms or row.config.num_workers:
        return rate
    return batch_size / (batch_size / rate + step_ms / 1000)


def row_readiness(row: Row, step_ms: float, batch_size: int) -> float | None:
    """Expected fraction of the time a model of `step_ms` per batch does not wait for this
    row: min(1, rate / needed) for workers; step / (step + loading) for num_workers=0."""
    rate = row.samples_per_s
    if not rate:
        return None
    if row.config.num_workers == 0:
        load_ms = batch_size * 1000 / rate
        return step_ms / (step_ms + load_ms)
    return min(1.0, rate / (batch_size * 1000 / step_ms))


def expected_readiness(rows: Sequence[Row], batch_size: int, step_ms: float, cpus: int) -> Readiness:
    """Readiness of the best loader behind a model that takes `step_ms` per batch (min(1,
    best rate / needed rate)), and how many workers give READINESS_TARGET: the cheapest
    measured row that reaches it, else a linear extrapolation from one process worker."""
    needed = batch_size * 1000 / step_ms
    measured = sorted((r for r in rows if r.samples_per_s), key=lambda r: r.config.cost())
    best = max((loop_rate(r, step_ms, batch_size) or 0.0 for r in measured), default=0.0)
    expected = min(1.0, best / needed)
    for row in measured:
        if (row_readiness(row, step_ms, batch_size) or 0.0) >= READINESS_TARGET:
            return Readiness(step_ms, needed, expected, row.config.num_workers, f"measured: {row.config.arguments()}")
    one = [r for r in measured if r.config.num_workers == 1 and r.config.kind == "processes"]
    if one and one[0].samples_per_s:
        workers = math.ceil(READINESS_TARGET * needed / one[0].samples_per_s)
        how = f"extrapolated linearly from 1 process worker's {_rate(one[0].samples_per_s)} samples/s"
        if workers > cpus:
            how += f"; more than the {cpus} usable CPUs of this machine"
        return Readiness(step_ms, needed, expected, workers, how)
    return Readiness(step_ms, needed, expected, None, "cannot be estimated (no 1-worker figure)")


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:,.0f}"


def _seconds(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s")
