"""`stoker-bench`'s result rows (`Result`, keyed by workload, loader, workers and variant) and
the figures derived from them: W3's scaling, the arena in batches, the stats overhead,
num_workers="auto" against the best hand-picked setting, and the issue's targets."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Final

from .measure import TORCH_FREE, TORCH_FREE_MAX_S, W5_METHODS, W5_VS_TORCH, pair_overhead

AUTO: Final = "auto"  # the `workers` of the rows run with num_workers="auto", prefetch_factor="auto"
AUTO_REF: Final = "auto ref"  # the variant of the hand-picked epochs run next to each auto epoch
Workers = int | str  # a number of workers, or AUTO
Key = tuple[str, str, Workers, str]  # (workload, loader, workers, variant)
AUTO_WORKLOADS = ("W1", "W2", "W3")  # run with num_workers="auto", prefetch_factor="auto" too


@dataclass
class Result:
    workload: str
    loader: str
    workers: Workers
    variant: str = ""
    unit: str = "samples/s"
    values: list[float] = field(default_factory=list)
    bytes_per_sample: int = 0
    extra: dict[str, list[float]] = field(default_factory=dict)
    choices: list[str] = field(default_factory=list)  # AUTO rows: what the loader chose, per repetition

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def main_us_per_batch(self) -> float | None:
        """Median over the repetitions of the main process's CPU µs per batch (samples/s rows)."""
        values = self.extra.get("main_us_per_batch")
        return statistics.median(values) if values else None

    def gbps(self) -> float | None:
        if self.unit != "samples/s" or not self.bytes_per_sample:
            return None
        return self.median * self.bytes_per_sample / 1e9


# ------------------------------------------------------------------- targets
def _find(rows: list[Result], workload: str, loader: str, workers: Workers, variant: str = "") -> Result | None:
    for r in rows:
        if (r.workload, r.loader, r.workers, r.variant) == (workload, loader, workers, variant):
            return r
    return None


W7_TARGET_AT_14 = 1.5  # stoker.torch vs torch at 14 workers (a 16-core machine)
STATS_OVERHEAD_MAX = 0.02  # stats=True vs stats=False on W1, median of the pairs' off/on - 1
AUTO_VS_BEST_MIN = 0.85  # num_workers="auto" over the best hand-picked number of workers
W7_BATCH_COST_GROWTH = 1.25  # main-process µs/batch at b256 over b64, at most


W8_VS_TORCH = 5.0  # stoker.torch vs torch at 2 workers, samples/s
MEMCPY_SHARE = 0.70  # W2's and W8's GB/s over the one-core memcpy ceiling, at least


def arena_use(rows: list[Result]) -> list[dict[str, Any]]:
    """Per W2/W8 row that read the arena (stoker, workers >= 1): the arena's reserved bytes at
    their most over each epoch's steady-state window, in batches, against the prefetch window
    + 2; `batches` is the most over the repetitions."""
    out = []
    for r in rows:
        per_rep = r.extra.get("arena_batches")
        if not per_rep or r.variant:
            continue
        window = int(r.extra["arena_window"][0])
        out.append(
            {
                "workload": r.workload,
                "loader": r.loader,
                "workers": r.workers,
                "batches": max(per_rep),
                "per_rep": list(per_rep),
                "arena_bytes": max(r.extra["arena_bytes"]),
                "batch_bytes": max(r.extra["arena_batch_bytes"]),
                "window": window,
                "limit": window + 2,
            }
        )
    return out


def targets(rows: list[Result], ceiling: float, ceiling2: float | None = None) -> list[dict[str, Any]]:
    """The issue's targets, stoker.torch vs torch.utils.data, as measured: W1-W6 and W8 at
    num_workers=2, W7 at every number of workers >= 1; W5's torch-free start-up and the arena's
    size, stoker alone. `ceiling`: one core's memcpy GB/s; `ceiling2`: two threads' (W8's second
    line, for information: `met` None)."""
    out: list[dict[str, Any]] = []

    def ratio_target(
        name: str, workload: str, need: float, variant: str = "", lower_is_better: bool = False, workers: int = 2
    ) -> None:
        ours = _find(rows, workload, "stoker.torch", workers, variant)
        theirs = _find(rows, workload, "torch", workers, variant)
        if ours is None or theirs is None:
            return
        ratio = theirs.median / ours.median if lower_is_better else ours.median / theirs.median
        met = ratio >= need
        if lower_is_better:
            shown = f"{ours.median / theirs.median:.3f}x torch's time (target <= {1 / need:.2f}x)"
        else:
            shown = f"{ratio:.2f}x torch (target >= {need:g}x)"
        out.append({"target": name, "met": met, "value": ratio, "shown": shown})

    ratio_target("W2 images samples/s vs torch", "W2", 5.0)
    w2 = _find(rows, "W2", "stoker.torch", 2)
    if w2 is not None:
        share = w2.gbps() / ceiling  # type: ignore[operator]
        out.append(
            {
                "target": "W2 images GB/s vs one-core memcpy",
                "met": share >= 0.70,
                "value": share,
                "shown": f"{w2.gbps():.2f} GB/s = {share:.0%} of {ceiling:.1f} GB/s (target >= 70%)",
            }
        )
    ratio_target("W1 tiny samples/s vs torch", "W1", 4.0)
    ratio_target("W4 iterable samples/s vs torch", "W4", 2.0)
    for entry in w3_scaling(rows):
        if (entry["loader"], entry["workers"]) != ("stoker.torch", 2):
            continue
        scaling = entry["scaling"]
        out.append(
            {
                "target": "W3 CPU-heavy two-worker scaling",
                "met": scaling >= 0.90,
                "value": scaling,
                "shown": f"{scaling:.0%} of ideal (target >= 90%)",
            }
        )
    for method in W5_METHODS:
        big = [r.variant for r in rows if r.workload == "W5" and r.variant.startswith(f"{method} ")]
        if big:
            largest = max(big, key=lambda v: int(v.split()[1]))
            need = 1 / W5_VS_TORCH
            ratio_target(f"W5 {largest} time to first batch vs torch", "W5", need, largest, lower_is_better=True)
    for method in ("spawn", "forkserver"):  # fork: for reference, in the table
        for r in rows:
            if r.workload != "W5" or not r.variant.startswith(f"{TORCH_FREE} {method} "):
                continue
            imported = int(sum(r.extra.get("torch_imported", [])))
            flag = f"; FLAGGED: torch was imported in {imported} of {len(r.values)} runs" if imported else ""
            out.append(
                {
                    "target": f"W5 {r.variant.removeprefix(TORCH_FREE + ' ')} time to first batch, fresh process "
                    "without torch (stoker)",
                    "met": r.median < TORCH_FREE_MAX_S and not imported,
                    "value": r.median,
                    "shown": f"{r.median:.3f} s ({min(r.values):.3f}-{max(r.values):.3f}), torch "
                    f"{'imported' if imported else 'not imported'}{flag} (target < {TORCH_FREE_MAX_S:g} s)",
                }
            )
    # by default an epoch starts at iter(), as torch's: its gap is compared with torch's in
    # time; the next-epoch prefetch (auto_reload=True) is what hides it within a batch gap
    gap = _find(rows, "W6", "stoker.torch", 2, "gap")
    torch_gap = _find(rows, "W6", "torch", 2, "gap")
    if gap is not None and torch_gap is not None:
        seconds = statistics.median(gap.extra["gap_s"])
        theirs = statistics.median(torch_gap.extra["gap_s"])
        out.append(
            {
                "target": "W6 epoch boundary at iter() (default): last batch of epoch k to first of k+1",
                "met": seconds <= theirs,
                "value": seconds / theirs if theirs > 0 else math.inf,
                "shown": f"{seconds * 1e3:.2f} ms against torch's {theirs * 1e3:.2f} ms (target <= torch's)",
            }
        )
    gap = _find(rows, "W6", "stoker.torch", 2, "gap auto_reload")
    if gap is not None:
        seconds = statistics.median(gap.extra["gap_s"])
        batch = statistics.median(gap.extra["median_gap_s"])
        out.append(
            {
                "target": "W6 epoch boundary with auto_reload=True: last batch of epoch k to first of k+1",
                "met": gap.median <= 1.0,
                "value": gap.median,
                "shown": f"{seconds * 1e3:.2f} ms = {gap.median:.2f} median batch gaps "
                f"({batch * 1e3:.2f} ms) (target <= 1)",
            }
        )
    cost = _find(rows, "W6", "stoker.torch", 2, "cost")
    if cost is not None:
        seconds = statistics.median(cost.extra["cost_s"])
        out.append(
            {
                "target": "W6 epoch boundary: throughput cost (E epochs vs one long epoch)",
                "met": cost.median <= 1.0,
                "value": cost.median,
                "shown": f"{seconds * 1e3:.2f} ms = {cost.median:.2f} batch times (target <= 1)",
            }
        )
    w7_workers = sorted(
        {r.workers for r in rows if r.workload == "W7" and isinstance(r.workers, int) and r.workers > 0}
    )
    for workers in w7_workers:
        need = W7_TARGET_AT_14 if workers == 14 else 1.0
        ratio_target(f"W7 b256 w={workers}", "W7", need, "b256", workers=workers)
    if w7_workers:
        workers = w7_workers[-1]
        b256, b64 = (
            _find(rows, "W7", "stoker.torch", workers, "b256"),
            _find(rows, "W7", "stoker.torch", workers, "b64"),
        )
        if b256 is not None and b64 is not None and b256.main_us_per_batch and b64.main_us_per_batch:
            growth = b256.main_us_per_batch / b64.main_us_per_batch
            out.append(
                {
                    "target": f"W7 main-process CPU per batch, b256 vs b64 (stoker.torch, w={workers})",
                    "met": growth <= W7_BATCH_COST_GROWTH,
                    "value": growth,
                    "shown": f"{b256.main_us_per_batch:.0f} µs vs {b64.main_us_per_batch:.0f} µs "
                    f"= {growth:.2f}x (target <= {W7_BATCH_COST_GROWTH:g}x)",
                }
            )
    ratio_target("W8 images 1 GB samples/s vs torch", "W8", W8_VS_TORCH)
    w8 = _find(rows, "W8", "stoker.torch", 2)
    if w8 is not None:
        gbps = w8.gbps() or 0.0
        share = gbps / ceiling
        out.append(
            {
                "target": "W8 images 1 GB GB/s vs one-core memcpy",
                "met": share >= MEMCPY_SHARE,
                "value": share,
                "shown": f"{gbps:.2f} GB/s = {share:.0%} of {ceiling:.1f} GB/s (target >= {MEMCPY_SHARE:.0%})",
            }
        )
        if ceiling2:
            share2 = gbps / ceiling2
            out.append(
                {
                    "target": "W8 images 1 GB GB/s vs two-thread memcpy",
                    "met": None,
                    "value": share2,
                    "shown": f"{gbps:.2f} GB/s = {share2:.0%} of {ceiling2:.1f} GB/s (for information, no target)",
                }
            )
    for entry in arena_use(rows):
        out.append(
            {
                "target": f"{entry['workload']} arena at steady state w={entry['workers']} ({entry['loader']}, "
                "reserved bytes / batch bytes)",
                "met": entry["batches"] <= entry["limit"],
                "value": entry["batches"],
                "shown": f"{entry['arena_bytes'] / 1e6:.1f} MB = {entry['batches']:.2f} batches of "
                f"{entry['batch_bytes'] / 1e6:.2f} MB (repetitions: {' '.join(f'{v:.2f}' for v in entry['per_rep'])}) "
                f"(target <= window {entry['window']} + 2 = {entry['limit']})",
            }
        )
    for entry in stats_overhead(rows):
        overhead = entry["overhead"]
        out.append(
            {
                "target": f"W1 stats overhead w={entry['workers']} (stoker, stats=True vs stats=False)",
                "met": overhead < STATS_OVERHEAD_MAX,
                "value": overhead,
                "shown": f"{overhead:+.1%} (median of {entry['pairs']} pairs; {_fmt_rate(entry['on'])} samples/s on, "
                f"{_fmt_rate(entry['off'])} off) (target < {STATS_OVERHEAD_MAX:.0%})",
            }
        )
    for entry in auto_vs_best(rows):
        ratio = entry["ratio"]
        out.append(
            {
                "target": f"{entry['workload']} auto vs best hand-picked (stoker)",
                "met": ratio >= AUTO_VS_BEST_MIN,
                "value": ratio,
                "shown": f"{ratio:.2f}x of the best hand-picked epoch next to it (median of "
                f"{len(entry.get('per_block', [])) or 1} blocks), from iter() to the end, the choice and "
                f"start-up included (steady state: {entry['steady_ratio']:.2f}x of w={entry['steady_best_workers']}) "
                f"(target >= {AUTO_VS_BEST_MIN:g}x)",
            }
        )
    return out


def stats_overhead(rows: list[Result]) -> list[dict[str, Any]]:
    """Per number of workers, what stats=True costs on W1 (stoker): the pairs' samples/s on
    and off (medians), each pair's off/on - 1 and their median (`pair_overhead`)."""
    out = []
    for on in rows:
        if (on.workload, on.loader, on.variant) != ("W1", "stoker", "stats on"):
            continue
        off = _find(rows, "W1", "stoker", on.workers, "stats off")
        if off is None or len(off.values) != len(on.values):
            continue
        out.append(
            {
                "workers": on.workers,
                "pairs": len(on.values),
                "overhead": pair_overhead(on.values, off.values),
                "per_pair": [b / a - 1 for a, b in zip(on.values, off.values)],
                "on": on.median,
                "off": off.median,
                "main_us_on": on.main_us_per_batch,
                "main_us_off": off.main_us_per_batch,
            }
        )
    return out


def auto_vs_best(rows: list[Result]) -> list[dict[str, Any]]:
    """Per workload of W1-W3 run with num_workers="auto": its samples/s against the best
    hand-picked setting, from iter() to the end of the epoch (the loader's choice and worker
    start-up included, as they are for the hand-picked epochs' start-up) and, for reference, in
    the steady state; and the choices. Each auto epoch ran in a block with one epoch of every
    hand-picked worker count (`AUTO_REF`): `ratio` is the median over blocks of the auto
    epoch's rate over the best epoch of its block."""
    out = []
    for workload in AUTO_WORKLOADS:
        auto = _find(rows, workload, "stoker", AUTO)
        picked = [r for r in rows if (r.workload, r.loader, r.variant) == (workload, "stoker", AUTO_REF)]
        if auto is None or not picked:
            continue

        def whole(r: Result) -> float:
            return statistics.median(r.extra["with_startup"])

        def first(r: Result) -> float | None:
            return statistics.median(r.extra["first_batch_s"]) if r.extra.get("first_batch_s") else None

        blocks = min(len(r.extra["with_startup"]) for r in [auto, *picked])
        per_block = [
            auto.extra["with_startup"][k] / max(r.extra["with_startup"][k] for r in picked) for k in range(blocks)
        ]
        best = max(picked, key=whole)
        steady_best = max(picked, key=lambda r: r.median)
        out.append(
            {
                "workload": workload,
                "auto": whole(auto),
                "best": whole(best),
                "best_workers": best.workers,
                "ratio": statistics.median(per_block),
                "per_block": per_block,
                "auto_first_s": first(auto),
                "best_first_s": first(best),
                "auto_steady": auto.median,
                "steady_best": steady_best.median,
                "steady_best_workers": steady_best.workers,
                "steady_ratio": auto.median / steady_best.median,
                "chosen_workers": [int(w) for w in auto.extra.get("chosen_workers", [])],
                "choices": list(auto.choices),
            }
        )
    return out


def w3_scaling(rows: list[Result]) -> list[dict[str, Any]]:
    """W3 scaling per loader: samples/s at N workers / (N * samples/s at 0 workers)."""
    out = []
    for r in rows:
        base = _find(rows, "W3", r.loader, 0)
        if r.workload == "W3" and r.variant == "" and isinstance(r.workers, int) and r.workers > 0 and base is not None:
            out.append({"loader": r.loader, "workers": r.workers, "scaling": r.median / (r.workers * base.median)})
    return out


def _fmt_rate(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.1f}"
