"""Memory held when a loop keeps one field of every batch, stoker.torch against torch.

Two cases, each the loop an evaluation or a segmentation run writes:

- labels: samples `(3x224x224 uint8 image, int label)`; the loop keeps every batch's labels
  (`labels.append(y)`), what gathering targets or predictions does;
- masks: samples `(3x224x224 uint8 image, 1x224x224 uint8 mask)`; the loop keeps every
  batch's masks.

`batch_size=64`, `num_workers=2`, fork, 150 batches (`--batches`). Each run is a fresh
process (so that one run's memory never counts in another's), and the loaders alternate,
repetition by repetition (`--reps`). Memory is the system's shared memory (`Shmem` of
/proc/meminfo: the arena's memfds, torch's shared tensors) plus the main process's private
anonymous memory (`RssAnon`), each as grown since before the loader was made:

- held: right after the loop, the loader alive (its workers gone or idle);
- after: once the loader and its iterator are deleted and collected, the user's list alone;
- shm after: the shared memory part of `after`.

The rate is samples per second over the loop. Targets: stoker's held and after at most 1.1x
torch's, in both cases. Other processes that allocate shared memory during a run disturb the
figures: run it on a quiet machine. Results go to stdout and `bench-results/kept_fields.json`.

Run: `python benchmarks/kept_fields.py [--quick]` (also run by `make bench`).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MB = 1 << 20
TARGET = 1.1


def _kib_field(path: str, name: str) -> int:
    """The bytes of a "Name:  N kB" line of a /proc file."""
    with open(path) as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} line in {path}")


def meminfo_shmem() -> int:
    return _kib_field("/proc/meminfo", "Shmem")


def rss_anon() -> int:
    return _kib_field("/proc/self/status", "RssAnon")


def one_run(loader_name: str, case: str, batches: int) -> dict[str, Any]:
    """One loop in this process; returns its figures."""
    import numpy as np
    import torch
    import torch.utils.data as torch_data

    import stoker.torch as st

    module: Any = st if loader_name == "stoker.torch" else torch_data
    batch_size = 64

    class Samples(torch_data.Dataset):
        def __len__(self) -> int:
            return batches * batch_size

        def __getitem__(self, i: int) -> Any:
            image = np.full((3, 224, 224), i % 251, np.uint8)
            if case == "labels":
                return image, i
            return image, np.full((1, 224, 224), (i * 7) % 251, np.uint8)

    gc.collect()
    shm0, anon0 = meminfo_shmem(), rss_anon()
    loader = module.DataLoader(Samples(), batch_size=batch_size, num_workers=2, multiprocessing_context="fork")
    kept: list[Any] = []
    start = time.perf_counter()
    for _, field in loader:
        kept.append(field)
    seconds = time.perf_counter() - start
    field = None
    gc.collect()
    time.sleep(0.5)  # let exiting workers give back what they held
    held = meminfo_shmem() - shm0 + rss_anon() - anon0
    del loader
    gc.collect()
    time.sleep(0.5)
    shm_after = meminfo_shmem() - shm0
    after = shm_after + rss_anon() - anon0
    kept_bytes = sum(t.numel() * t.element_size() for t in kept if isinstance(t, torch.Tensor))
    return {
        "held": held,
        "after": after,
        "shm_after": shm_after,
        "kept_bytes": kept_bytes,
        "samples_per_s": batches * batch_size / seconds,
    }


def run(batches: int, reps: int) -> dict[str, Any]:
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(reps):
        for case in ("labels", "masks"):
            for name in ("torch.utils.data", "stoker.torch"):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", name, case, "--batches", str(batches)],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                rows.setdefault((case, name), []).append(json.loads(out.stdout.splitlines()[-1]))
    table = []
    for (case, name), runs in rows.items():
        table.append(
            {
                "case": case,
                "loader": name,
                **{key: statistics.median(r[key] for r in runs) for key in runs[0]},
                "runs": runs,
            }
        )
    targets = []
    for case in ("labels", "masks"):
        torch_row = next(r for r in table if r["case"] == case and r["loader"] == "torch.utils.data")
        stoker_row = next(r for r in table if r["case"] == case and r["loader"] == "stoker.torch")
        for key in ("held", "after"):
            # a floor of 1 MiB: a few hundred KiB of labels either way is no difference
            ratio = max(stoker_row[key], MB) / max(torch_row[key], MB)
            targets.append({"what": f"{case} {key}: stoker.torch / torch", "ratio": ratio, "met": ratio <= TARGET})
    return {"batches": batches, "reps": reps, "rows": table, "targets": targets}


def print_report(report: dict[str, Any]) -> None:
    print(f"Kept fields: {report['batches']} batches of 64, 2 workers, fork; medians of {report['reps']} runs")
    header = f"{'case':<7} {'loader':<17} {'kept MiB':>9} {'held MiB':>9} {'after MiB':>10} {'shm after':>10} {'samples/s':>10}"
    print(header)
    print("-" * len(header))
    for r in report["rows"]:
        print(
            f"{r['case']:<7} {r['loader']:<17} {r['kept_bytes'] / MB:>9.1f} {r['held'] / MB:>9.1f} "
            f"{r['after'] / MB:>10.1f} {r['shm_after'] / MB:>10.1f} {r['samples_per_s']:>10.0f}"
        )
    for t in report["targets"]:
        print(f"target {t['what']} <= {TARGET}: {t['ratio']:.2f} -> {'MET' if t['met'] else 'MISSED'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="20 batches, one repetition")
    parser.add_argument("--out", default="bench-results/kept_fields.json")
    parser.add_argument("--one", nargs=2, metavar=("LOADER", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.one[0], args.one[1], args.batches)))
        return
    batches, reps = (20, 1) if args.quick else (args.batches, args.reps)
    report = run(batches, reps)
    print_report(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
