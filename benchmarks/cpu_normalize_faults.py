"""The main process's page faults and images/s when images are normalised on the CPU: torch's
DataLoader with ToTensor + Normalize in the workers against stoker.torch shipping uint8 and
normalising in `to_device(loader, "cpu", transform=normalize(mean, std))`, before and after
to_device's output pool.

Samples are (3x224x224 uint8 image, int label), cut from a bank of 16 random HWC images (what a
decoded Pillow image is), `batch_size=256`, `num_workers=2`, fork, an epoch of 16 batches
(`--batches`). Rows:

- torch: `torch.utils.data.DataLoader`, each worker making float32 CHW from the HWC uint8 as
  torchvision's `ToTensor()` then `Normalize(mean, std)` do (written in torch: permute,
  `float().div(255)`, `sub_(mean).div_(std)`), collated and sent in torch's shared memory;
- stoker before: `stoker.torch.DataLoader`, each worker making uint8 CHW (`PILToTensor()`),
  then `to_device(loader, "cpu", transform=lambda batch: norm(batch))`: a transform without
  the `allocate` keyword, so each batch's floats are fresh memory (to_device's code before the
  pool: the same-run baseline);
- stoker after: the same with `transform=norm` (`norm = normalize(mean, std)`), which takes
  `allocate`: the floats go into to_device's output pool.

The loop reads every batch whole (`images.sum()`), as a training step would; so torch's rows
fault in the pages of the shared memory each batch arrives in, and stoker's rows the pages of
its floats where they are fresh. Each row and repetition runs in a fresh process (no process
history shared), rows interleaved repetition by repetition (`--reps`, medians). Figures, from
`resource.getrusage(RUSAGE_SELF)` deltas of the main process and `time.perf_counter()`:

- faults/img: minor page faults per image over the steady part (batches 4 to the end: the
  pool is full, and the workers' start is not counted), and over the whole epoch from `iter()`;
- img/s: images per second over the same two spans;
- main ms/img: the main process's CPU (user + sys) per image over the steady part.

Run: `python benchmarks/cpu_normalize_faults.py [--batches N] [--reps N] [--rows torch,before,after]`;
results go to stdout and to `bench-results/cpu_normalize_faults.json` (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
SIDE = 224
BANK = 16
WARM = 4  # batches before the steady part: the pool fills over depth + 2 of them
ROWS = ("torch", "before", "after")
LABELS = {"torch": "torch DataLoader + ToTensor/Normalize", "before": "stoker, no reuse", "after": "stoker, reuse"}


class HwcImages:
    """`n` samples (HWC uint8 image, label) from a bank of random images; `transform` is applied
    to the image in the worker."""

    def __init__(self, n: int, transform: Any) -> None:
        import numpy as np

        rng = np.random.default_rng(0)
        self.n = n
        self.bank = [rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8) for _ in range(BANK)]
        self.transform = transform

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.transform(self.bank[i % BANK]), i


def to_float_normalized(hwc: Any) -> Any:
    """ToTensor() then Normalize(MEAN, STD), in torch."""
    import torch

    x = torch.from_numpy(hwc).permute(2, 0, 1).contiguous().float().div(255)
    return x.sub_(torch.tensor(MEAN).view(3, 1, 1)).div_(torch.tensor(STD).view(3, 1, 1))


def to_uint8_chw(hwc: Any) -> Any:
    """PILToTensor(): uint8 CHW."""
    import torch

    return torch.from_numpy(hwc).permute(2, 0, 1).contiguous()


def usage() -> tuple[int, float]:
    """(minor page faults, CPU seconds) of this process so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_minflt, own.ru_utime + own.ru_stime


def one(row: str, batches: int, batch_size: int, workers: int) -> dict[str, Any]:
    """Run one epoch of `row` in this process; its figures."""
    import torch

    n = batches * batch_size
    if row == "torch":
        from torch.utils.data import DataLoader as TorchLoader

        feed: Any = TorchLoader(HwcImages(n, to_float_normalized), batch_size=batch_size, num_workers=workers)
    else:
        from stoker.torch import DataLoader, normalize, to_device

        norm = normalize(MEAN, STD)
        transform = norm if row == "after" else (lambda batch: norm(batch))
        loader = DataLoader(HwcImages(n, to_uint8_chw), batch_size=batch_size, num_workers=workers)
        feed = to_device(loader, "cpu", transform=transform)
    total = 0.0
    start_faults, _ = usage()
    start = time.perf_counter()
    count = 0
    for index, (images, _labels) in enumerate(feed):
        if index == WARM:
            steady_faults, steady_cpu = usage()
            steady_start = time.perf_counter()
        assert images.dtype == torch.float32 and images.shape == (batch_size, 3, SIDE, SIDE)
        total += float(images.sum())  # the step reads the whole batch
        count += 1
        del images, _labels
    end = time.perf_counter()
    end_faults, end_cpu = usage()
    assert count == batches, (count, batches)
    steady_images = (batches - WARM) * batch_size
    return {
        "row": row,
        "faults_per_image": (end_faults - steady_faults) / steady_images,
        "epoch_faults_per_image": (end_faults - start_faults) / n,
        "images_per_s": steady_images / (end - steady_start),
        "epoch_images_per_s": n / (end - start),
        "main_ms_per_image": 1000 * (end_cpu - steady_cpu) / steady_images,
        "checksum": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16, help="batches per epoch (more than 4)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each row, interleaved")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--out", default="bench-results/cpu_normalize_faults.json", help="where the JSON goes")
    parser.add_argument("--one", choices=ROWS, help=argparse.SUPPRESS)  # a row, in this process
    args = parser.parse_args()
    if args.batches <= WARM:
        parser.error(f"--batches should be more than {WARM}, but got {args.batches}")
    if args.one:
        print(json.dumps(one(args.one, args.batches, args.batch_size, args.workers)))
        return
    rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows should name rows of {', '.join(ROWS)}, but got {', '.join(unknown)}")
    results: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    for _ in range(args.reps):
        for row in rows:
            command = [sys.executable, __file__, "--one", row, "--batches", str(args.batches)]
            command += ["--batch-size", str(args.batch_size), "--workers", str(args.workers)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
            if done.returncode != 0:
                sys.exit(f"row {row} failed:\n{done.stderr}")
            results[row].append(json.loads(done.stdout.strip().splitlines()[-1]))
    keys = ("faults_per_image", "epoch_faults_per_image", "images_per_s", "epoch_images_per_s", "main_ms_per_image")
    medians = {row: {key: statistics.median(r[key] for r in results[row]) for key in keys} for row in rows}
    print(
        f"to_device on the CPU: batch {args.batch_size} of 3x{SIDE}x{SIDE}, {args.workers} workers, "
        f"{args.batches} batches an epoch, steady part from batch {WARM}; medians of {args.reps}; "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"{'row':40} {'faults/img':>10} {'x torch':>8} {'epoch f/img':>11} {'img/s':>8} {'x torch':>8} "
        f"{'epoch img/s':>11} {'main ms/img':>11}"
    )
    base = medians.get("torch")
    for row in rows:
        m = medians[row]
        faults_x = f"{m['faults_per_image'] / base['faults_per_image']:.2f}x" if base else "-"
        rate_x = f"{m['images_per_s'] / base['images_per_s']:.2f}x" if base else "-"
        print(
            f"{LABELS[row]:40} {m['faults_per_image']:10.2f} {faults_x:>8} {m['epoch_faults_per_image']:11.2f} "
            f"{m['images_per_s']:8.0f} {rate_x:>8} {m['epoch_images_per_s']:11.0f} {m['main_ms_per_image']:11.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "args": vars(args),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "medians": medians,
        "runs": results,
    }
    out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
