"""The benchmark harness's command line: `python benchmarks/run.py [options]` from a clone
(`stoker-bench [options]` once `make setup` has installed the harness). See benchmarks/README.md."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9", "W10", "W11", "W12")
# the workloads of the `bench` package (one table and chart); the others print tables of their own
BENCH_WORKLOADS = {"W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8"}


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stoker-bench",
        description="Runs workloads W1-W12 (see benchmarks/README.md) through stoker and "
        "torch.utils.data and prints a table. Run from a clone: python benchmarks/run.py [options]. "
        "It measures in the environment it is started in: it sets no thread variables "
        "(OMP_NUM_THREADS, ...) and records the ones it saw in the report.",
    )
    parser.add_argument("--workloads", type=_csv, default=",".join(WORKLOADS), help="comma-separated, e.g. W1,W2")
    parser.add_argument(
        "--workers",
        type=_csv,
        default=None,
        help="comma-separated numbers of workers (default 0,1,2; W10: 1,2,4,8; W12: 2,4,8,14; with --gpu 4,8,14)",
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions per configuration (interleaved)")
    parser.add_argument("--quick", action="store_true", help="small sizes and one repetition: a smoke test")
    parser.add_argument(
        "--out-dir", default="bench-results", help="where bench.json and bench.png go (default: bench-results)"
    )
    parser.add_argument("--json", default=None, help="where to write all measurements (default: OUT_DIR/bench.json)")
    parser.add_argument("--png", default=None, help="where to write the chart (default: OUT_DIR/bench.png)")
    parser.add_argument("--no-torch", action="store_true", help="skip stoker.torch and torch.utils.data")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="instead of W1-W8: W7's pipeline end to end into a fixed CUDA step, with and without "
        "stoker.torch.to_device (JSON default: OUT_DIR/gpubench.json); skips, exit 0, without a GPU",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the benchmark harness (`python benchmarks/run.py`, `stoker-bench`)."""
    return _bench(_parser().parse_args(argv))


def _bench(args: argparse.Namespace) -> int:
    # No thread variable (OMP_NUM_THREADS, ...) is set here and torch's thread count is left
    # alone: the loaders are measured in the environment users run them in, and the report
    # records what that was.
    from . import bench as bench

    workloads = [w.upper() for w in (args.workloads if isinstance(args.workloads, list) else _csv(args.workloads))]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        print(f"stoker-bench: unknown workloads {unknown}; choose from W1..W12", file=sys.stderr)
        return 2
    default_workers = args.workers is None  # --gpu has a default of its own
    raw_workers = _csv("0,1,2") if default_workers else args.workers
    raw_workers = raw_workers if isinstance(raw_workers, list) else _csv(raw_workers)
    try:
        workers = [int(w) for w in raw_workers]
    except ValueError:
        print(f"stoker-bench: --workers takes integers, got {raw_workers}", file=sys.stderr)
        return 2
    if any(w < 0 for w in workers):
        print(f"stoker-bench: --workers takes numbers >= 0, got {raw_workers}", file=sys.stderr)
        return 2
    if args.reps < 1:
        print(f"stoker-bench: --reps takes a number >= 1, got {args.reps}", file=sys.stderr)
        return 2
    if args.gpu:
        from . import gpubench

        if args.no_torch:
            print(
                "stoker-bench: --gpu runs stoker.torch and torch.utils.data: it cannot take --no-torch", file=sys.stderr
            )
            return 2
        gpu_json = args.json or os.path.join(args.out_dir, "gpubench.json")
        return gpubench.main(None if default_workers else workers, args.reps, quick=args.quick, json_path=gpu_json)
    with_torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    if "W7" in workloads and not with_torch:
        print("stoker-bench: W7 needs torch (it runs stoker.torch and torch.utils.data): skipped", file=sys.stderr)
    json_path = args.json or os.path.join(args.out_dir, "bench.json")
    png_path = args.png or os.path.join(args.out_dir, "bench.png")
    sizes = bench.Sizes.quick() if args.quick else bench.Sizes()
    reps = 1 if args.quick else args.reps
    if set(workloads) & BENCH_WORKLOADS:
        plan = bench.Plan(workloads, workers, reps, sizes, with_torch=with_torch)
        report = bench.run(plan)
        print(bench.table(report))
        bench.save_json(report, json_path)
        print(f"\nwrote {json_path}")
        if bench.chart(report, png_path):
            print(f"wrote {png_path}")
        elif importlib.util.find_spec("matplotlib") is None:
            print("matplotlib is not installed: no chart (pip install stoker[bench])")
        else:
            print("no samples/s figures: no chart")
    if "W2" in workloads:  # stoker.ray on the images workload; one skip line without Ray
        from . import raybench

        print()
        raybench.main(quick=args.quick, with_torch=with_torch, json_path=os.path.join(args.out_dir, "raybench.json"))
    if "W9" in workloads:  # real JPEGs through the standard and the fused pipelines
        from . import jpegbench

        print()
        if not with_torch:
            print("stoker-bench: W9 needs torch (it runs stoker.torch and torch.utils.data): skipped")
        else:
            jpegbench.main(workers, reps, args.quick, os.path.join(args.out_dir, "jpegbench.json"))
    if "W10" in workloads or "W11" in workloads:  # start-up per worker count; many small batches
        from . import startbench

        print()
        if not with_torch:
            print("stoker-bench: W10/W11 need torch (they run stoker.torch and torch.utils.data): skipped")
        else:
            startbench.main(
                None if default_workers else workers, reps, args.quick, os.path.join(args.out_dir, "startbench.json")
            )
    if "W12" in workloads:  # torchvision's ImageNet training pipeline over an ImageFolder of JPEGs
        from . import w12

        print()
        if not with_torch:
            print("stoker-bench: W12 needs torch (it runs stoker.torch and torch.utils.data): skipped")
        else:
            w12.main(None if default_workers else workers, reps, args.quick, os.path.join(args.out_dir, "w12.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
