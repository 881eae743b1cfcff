"""Workers' private-memory growth over an epoch for a dataset of ~2 million Python objects,
with plain lists and with `stoker.SharedList`, and SharedList's item-access cost.

`python benchmarks/memory.py [--quick] [--out PATH]` (run by `make bench`).

The dataset holds 1,000,000 path strings (`/data/train/class_XXXX/img_XXXXXXXX.jpg`) and
1,000,000 int labels; `__getitem__(i)` returns `(len(path), label)`, so collation is cheap
and the epoch is mostly the reading of the objects. Under the `fork` start method, with 2
and then 4 workers, one epoch (batch_size 256, shuffle=True, so every worker touches pages
all over the lists) runs with

- `torch.utils.data.DataLoader` over the plain lists (the baseline, PyTorch issue 13246),
- `stoker.torch.DataLoader` over the plain lists,
- `stoker.DataLoader` over the same data in two `SharedList`s.

Each worker's USS (memory only it maps) and PSS (its share of all it maps) are read with
psutil's `memory_full_info()` right after the first batch (the workers have started and
fetched their first batches) and right after batch `len - 3` (the workers have made nearly
every batch and are still alive). The growth between the two, per worker and summed over
the workers, is the copy-on-write cost: each worker writes the reference count of every
object it reads, which copies that object's page into the worker. Target: the summed USS
growth with SharedList is at most 5 % of torch's with the plain lists, at each worker count.

Item access: `x = seq[i]` over the same random indices, best of several passes, for the
paths and the labels, SharedList vs list, in ns per access. Target (from the issue): at most
2x a list's, for the paths. A list's figure here is mostly cache misses (a million objects
read in random order); `paths_1000_cached` repeats it over 1,000 paths that stay in cache,
where a list read is a pointer read and SharedList's decoding dominates. Also printed: SharedList's build time and its bytes vs the
lists' (sys.getsizeof of the list and of each element: a rough figure).

Results go to stdout and to `bench-results/memory.json` (`--out`). `--quick`: 100,000
objects of each kind and fewer passes, a smoke run of a few seconds. The whole run takes
about a minute on 2 cores. No environment variables are set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil

from stoker import SharedList

MB = 1 << 20
BATCH_SIZE = 256
WORKER_COUNTS = (2, 4)
END_MARGIN = 3  # the "after" sample is taken right after batch len - END_MARGIN
USS_TARGET = 0.05
ACCESS_TARGET = 2.0


def make_paths(n: int) -> list[str]:
    return [f"/data/train/class_{i % 1000:04d}/img_{i:08d}.jpg" for i in range(n)]


def make_labels(n: int) -> list[int]:
    return [(i * 7919) % 100_000 for i in range(n)]  # mostly ints > 256: one object each


class Files:
    """A map-style dataset over paths and labels (lists or SharedLists)."""

    def __init__(self, paths: Sequence[str], labels: Sequence[int]) -> None:
        self.paths = paths
        self.labels = labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, int]:
        return len(self.paths[i]), self.labels[i]


def memory(pid: int) -> tuple[int, int] | None:
    """(USS, PSS) bytes of process `pid`, or None if it is gone."""
    try:
        info = psutil.Process(pid).memory_full_info()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return int(info.uss), int(info.pss)


def snapshot(pids: Iterable[int]) -> dict[int, tuple[int, int] | None]:
    return {pid: memory(pid) for pid in pids}


def epoch(make_loader: Callable[[], Any]) -> dict[str, Any]:
    """One epoch of the loader, sampling the workers' memory after the first batch and near
    the end."""
    loader = make_loader()
    batches = len(loader)
    me = psutil.Process()
    before: dict[int, tuple[int, int] | None] = {}
    after: dict[int, tuple[int, int] | None] = {}
    items = 0
    others = {child.pid for child in me.children()}  # not the workers (a forkserver, say)
    start = time.perf_counter()
    iterator = iter(loader)
    for k, batch in enumerate(iterator, 1):
        items += len(batch[0])
        if k == 1:
            before = snapshot(child.pid for child in me.children() if child.pid not in others)
        if k == max(batches - END_MARGIN, 2):
            after = snapshot(before)
    seconds = time.perf_counter() - start
    del iterator, loader
    gc.collect()
    workers = []
    for pid, b in before.items():
        a = after.get(pid)
        if b is None or a is None:
            continue
        workers.append(
            {
                "pid": pid,
                "uss_before_mb": b[0] / MB,
                "uss_after_mb": a[0] / MB,
                "uss_growth_mb": (a[0] - b[0]) / MB,
                "pss_before_mb": b[1] / MB,
                "pss_after_mb": a[1] / MB,
                "pss_growth_mb": (a[1] - b[1]) / MB,
            }
        )
    return {
        "batches": batches,
        "items": items,
        "epoch_s": seconds,
        "workers": workers,
        "uss_growth_total_mb": sum(w["uss_growth_mb"] for w in workers),
        "pss_growth_total_mb": sum(w["pss_growth_mb"] for w in workers),
    }


def access_ns(seq: Sequence[Any], indices: list[int], passes: int) -> float:
    """Best-of-`passes` ns per `x = seq[i]` over `indices`."""
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for i in indices:
            x = seq[i]  # noqa: F841
        best = min(best, time.perf_counter() - start)
    return best / len(indices) * 1e9


def list_bytes(values: list[Any]) -> int:
    return sys.getsizeof(values) + sum(map(sys.getsizeof, values))


def run(n: int, passes: int, access_count: int) -> dict[str, Any]:
    import torch
    import torch.utils.data

    import stoker.torch

    # torch warns that 4 workers are more than the 2 cores it suggests: that is the point here
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    paths, labels = make_paths(n), make_labels(n)
    start = time.perf_counter()
    shared_paths = SharedList(paths)
    paths_build = time.perf_counter() - start
    start = time.perf_counter()
    shared_labels = SharedList(labels)
    labels_build = time.perf_counter() - start
    build = {
        "paths_s": paths_build,
        "labels_s": labels_build,
        "paths_list_mb": list_bytes(paths) / MB,
        "labels_list_mb": list_bytes(labels) / MB,
        "paths_shared_mb": shared_paths.nbytes / MB,
        "labels_shared_mb": shared_labels.nbytes / MB,
    }

    rng = random.Random(0)
    indices = [rng.randrange(n) for _ in range(access_count)]
    access: dict[str, Any] = {}
    for name, plain, shared in (("paths", paths, shared_paths), ("labels", labels, shared_labels)):
        access_ns(plain, indices[:1000], 1)  # warm up both
        access_ns(shared, indices[:1000], 1)
        list_ns = access_ns(plain, indices, passes)
        shared_ns = access_ns(shared, indices, passes)
        access[name] = {"list_ns": list_ns, "shared_ns": shared_ns, "ratio": shared_ns / list_ns}

    # the same with 1,000 paths, all in cache: what decoding costs next to a list's pointer read
    hot_plain, hot_shared = paths[:1000], SharedList(paths[:1000])
    hot = [i % 1000 for i in indices]
    access_ns(hot_plain, hot[:1000], 1)
    access_ns(hot_shared, hot[:1000], 1)
    list_ns, shared_ns = access_ns(hot_plain, hot, passes), access_ns(hot_shared, hot, passes)
    access["paths_1000_cached"] = {"list_ns": list_ns, "shared_ns": shared_ns, "ratio": shared_ns / list_ns}

    plain_ds = Files(paths, labels)
    shared_ds = Files(shared_paths, shared_labels)
    loaders: dict[str, Callable[[int], Any]] = {
        "torch DataLoader, lists": lambda w: torch.utils.data.DataLoader(
            plain_ds, batch_size=BATCH_SIZE, shuffle=True, num_workers=w, multiprocessing_context="fork"
        ),
        "stoker.torch DataLoader, lists": lambda w: stoker.torch.DataLoader(
            plain_ds, batch_size=BATCH_SIZE, shuffle=True, num_workers=w, multiprocessing_context="fork"
        ),
        "stoker DataLoader, SharedList": lambda w: stoker.DataLoader(
            shared_ds, batch_size=BATCH_SIZE, shuffle=True, num_workers=w, multiprocessing_context="fork"
        ),
    }
    # warm up in this process first (lazy imports, first collations), so that the workers
    # inherit it instead of growing by it during the measured epoch
    tiny = Files(paths[: 4 * BATCH_SIZE], labels[: 4 * BATCH_SIZE])
    tiny_shared = Files(SharedList(tiny.paths), SharedList(tiny.labels))
    for kind, dataset in ((torch.utils.data, tiny), (stoker.torch, tiny), (stoker, tiny_shared)):
        for _ in kind.DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=0):
            pass
    runs = []
    for workers in WORKER_COUNTS:
        for name, make in loaders.items():
            result = epoch(lambda make=make, workers=workers: make(workers))
            result.update({"loader": name, "num_workers": workers})
            assert result["items"] == n, (name, result["items"])
            runs.append(result)

    targets = []
    for workers in WORKER_COUNTS:
        base = next(r for r in runs if r["num_workers"] == workers and r["loader"].startswith("torch"))
        shared = next(r for r in runs if r["num_workers"] == workers and "SharedList" in r["loader"])
        ratio = shared["uss_growth_total_mb"] / base["uss_growth_total_mb"] if base["uss_growth_total_mb"] > 0 else None
        targets.append(
            {
                "name": f"uss_growth_{workers}_workers",
                "what": f"SharedList's summed USS growth <= {USS_TARGET:.0%} of torch's with lists, {workers} workers",
                "value": ratio,
                "target": USS_TARGET,
                "met": ratio is not None and ratio <= USS_TARGET,
            }
        )
    ratio = access["paths"]["ratio"]
    targets.append(
        {
            "name": "item_access",
            "what": f"SharedList item access (paths) <= {ACCESS_TARGET:g}x a list's",
            "value": ratio,
            "target": ACCESS_TARGET,
            "met": ratio <= ACCESS_TARGET,
        }
    )
    return {
        "objects": 2 * n,
        "n": n,
        "batch_size": BATCH_SIZE,
        "start_method": "fork",
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "stoker": stoker.__version__,
            "cpus": len(os.sched_getaffinity(0)),
        },
        "build": build,
        "access": access,
        "runs": runs,
        "targets": targets,
    }


def print_report(report: dict[str, Any]) -> None:
    n = report["n"]
    print(
        f"Memory: {n:,} paths + {n:,} labels ({report['objects']:,} objects), fork, "
        f"batch {report['batch_size']}, shuffle, one epoch; MB; growth = after batch len-{END_MARGIN} "
        "minus after batch 1"
    )
    header = f"{'loader':<32} {'W':>2} {'epoch s':>8} {'USS before':>11} {'USS growth':>11} {'PSS growth':>11} {'sum USS +':>10} {'sum PSS +':>10}"
    print(header)
    print("-" * len(header))
    for r in report["runs"]:
        ws = r["workers"]
        k = max(len(ws), 1)
        print(
            f"{r['loader']:<32} {r['num_workers']:>2} {r['epoch_s']:>8.1f} "
            f"{sum(w['uss_before_mb'] for w in ws) / k:>11.1f} "
            f"{sum(w['uss_growth_mb'] for w in ws) / k:>11.1f} "
            f"{sum(w['pss_growth_mb'] for w in ws) / k:>11.1f} "
            f"{r['uss_growth_total_mb']:>10.1f} {r['pss_growth_total_mb']:>10.1f}"
        )
    print("(per-worker columns: mean over the workers)")
    b = report["build"]
    print()
    print(
        f"SharedList build: paths {b['paths_s']:.2f} s, labels {b['labels_s']:.2f} s; "
        f"size: paths {b['paths_shared_mb']:.1f} MB vs list ~{b['paths_list_mb']:.1f} MB, "
        f"labels {b['labels_shared_mb']:.1f} MB vs list ~{b['labels_list_mb']:.1f} MB"
    )
    for name, a in report["access"].items():
        print(
            f"item access, {name:<17}: list {a['list_ns']:6.0f} ns, SharedList {a['shared_ns']:6.0f} ns, "
            f"ratio {a['ratio']:.2f}x"
        )
    print()
    for t in report["targets"]:
        value = "n/a" if t["value"] is None else (f"{t['value']:.1%}" if t["target"] < 1 else f"{t['value']:.2f}x")
        print(f"target {t['what']}: {value} -> {'MET' if t['met'] else 'MISSED'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="100,000 objects of each kind, fewer passes")
    parser.add_argument("--out", default="bench-results/memory.json", help="where the JSON goes")
    args = parser.parse_args(argv)
    if args.quick:
        report = run(n=100_000, passes=2, access_count=50_000)
    else:
        report = run(n=1_000_000, passes=5, access_count=300_000)
    report["quick"] = bool(args.quick)
    print_report(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
