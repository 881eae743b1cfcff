"""`stoker-bench`'s chart: samples/s per workload and loader, and below, when measured, the
stats overhead, "auto" against the best hand-picked setting, and the arena in batches."""

from __future__ import annotations

import os
from typing import Any

from .results import AUTO, AUTO_REF, AUTO_VS_BEST_MIN, STATS_OVERHEAD_MAX

STATS_VARIANTS = ("stats on", "stats off")  # drawn in their own panel, not with the samples/s


def chart(report: dict[str, Any], path: str) -> bool:
    """The report's chart (see `figure`) as a PNG; False when matplotlib is missing or there is
    nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = figure(report)
    if fig is None:
        return False
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def figure(report: dict[str, Any]) -> Any:
    """A matplotlib figure of a report, or None when it has nothing to draw. Top row: samples/s
    per workload and loader (the auto rows in their workload's panel). Bottom row, when
    measured: W1's stats overhead per number of workers (each pair a dot, the median a bar, the
    2 % line), "auto" over the best hand-picked setting per workload (the 0.85 line), and the
    arena in batches per W2/W8 row against its window + 2."""
    import matplotlib.pyplot as plt

    rows = [
        r
        for r in report["results"]
        if r["unit"] == "samples/s" and r["variant"] not in STATS_VARIANTS and r["variant"] != AUTO_REF
    ]

    def panel(r: dict[str, Any]) -> str:
        return f"{r['workload']} {r['variant']}".strip()

    workloads = sorted({panel(r) for r in rows})
    overhead = report.get("stats_overhead") or []
    auto = (report.get("auto") or {}).get("workloads") or []
    arena = report.get("arena") or []
    below = int(bool(overhead)) + int(bool(auto)) + int(bool(arena))
    if not workloads and not below:
        return None
    columns = max(len(workloads), below, 1)
    fig = plt.figure(figsize=(4 * columns, 3.6 * (int(bool(workloads)) + int(bool(below)))), layout="constrained")
    subfigs = fig.subfigures(int(bool(workloads)) + int(bool(below)), 1, squeeze=False)[:, 0]
    if workloads:
        axes = subfigs[0].subplots(1, len(workloads), squeeze=False)[0]
        for ax, workload in zip(axes, workloads):
            mine = [r for r in rows if panel(r) == workload]
            labels = [f"{r['loader']}\nw={r['workers']}" for r in mine]
            bars = ax.bar(range(len(mine)), [r["median"] for r in mine], color=[_colour(r["loader"]) for r in mine])
            for bar, r in zip(bars, mine):
                if r["workers"] == AUTO:
                    bar.set_hatch("//")
            ax.set_xticks(range(len(mine)), labels, fontsize=6, rotation=90)
            ax.set_title(workload)
            ax.set_ylabel("samples/s")
    if below:
        axes = iter(subfigs[-1].subplots(1, below, squeeze=False)[0])
        if overhead:
            ax = next(axes)
            xs = range(len(overhead))
            ax.bar(xs, [100 * e["overhead"] for e in overhead], color=_colour("stoker"), label="median")
            for x, entry in zip(xs, overhead):
                ax.plot([x] * len(entry["per_pair"]), [100 * v for v in entry["per_pair"]], "k.", markersize=4)
            ax.axhline(100 * STATS_OVERHEAD_MAX, color="#c0392b", linestyle="--", label="target < 2 %")
            ax.axhline(0, color="black", linewidth=0.5)
            ax.set_xticks(xs, [f"w={e['workers']}" for e in overhead])
            ax.set_ylabel("off / on - 1, % (> 0: stats on slower)")
            ax.set_title(f"W1 stats overhead (pairs, median of {overhead[0]['pairs']})")
            ax.legend(fontsize=6)
        if auto:
            ax = next(axes)
            xs = range(len(auto))
            ax.bar(xs, [e["ratio"] for e in auto], color=_colour("stoker"))
            for x, entry in zip(xs, auto):
                chosen = ",".join(map(str, sorted(set(entry["chosen_workers"]))))
                ax.annotate(
                    f"chose w={chosen}\nbest w={entry['best_workers']}",
                    (x, entry["ratio"]),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
            ax.axhline(AUTO_VS_BEST_MIN, color="#c0392b", linestyle="--", label=f"target >= {AUTO_VS_BEST_MIN:g}")
            ax.set_xticks(xs, [e["workload"] for e in auto])
            ax.set_ylim(0, max(1.15, *(e["ratio"] * 1.15 for e in auto)))
            ax.set_ylabel("auto / best hand-picked (iter() to end)")
            ax.set_title('num_workers="auto" vs best hand-picked')
            ax.legend(fontsize=6, loc="lower right")
        if arena:
            ax = next(axes)
            xs = range(len(arena))
            ax.bar(xs, [e["batches"] for e in arena], color=_colour("stoker"), label="arena / batch bytes")
            ax.scatter(xs, [e["limit"] for e in arena], color="#c0392b", marker="_", s=400, label="target: window + 2")
            ax.set_xticks(xs, [f"{e['workload']}\nw={e['workers']}" for e in arena])
            ax.set_ylabel("batches")
            ax.set_title("arena at steady state (stoker)")
            ax.legend(fontsize=6, loc="lower right")
    return fig


def _colour(loader: str) -> str:
    return {"stoker": "#e07b39", "stoker.torch": "#c0392b", "torch": "#7f8c8d"}.get(loader, "#333333")
