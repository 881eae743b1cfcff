"""What a loader's state costs: stoker.torch's StatefulDataLoader against torchdata's, same run.

Four datasets, each at 0, 2 and 8 workers (fork), through `stoker.torch.StatefulDataLoader`
and torchdata's `StatefulDataLoader` (0.11), repetitions interleaved (the loaders' order
alternates from one repetition to the next):

- `map, no state`: a map-style dataset of ints, no `state_dict` (`shuffle=True`);
- `map, RNG state`: the same, each `__getitem__` drawing from a numpy `Generator` whose
  state the dataset's `state_dict` returns (a small state);
- `iter, 1 KB state` and `iter, 1 MB state`: an `IterableDataset` sharded over the workers
  whose `state_dict` returns its position and a numpy array of 1 KB or 1 MB (a state a
  tokenizer's buffer or a shuffle buffer makes).

Per case and number of workers:

- `state_dict()`: the median time of one call mid-epoch, one call after each batch once the
  loader has delivered `4 x workers + 8` batches (every worker has then sent a state; those
  calls are the warm-up and are not timed), over `--calls` calls per repetition;
- bytes: `len(pickle.dumps(state))` of the last state taken (the whole loader's state, each
  worker's copy of the dataset's state included);
- items/s over an epoch of a fresh loader with `snapshot_every_n_steps` 1 and 8, from the
  first batch's arrival to the end of the epoch (worker start-up left out), the loop touching
  each batch and dropping it: what taking a snapshot at every batch costs, against every 8th.

Then the cost of resuming a stateless stream (a generator, no `state_dict`), which both
loaders resume by replaying each worker's stream to where it was: the time from
`load_state_dict` through `iter()` to the first batch, for a state taken after 0, 1,000 and
10,000 items (batches of 10), at 0 and 2 workers. Each resumed first batch is checked against
the batch the uninterrupted loader delivered next (`wrong` in the cell when it differs). The
per-item figure is `(time at N - time at 0) / N`: what the loader pays per replayed item over
a stream whose own items cost about a microsecond (a stream that reads or decodes pays that
per replayed item too).

Ratios are stoker / torchdata: under 1 is stoker faster or smaller for times and bytes; over 1
is stoker faster for items/s. A measurement that raises is reported in its cell as the error's
type and a note number; the notes under the table give its first line. The run sets no thread
variable (`OMP_NUM_THREADS`, ...) and takes the environment it finds; the header prints
`os.cpu_count()`: 8 workers on a machine with fewer cores are oversubscribed, and their
figures say what such a machine gives, not what 8 cores would.

Results go to stdout and `bench-results/state_cost.json` (`--out`).
Run: `python benchmarks/state_cost.py [--quick] [--workers 0,2,8]` (also run by `make bench`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data as torch_data

CASES = ("map, no state", "map, RNG state", "iter, 1 KB state", "iter, 1 MB state")
LOADERS = ("stoker", "torchdata")
SNAPSHOTS = (1, 8)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass
class Sizes:
    """How much each measurement runs; `--quick` makes every figure from a tiny run."""

    items: int  # a dataset's items (an epoch)
    batch_size: int
    calls: int  # timed state_dict() calls per repetition
    reps: int
    replay_positions: tuple[int, ...]
    replay_batch_size: int
    replay_reps: int


FULL = Sizes(
    items=8192, batch_size=16, calls=200, reps=3, replay_positions=(0, 1000, 10000), replay_batch_size=10, replay_reps=5
)
QUICK = Sizes(
    items=1024, batch_size=16, calls=10, reps=1, replay_positions=(0, 100, 400), replay_batch_size=10, replay_reps=1
)


class Ints(torch_data.Dataset):
    """Map-style: item i is i; no state of its own."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class RandomDraws(Ints):
    """Map-style: item i is (i, a draw from the dataset's own numpy Generator); the Generator's
    state is the dataset's state, one per worker replica."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.rng = np.random.default_rng(0)

    def __getitem__(self, i: int) -> tuple[int, float]:  # type: ignore[override]
        return i, float(self.rng.random())

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


def _shard() -> tuple[int, int]:
    info = torch_data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class StatefulStream(torch_data.IterableDataset):
    """Items 0..n-1, worker w of W yielding w, w+W, ...; its state is its position within its
    shard and a numpy array of `state_bytes` bytes (never changed, so returned as it is)."""

    def __init__(self, n: int, state_bytes: int) -> None:
        self.n = n
        self.blob = np.arange(state_bytes, dtype=np.uint8)
        self.position = 0

    def __iter__(self) -> Iterator[int]:
        worker, workers = _shard()
        mine = range(worker, self.n, workers)
        if self.position >= len(mine):  # the last epoch ran to its end: a new one starts
            self.position = 0
        while self.position < len(mine):
            item = mine[self.position]
            self.position += 1
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "blob": self.blob}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]
        self.blob = state["blob"]


class Stream(torch_data.IterableDataset):
    """A stateless stream (a generator, no state_dict): item i is a small int64 array, about
    a microsecond to make; worker w of W yields w, w+W, ..."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[np.ndarray]:
        worker, workers = _shard()
        for i in range(worker, self.n, workers):
            yield np.full(4, i, np.int64)


def make_dataset(case: str, n: int) -> Any:
    if case == "map, no state":
        return Ints(n)
    if case == "map, RNG state":
        return RandomDraws(n)
    if case == "iter, 1 KB state":
        return StatefulStream(n, 1 << 10)
    if case == "iter, 1 MB state":
        return StatefulStream(n, 1 << 20)
    raise ValueError(f"unknown case {case!r}")


def loader_classes() -> tuple[dict[str, type], str]:
    """The two classes measured, and a line naming stoker's (its StatefulDataLoader, or its
    DataLoader where this stoker has none yet)."""
    import torchdata
    from torchdata.stateful_dataloader import StatefulDataLoader as TorchdataLoader

    import stoker
    import stoker.torch as st

    stoker_class = getattr(st, "StatefulDataLoader", None)
    if stoker_class is None:
        stoker_class = st.DataLoader
        line = f"stoker {stoker.__version__}: stoker.torch.DataLoader (this stoker has no StatefulDataLoader)"
    else:
        line = f"stoker {stoker.__version__}: stoker.torch.StatefulDataLoader"
    line += f"; torchdata {torchdata.__version__}: torchdata.stateful_dataloader.StatefulDataLoader"
    return {"stoker": stoker_class, "torchdata": TorchdataLoader}, line


def make_loader(cls: type, dataset: Any, workers: int, batch_size: int, snapshot: int | None = None) -> Any:
    """A loader as a user makes one; `snapshot_every_n_steps` passed only when given (both
    loaders default to 1), so that a stoker without it still runs the other measurements."""
    kwargs: dict[str, Any] = {"batch_size": batch_size, "num_workers": workers}
    if not isinstance(dataset, torch_data.IterableDataset):
        kwargs["shuffle"] = True
    if workers:
        kwargs["multiprocessing_context"] = "fork"
    if snapshot is not None:
        kwargs["snapshot_every_n_steps"] = snapshot
    return cls(dataset, **kwargs)


def describe(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def measured(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """fn(*args)'s figures, or {"error": type and first line} when it raises (any failure is a
    figure of the table, not the end of the run)."""
    try:
        return fn(*args)
    except Exception as error:
        return {"error": describe(error)}
    finally:
        gc.collect()


def state_dict_cost(cls: type, case: str, workers: int, sizes: Sizes) -> dict[str, Any]:
    """Per-call state_dict() times mid-epoch (one call after each batch, the first `4 x workers
    + 8` untimed), and the pickled bytes of the last state."""
    loader = make_loader(cls, make_dataset(case, sizes.items), workers, sizes.batch_size)
    warm = 4 * workers + 8
    times: list[float] = []
    it = iter(loader)
    try:
        for step in range(warm + sizes.calls):
            next(it)
            start = time.perf_counter()
            state = loader.state_dict()
            took = time.perf_counter() - start
            if step >= warm:
                times.append(took)
    finally:
        del it
    return {"times": times, "bytes": len(pickle.dumps(state))}


def epoch_rate(cls: type, case: str, workers: int, snapshot: int, sizes: Sizes) -> dict[str, Any]:
    """Items/s of one epoch of a fresh loader, from the first batch's arrival to the end."""
    loader = make_loader(cls, make_dataset(case, sizes.items), workers, sizes.batch_size, snapshot)
    it = iter(loader)
    try:
        first = next(it)
        start = time.perf_counter()
        count = 0
        for batch in it:
            count += len(batch[0]) if isinstance(batch, list) else len(batch)
        seconds = time.perf_counter() - start
    finally:
        del it
    assert count + len(first[0] if isinstance(first, list) else first) == sizes.items, count
    return {"rate": count / seconds}


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)


def replay_first_batch(cls: type, workers: int, position: int, sizes: Sizes) -> dict[str, Any]:
    """Seconds from load_state_dict through iter() to the first batch, for a state taken after
    `position` items of a stateless stream; and whether that batch is the one the
    uninterrupted loader delivered next."""
    n = max(sizes.replay_positions) + 4 * sizes.replay_batch_size * max(workers, 1)
    batches = position // sizes.replay_batch_size
    source = make_loader(cls, Stream(n), workers, sizes.replay_batch_size)
    it = iter(source)
    try:
        for _ in range(batches):
            next(it)
        state = source.state_dict()
        expected = next(it)
    finally:
        del it
    del source
    gc.collect()
    loader = make_loader(cls, Stream(n), workers, sizes.replay_batch_size)
    start = time.perf_counter()
    loader.load_state_dict(state)
    resumed = iter(loader)
    try:
        got = next(resumed)
        seconds = time.perf_counter() - start
    finally:
        del resumed
    return {"seconds": seconds, "exact": _same(got, expected)}


def machine() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "os_cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        **{name: os.environ.get(name, "unset") for name in THREAD_VARIABLES},
    }


def run(sizes: Sizes, workers_list: list[int]) -> dict[str, Any]:
    classes, which = loader_classes()
    raw: dict[str, list[dict[str, Any]]] = {}

    def keep(key: tuple[Any, ...], figures: dict[str, Any]) -> None:
        raw.setdefault("|".join(str(k) for k in key), []).append(figures)

    flip = 0
    for _ in range(sizes.reps):
        for case in CASES:
            for workers in workers_list:
                order = LOADERS if flip % 2 == 0 else LOADERS[::-1]
                flip += 1
                for name in order:
                    cls = classes[name]
                    keep(("sd", case, workers, name), measured(state_dict_cost, cls, case, workers, sizes))
                    for snapshot in SNAPSHOTS:
                        keep(
                            ("rate", case, workers, snapshot, name),
                            measured(epoch_rate, cls, case, workers, snapshot, sizes),
                        )
    for _ in range(sizes.replay_reps):
        for workers in [w for w in (0, 2) if w in workers_list] or [0]:
            for position in sizes.replay_positions:
                order = LOADERS if flip % 2 == 0 else LOADERS[::-1]
                flip += 1
                for name in order:
                    cls = classes[name]
                    keep(
                        ("replay", workers, position, name),
                        measured(replay_first_batch, cls, workers, position, sizes),
                    )
    return summarise(raw, sizes, workers_list, which)


def _first_error(runs: list[dict[str, Any]]) -> str | None:
    return next((r["error"] for r in runs if "error" in r), None)


def summarise(
    raw: dict[str, list[dict[str, Any]]], sizes: Sizes, workers_list: list[int], which: str
) -> dict[str, Any]:
    """Medians per cell (or the cell's error), in the report's JSON shape."""

    def cell(key: str, figure: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> dict[str, Any]:
        runs = raw[key]
        error = _first_error(runs)
        return {"error": error} if error else figure(runs)

    def sd(runs: list[dict[str, Any]]) -> dict[str, Any]:
        times = [t for r in runs for t in r["times"]]
        return {
            "median_us": statistics.median(times) * 1e6,
            "p90_us": sorted(times)[int(0.9 * (len(times) - 1))] * 1e6,
            "calls": len(times),
            "bytes": runs[-1]["bytes"],
        }

    def rate(runs: list[dict[str, Any]]) -> dict[str, Any]:
        rates = [r["rate"] for r in runs]
        return {"items_per_s": statistics.median(rates), "per_rep": rates}

    def replay(runs: list[dict[str, Any]]) -> dict[str, Any]:
        seconds = [r["seconds"] for r in runs]
        return {"ms": statistics.median(seconds) * 1e3, "per_rep_ms": [s * 1e3 for s in seconds],
                "exact": all(r["exact"] for r in runs)}  # fmt: skip

    states: list[dict[str, Any]] = []
    rates: list[dict[str, Any]] = []
    replays: list[dict[str, Any]] = []
    for case in CASES:
        for workers in workers_list:
            states.append(
                {"case": case, "workers": workers, **{n: cell(f"sd|{case}|{workers}|{n}", sd) for n in LOADERS}}
            )
            for snapshot in SNAPSHOTS:
                rates.append(
                    {
                        "case": case,
                        "workers": workers,
                        "snapshot_every_n_steps": snapshot,
                        **{n: cell(f"rate|{case}|{workers}|{snapshot}|{n}", rate) for n in LOADERS},
                    }
                )
    for key in raw:
        if key.startswith("replay|"):
            _, replay_workers, position, name = key.split("|")
            if name == LOADERS[0]:
                replays.append(
                    {
                        "workers": int(replay_workers),
                        "position": int(position),
                        **{n: cell(f"replay|{replay_workers}|{position}|{n}", replay) for n in LOADERS},
                    }
                )
    for row in replays:  # per replayed item, against the same workers' position 0
        base = next(r for r in replays if r["workers"] == row["workers"] and r["position"] == 0)
        for n in LOADERS:
            if row["position"] and "ms" in row[n] and "ms" in base[n]:
                row[n]["us_per_item"] = (row[n]["ms"] - base[n]["ms"]) * 1e3 / row["position"]
    return {
        "loaders": which,
        "machine": machine(),
        "sizes": asdict(sizes),
        "workers": workers_list,
        "start_method": "fork",
        "state_dict": states,
        "epoch": rates,
        "replay": replays,
    }


class Notes:
    """Errors shown in cells as `Type [k]`, listed under the table with their first line."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def cell(self, error: str) -> str:
        if error not in self.lines:
            self.lines.append(error)
        return f"{error.split(':', 1)[0]} [{self.lines.index(error) + 1}]"


def _table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print(f"\n{title}")
    line = "  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> str:
    if key in a and key in b and b[key]:
        return f"{a[key] / b[key]:.2f}x"
    return "-"


def print_report(report: dict[str, Any]) -> None:
    m = report["machine"]
    print("state_dict() and resume costs: stoker.torch against torchdata, same run")
    print(report["loaders"])
    over = [w for w in report["workers"] if w > (m["os_cpu_count"] or 1)]
    print(
        f"os.cpu_count() = {m['os_cpu_count']}, usable CPUs {m['usable_cpus']}, torch {m['torch']} "
        f"({m['torch_threads']} threads), python {m['python']}, "
        + ", ".join(f"{v}={m[v]}" for v in THREAD_VARIABLES)
        + "; workers forked"
    )
    if over:
        print(
            f"NOTE: {', '.join(map(str, over))} workers on {m['os_cpu_count']} CPUs are oversubscribed: "
            "those rows say what this machine gives, not what as many cores would"
        )
    s = report["sizes"]
    notes = Notes()

    def show(figures: dict[str, Any], key: str, fmt: str) -> str:
        if "error" in figures:
            return notes.cell(figures["error"])
        return format(figures[key], fmt)

    rows = []
    for r in report["state_dict"]:
        a, b = r["stoker"], r["torchdata"]
        rows.append(
            [r["case"], str(r["workers"]), show(a, "median_us", ".1f"), show(b, "median_us", ".1f"),
             _ratio(a, b, "median_us"), show(a, "bytes", ","), show(b, "bytes", ","), _ratio(a, b, "bytes")]
        )  # fmt: skip
    _table(
        f"state_dict() mid-epoch: median µs of one call ({s['calls']} calls x {s['reps']} reps, after "
        f"4 x workers + 8 batches), and len(pickle.dumps(state)); {s['items']:,} items, batch {s['batch_size']}",
        ["case", "workers", "µs stoker", "µs torchdata", "ratio", "bytes stoker", "bytes torchdata", "ratio"],
        rows,
    )

    rows = []
    for case in CASES:
        for workers in report["workers"]:
            pair = {
                e["snapshot_every_n_steps"]: e for e in report["epoch"] if e["case"] == case and e["workers"] == workers
            }
            row = [case, str(workers)]
            for snapshot in SNAPSHOTS:
                a, b = pair[snapshot]["stoker"], pair[snapshot]["torchdata"]
                row += [show(a, "items_per_s", ",.0f"), show(b, "items_per_s", ",.0f"), _ratio(a, b, "items_per_s")]
            for n in LOADERS:
                row.append(_ratio(pair[1][n], pair[8][n], "items_per_s"))
            rows.append(row)
    _table(
        f"items/s over an epoch (first batch to last; median of {s['reps']}), snapshot_every_n_steps 1 and 8; "
        "ratio: stoker / torchdata; 1/8: each loader's rate at 1 over its rate at 8",
        ["case", "workers", "1: stoker", "1: torchdata", "ratio", "8: stoker", "8: torchdata", "ratio",
         "stoker 1/8", "torchdata 1/8"],
        rows,
    )  # fmt: skip

    rows = []
    for r in report["replay"]:
        a, b = r["stoker"], r["torchdata"]
        row = [str(r["workers"]), f"{r['position']:,}"]
        for figures in (a, b):
            text = show(figures, "ms", ".1f")
            row.append(text if "error" in figures or figures["exact"] else text + " (wrong batch)")
        row.append(_ratio(a, b, "ms"))
        for figures in (a, b):
            shown = "error" in figures or ("us_per_item" in figures and figures["exact"])
            row.append(show(figures, "us_per_item", ".2f") if shown else "-")
        rows.append(row)
    _table(
        f"resuming a stateless stream (replayed): ms from load_state_dict + iter() to the first batch "
        f"(batch {s['replay_batch_size']}, median of {s['replay_reps']}); µs per replayed item over position 0",
        ["workers", "position", "ms stoker", "ms torchdata", "ratio", "µs/item stoker", "µs/item torchdata"],
        rows,
    )
    if notes.lines:
        print("\nerrors:")
        for k, line in enumerate(notes.lines, 1):
            print(f"[{k}] {line if len(line) <= 300 else line[:297] + '...'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (a smoke test)")
    parser.add_argument("--workers", default="0,2,8", help="numbers of workers, comma-separated (default 0,2,8)")
    parser.add_argument("--out", default="bench-results/state_cost.json")
    args = parser.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    # torch's "more workers than CPUs" warning, once per loader: the header says it once
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    started = time.perf_counter()
    report = run(QUICK if args.quick else FULL, workers)
    report["quick"] = args.quick
    report["wall_s"] = time.perf_counter() - started
    print_report(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwall time {report['wall_s']:.0f} s; wrote {out}")
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
