"""`stoker-bench`'s outputs in text: the table of a report (rows, W3's scaling, the arena, the
torch-free start-up, the stats overhead, "auto", the environment and the targets) and the JSON."""

from __future__ import annotations

import collections
import json
import os
import statistics
from typing import Any

from .machine import environment_line
from .measure import TORCH_FREE
from .results import _fmt_rate


def _fmt_us(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


NAME_WIDTH = 32  # the table's workload column: "W5 torch-free forkserver 200 MB"

# One line per workload, printed above the table so that it reads without benchmarks/README.md
# (which gives the sizes and how each is timed).
WORKLOADS = {
    "W1": "tiny samples, dicts of an int and 4 float32, batch 256: the loader's own cost per sample and batch",
    "W2": "images, 3x224x224 uint8, batch 64: bandwidth (GB/s, against memcpy)",
    "W3": "CPU-heavy samples, ~2 ms of Python each, batch 16: how the rate scales with workers",
    "W4": "an IterableDataset of 128-float32 rows split by get_worker_info(), batch 256",
    "W5": "time to the first batch, the dataset holding a 10 MB or a 200 MB array, by start method",
    "W6": "persistent workers over many epochs: the gap and the cost of each epoch boundary",
    "W7": "ImageNet-sized tensors: random 224x224 crops and flips of 3x256x256 uint8 images, batch 256 and 64",
    "W8": "W2's images, 1 GB of distinct ones read once each, so that reads miss every cache",
}
LOADERS = (
    "loaders: stoker (numpy batches), stoker.torch (the drop-in: torch's tensors, torch's semantics), "
    "torch (torch.utils.data, the baseline); workers: num_workers (auto: stoker's choice)"
)
VARIANTS = (
    "after a workload's name: W1 stats on / off (stats=True / False, epochs in pairs), auto ref (the hand-picked "
    "epochs run beside each auto one), W5's start method and array size, W7's batch size (b256, b64)"
)


def legend(report: dict[str, Any]) -> list[str]:
    """The lines that say what the table's workloads and loaders are."""
    present = {r["workload"] for r in report["results"]}
    lines = ["workloads (benchmarks/README.md has their sizes and how each is timed):"]
    lines += [f"  {name}  {what}" for name, what in WORKLOADS.items() if name in present]
    return [*lines, LOADERS, VARIANTS, ""]


def targets_note(report: dict[str, Any]) -> list[str]:
    """What the targets are, what they are measured against, and what MET and MISSED mean."""
    met = sum(1 for t in report["targets"] if t["met"])
    judged = sum(1 for t in report["targets"] if t["met"] is not None)
    cpus = report["machine"].get("cpus")
    return [
        "targets: the goals set for stoker on each workload, judged on this run. stoker.torch is measured against",
        "torch.utils.data's row at the same workers (W1-W6 and W8 at num_workers=2, W7 at each); W5 torch-free,",
        "the arena, the stats overhead and auto are stoker alone, against a bound, the one-core memcpy ceiling or",
        "itself. MET and MISSED say what this machine did at this moment; a MISSED fails nothing (the run exits 0),",
        "and INFO lines have no goal. The goals hold on a quiet machine with cores to spare: on a small or busy one",
        f"({cpus} usable CPUs here) what runs in parallel (W2's, W3's and W8's workers) and the narrow margins (the",
        "stats overhead, W6's boundary in batch gaps) can miss from load alone: compare with the figures of",
        f"docs/performance.md before taking a MISSED for a regression. {met} of {judged} met:",
    ]


def table(report: dict[str, Any]) -> str:
    """The human-readable table of a report: a legend, the rows, the derived figures and the
    targets."""
    lines = legend(report)
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
                + (
                    f"FLAGGED: torch imported in {imported} of {len(r['values'])} runs"
                    if imported
                    else "torch not imported"
                )
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
                first = (
                    f"; first batch after {entry['auto_first_s'] * 1e3:.0f} ms vs {entry['best_first_s'] * 1e3:.0f} ms"
                )
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
            "epochs too short for a steady-state window, rate from iter() to the end instead: " + ", ".join(short)
        )
    two = report["machine"].get("memcpy2_gbps")
    lines.append(
        f"memcpy ceiling (one core): {report['machine']['memcpy_gbps']:.1f} GB/s"
        + (f"; two threads at once: {two:.1f} GB/s" if two else "")
    )
    lines.append(environment_line(report["machine"]))
    if report["targets"]:
        lines.append("")
        lines += targets_note(report)
        for t in report["targets"]:
            label = "INFO  " if t["met"] is None else "MET   " if t["met"] else "MISSED"
            lines.append(f"  {label} {t['target']}: {t['shown']}")
    return "\n".join(lines)


def save_json(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
