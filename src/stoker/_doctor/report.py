"""The doctor's report in words and as JSON: the recommend line with its evidence, the table of
configurations, the whole printed report (`render`) and its JSON form (`to_json`, `save_json`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from .measure import READINESS_TARGET, Row, _rate, _seconds, loop_rate
from .memory import MB
from .sweep import Report
from .target import Config


def _mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def recommend_line(report: Report) -> str:
    """`recommend: num_workers=..., thread_pool=..., prefetch_factor=...` and its evidence."""
    chosen = report.recommended
    if chosen is None or not chosen.samples_per_s:
        return "recommend: nothing measured (no configuration fitted the budget)"
    rate = chosen.samples_per_s
    evidence = [f"{_rate(rate)} samples/s"]
    current = report.row(report.current)
    if report.current is not None:
        if current is not None and current.samples_per_s:
            evidence.append(
                f"{rate / current.samples_per_s:.2f}x your current setting ({report.current.arguments()}: "
                f"{_rate(current.samples_per_s)} samples/s)"
            )
        else:
            evidence.append(f"your current setting ({report.current.arguments()}) was not measured")
    zero = report.row(Config(0))
    if zero is not None and zero.samples_per_s and chosen.config.num_workers:
        evidence.append(f"{rate / zero.samples_per_s:.2f}x num_workers=0 ({_rate(zero.samples_per_s)} samples/s)")
        if report.step_ms:
            beside = loop_rate(zero, report.step_ms, report.batch_size)
            evidence.append(
                f"num_workers=0 loads inside the training loop, so beside a {report.step_ms:g} ms step it "
                f"would deliver {_rate(beside)} samples/s"
            )
    scored = [(r, loop_rate(r, report.step_ms, report.batch_size) or 0.0) for r in report.rows if r.samples_per_s]
    best, best_rate = max(scored, key=lambda x: x[1])
    chosen_rate = loop_rate(chosen, report.step_ms, report.batch_size) or 0.0
    if best is not chosen and best_rate:
        evidence.append(
            f"within {100 * (1 - chosen_rate / best_rate):.1f} % of the fastest ({best.config.arguments()}) and cheaper"
        )
    return f"recommend: {chosen.config.arguments()}  ({'; '.join(evidence)})"


def table(rows: Sequence[Row], recommended: Row | None) -> list[str]:
    """The configurations tried, one line each."""
    zero = next((r for r in rows if r.config.num_workers == 0 and r.samples_per_s), None)
    header = (
        f"  {'workers':>7}  {'kind':<9}  {'prefetch':>8}  {'samples/s':>9}  {'runs':>4}  {'vs 0':>5}  "
        f"{'1st batch':>9}  "
        f"{'USS MB/worker':>13}  {'PSS MB/worker':>13}  {'USS growth':>10}"
    )
    lines = [header]
    for r in rows:
        vs0 = f"{r.samples_per_s / zero.samples_per_s:.2f}x" if r.samples_per_s and zero and zero.samples_per_s else "-"
        if r.config.kind == "processes" and r.samples_per_s:
            uss = f"{_mb(r.uss_first_mb)}->{_mb(r.uss_end_mb)}"
            pss = f"{_mb(r.pss_first_mb)}->{_mb(r.pss_end_mb)}"
            growth = "n/a" if r.uss_growth_mb is None else f"{r.uss_growth_mb:+.1f}"
        else:
            uss = pss = growth = "-"
        marks = (" <- recommended" if r is recommended else "") + (" (current)" if r.current else "")
        if r.note:
            marks += f"  [{r.note}]"
        lines.append(
            f"  {r.config.num_workers:>7}  {r.config.kind:<9}  {r.config.prefetch_factor or '-':>8}  "
            f"{_rate(r.samples_per_s):>9}  {len(r.rates):>4}  {vs0:>5}  {_seconds(r.first_batch_s):>9}  "
            f"{uss:>13}  {pss:>13}  "
            f"{growth:>10}{marks}"
        )
    return lines


def render(report: Report) -> str:
    """The report as printed."""
    p = report.profile
    out = [f"stoker doctor {report.spec}"]
    given = report.source
    if report.current is not None:
        given += f" with {report.current.arguments()}"
    out.append(f"  given: {given}; measured with {report.measured_with}")
    length = f"{report.dataset_len:,} samples" if report.dataset_len is not None else "iterable"
    order = "shuffle" if report.shuffle else "in order"
    out.append(f"  dataset: {report.dataset}, {length}; batch_size {report.batch_size}, {order}")
    out.extend(f"  {line}" for line in report.stream)
    out.append(
        f"  machine: {report.cpus} usable CPUs, start method {report.start_method}; budget {report.budget_s:g} s"
    )
    out.append("")
    if p is not None:
        out.append(
            f"per sample, in this process ({p.samples} samples): median {p.fetch_median_ms:.3f} ms, "
            f"p90 {p.fetch_p90_ms:.3f} ms, spread p90/median {p.spread:.2f}x (p10 {p.fetch_p10_ms:.3f}, "
            f"max {p.fetch_max_ms:.3f} ms)"
        )
        collate = "-" if p.collate_ms is None else f"{p.collate_ms:.2f} ms"
        size = "-" if p.batch_bytes is None else f"{p.batch_bytes / MB:.2f} MB"
        alone = p.one_process_rate()
        out.append(
            f"per batch of {p.batch_size}: collate {collate}, {size}"
            + (f"; one process alone: ~{_rate(alone)} samples/s" if alone else "")
        )
        out.append("")
    out.append(
        "configurations (steady-state samples/s, start-up excluded, the median of `runs` windows; memory per "
        "worker process: USS and PSS from smaps_rollup less the shared-memory batch slots, after the first "
        "batch -> at the end):"
    )
    out.extend(table(report.rows, report.recommended))
    out.append("")
    out.append(recommend_line(report))
    best = report.best()
    if report.free_rate and best is not None and best.samples_per_s:
        out.append(
            f"headroom: a free loader (cached batches replayed, each leaf's shape read) delivers "
            f"{_rate(report.free_rate)} samples/s; the best configuration {_rate(best.samples_per_s)}: "
            f"the loader delivers {100 * best.samples_per_s / report.free_rate:.2g} % of what a free loader would"
        )
    r = report.readiness
    if r is not None:
        line = (
            f"readiness at --step-ms {r.step_ms:g}: the model takes {_rate(r.needed_per_s)} samples/s "
            f"({report.batch_size} per {r.step_ms:g} ms); expected min(1, best/needed) = {r.expected:.2f}"
        )
        if r.recommended_expected is not None:
            line += f", {r.recommended_expected:.2f} for the recommended setting"
        if r.workers_needed is not None:
            line += f"; readiness >= {READINESS_TARGET} needs num_workers={r.workers_needed} ({r.workers_needed_how})"
        else:
            line += f"; workers for readiness >= {READINESS_TARGET}: {r.workers_needed_how}"
        out.append(line)
        if r.measured is not None and r.config is not None:
            out.append(
                f"readiness measured: {r.config.arguments()} behind a consumer sleeping {r.step_ms:g} ms per "
                f"batch for {r.measured_window_s:.1f} s: not waiting in next() {100 * r.measured:.1f} % of the "
                f"time ({r.wait_ms_per_batch:.2f} ms wait per batch)"
            )
    if report.traps:
        out.extend(f"trap: {t.message}" for t in report.traps)
    else:
        out.append("traps: none found")
    out.extend(f"note: {n}" for n in report.notes)
    out.append(f"({report.elapsed_s:.1f} s)")
    return "\n".join(out)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "batches"}
        if isinstance(value, Row):
            out["uss_growth_mb"] = value.uss_growth_mb
            out["kind"] = value.config.kind
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_json(report: Report) -> dict[str, Any]:
    """All figures as JSON-able data."""
    data: dict[str, Any] = _plain(report)
    best = report.best()
    data["best"] = _plain(best) if best is not None else None
    data["recommendation"] = {
        "line": recommend_line(report),
        **(_plain(report.recommended.config) if report.recommended else {}),
        "samples_per_s": report.recommended.samples_per_s if report.recommended else None,
    }
    data["headroom"] = {
        "free_loader_samples_per_s": report.free_rate,
        "best_samples_per_s": best.samples_per_s if best else None,
        "ratio": (best.samples_per_s / report.free_rate) if best and best.samples_per_s and report.free_rate else None,
    }
    del data["recommended"]
    return data


def save_json(report: Report, path: str) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_json(report), f, indent=2, default=str)
