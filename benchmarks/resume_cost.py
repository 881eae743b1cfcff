"""What resuming costs, and what `seed_each_batch=True` costs.

1. Time to the first batch: a fresh epoch against a resume deep into an epoch (batch
   100,000 of a 1.6M-sample shuffled dataset), same loader configuration, interleaved
   repetitions. The resumed state is one taken at batch 1 with its position moved to
   100,000 (a state is a position plus the draws' origin, so this is the state a run
   interrupted there would have saved); the target is within 10 % of the fresh epoch.
2. Throughput with `seed_each_batch=True` against False on a numpy images workload and a
   torch tensor-crop workload (torch optional), interleaved pairs; target: under 3 %.

Run: `python benchmarks/resume_cost.py` (also run by `make bench`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

import stoker


class Tiny(stoker.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i], np.int64)


class Images(stoker.Dataset):
    """256 distinct 3x256x256 uint8 images, a random 224 crop and flip per sample."""

    def __init__(self, n: int = 2048) -> None:
        self.n = n
        self.sources = np.random.default_rng(0).integers(0, 255, size=(256, 3, 256, 256), dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        image = self.sources[i % len(self.sources)]
        y, x = np.random.randint(0, 32, size=2)
        crop = image[:, y : y + 224, x : x + 224]
        return crop[:, :, ::-1].copy() if np.random.rand() < 0.5 else crop.copy()


class TensorCrops(Images):
    def __getitem__(self, i: int) -> Any:
        import torch

        image = torch.from_numpy(self.sources[i % len(self.sources)])
        y, x = (int(v) for v in torch.randint(0, 32, (2,)))
        crop = image[:, y : y + 224, x : x + 224]
        return crop.flip(-1) if torch.rand(()) < 0.5 else crop.clone()


def first_batch_seconds(loader: Any, state: dict[str, Any] | None) -> float:
    start = time.perf_counter()
    if state is not None:
        loader.load_state_dict(state)
    it = iter(loader)
    next(it)
    took = time.perf_counter() - start
    del it
    return took


def resume_cost(args: argparse.Namespace) -> None:
    def make() -> Any:
        return stoker.DataLoader(
            Tiny(args.samples), batch_size=args.batch_size, shuffle=True, generator=0, num_workers=args.workers
        )

    probe = make()
    it = iter(probe)
    next(it)
    state = probe.state_dict()
    del it
    state["position"] = args.position
    fresh, resumed = [], []
    for _ in range(args.reps):
        fresh.append(first_batch_seconds(make(), None))
        resumed.append(first_batch_seconds(make(), dict(state)))
    f, r = statistics.median(fresh), statistics.median(resumed)
    print(
        f"first batch, {args.samples:,} samples, batch {args.batch_size}, {args.workers} workers "
        f"(median of {args.reps}): fresh epoch {f * 1e3:.1f} ms, resumed at batch {args.position:,} "
        f"{r * 1e3:.1f} ms = {r / f:.2f}x  [{'MET' if r <= 1.1 * f else 'MISSED'} target <= 1.10x]"
    )


def throughput(dataset: Any, seed_each_batch: bool, args: argparse.Namespace) -> float:
    loader = stoker.DataLoader(
        dataset, batch_size=64, num_workers=args.workers, seed_each_batch=seed_each_batch, persistent_workers=True
    )
    for _ in loader:  # warm: workers started, arena slots made
        break
    start = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    return count / (time.perf_counter() - start)


def seeding_cost(args: argparse.Namespace) -> None:
    workloads: list[tuple[str, Any]] = [("numpy images", Images(args.images))]
    try:
        import torch  # noqa: F401

        workloads.append(("tensor crops", TensorCrops(args.images)))
    except ImportError:
        print("tensor crops: skipped (torch is not installed)")
    for name, dataset in workloads:
        ratios = []
        for _ in range(args.reps):
            off = throughput(dataset, False, args)
            on = throughput(dataset, True, args)
            ratios.append(on / off)
        cost = 1 - statistics.median(ratios)
        print(
            f"seed_each_batch=True, {name}, {args.workers} workers: {cost * 100:+.1f} % throughput cost "
            f"(median of {args.reps} interleaved pairs) [{'MET' if cost < 0.03 else 'MISSED'} target < 3 %]"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3_200_000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--position", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    resume_cost(args)
    seeding_cost(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
