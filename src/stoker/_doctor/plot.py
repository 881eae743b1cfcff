"""The doctor's chart: samples/s per configuration and memory per worker process."""

from __future__ import annotations

import numpy as np

from .sweep import Report
from .target import Config


def _short(config: Config) -> str:
    """A chart label: '0', '2p pf2' (2 processes, prefetch 2), '1t pf4' (threads)."""
    if config.num_workers == 0:
        return "0"
    return f"{config.num_workers}{'t' if config.thread_pool else 'p'} pf{config.prefetch_factor}"


def plot(report: Report, path: str) -> bool:
    """A chart of samples/s per configuration and memory per worker; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report.rows if r.samples_per_s]
    labels = [_short(r.config) for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    colours = ["#d95f02" if r is report.recommended else ("#7570b3" if r.current else "#1b9e77") for r in rows]
    left.bar(range(len(rows)), [r.samples_per_s or 0 for r in rows], color=colours)
    left.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    left.set_ylabel("samples/s (steady state)")
    left.set_xlabel("workers (p: processes, t: threads), pf: prefetch_factor", fontsize=8)
    left.set_title("throughput per configuration (orange: recommended, purple: current)", fontsize=9)
    if report.free_rate and report.readiness is not None:
        left.axhline(report.readiness.needed_per_s, color="grey", ls="--", lw=1)
        need = report.readiness.needed_per_s
        left.text(0, need, f" model at {report.readiness.step_ms:g} ms/step", fontsize=7, va="bottom")
    procs = [r for r in rows if r.config.kind == "processes" and r.uss_first_mb is not None]
    if procs:
        x = np.arange(len(procs))
        width = 0.27
        right.bar(x - width, [r.uss_first_mb or 0 for r in procs], width, label="USS after 1st batch")
        right.bar(x, [r.uss_end_mb or 0 for r in procs], width, label="USS at end")
        right.bar(x + width, [r.pss_end_mb or 0 for r in procs], width, label="PSS at end")
        right.set_xticks(x, [_short(r.config) for r in procs], fontsize=8)
        right.set_ylabel("MB per worker process")
        right.legend(fontsize=7)
    else:
        right.text(0.5, 0.5, "no process-worker memory figures", ha="center", va="center")
    right.set_title("memory per worker process", fontsize=9)
    fig.suptitle(f"stoker doctor {report.spec}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True
