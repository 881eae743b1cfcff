"""The `stoker` console script."""

from __future__ import annotations

import argparse
import os
import sys


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="stoker", description="stoker: a data loader that keeps an accelerator fed")
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench",
        help="run the standard synthetic workloads through stoker and torch.utils.data",
        description="Runs workloads W1-W6 (see benchmarks/README.md) and prints a table.",
    )
    bench.add_argument("--workloads", type=_csv, default="W1,W2,W3,W4,W5,W6", help="comma-separated, e.g. W1,W2")
    bench.add_argument("--workers", type=_csv, default="0,1,2", help="comma-separated numbers of workers")
    bench.add_argument("--reps", type=int, default=3, help="repetitions per configuration (interleaved)")
    bench.add_argument("--quick", action="store_true", help="small sizes and one repetition: a smoke test")
    bench.add_argument("--json", default="bench-results/bench.json", help="where to write all measurements")
    bench.add_argument("--png", default="bench-results/bench.png", help="where to write the chart")
    bench.add_argument("--no-torch", action="store_true", help="skip stoker.torch and torch.utils.data")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `stoker` command."""
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    return 2


def _bench(args: argparse.Namespace) -> int:
    # Set before torch is imported (numpy already is, through the stoker package) and
    # inherited by workers, spawned ones included: workers and the main process must not
    # oversubscribe the cores with OpenMP threads. Forced rather than defaulted, so that runs
    # compare on any shell.
    os.environ["OMP_NUM_THREADS"] = "1"
    from . import _bench as bench

    workloads = [w.upper() for w in (args.workloads if isinstance(args.workloads, list) else _csv(args.workloads))]
    unknown = sorted(set(workloads) - {"W1", "W2", "W3", "W4", "W5", "W6"})
    if unknown:
        print(f"stoker bench: unknown workloads {unknown}; choose from W1..W6", file=sys.stderr)
        return 2
    raw_workers = args.workers if isinstance(args.workers, list) else _csv(args.workers)
    try:
        workers = [int(w) for w in raw_workers]
    except ValueError:
        print(f"stoker bench: --workers takes integers, got {raw_workers}", file=sys.stderr)
        return 2
    sizes = bench.Sizes.quick() if args.quick else bench.Sizes()
    reps = 1 if args.quick else args.reps
    plan = bench.Plan(workloads, workers, reps, sizes, with_torch=not args.no_torch)
    report = bench.run(plan)
    print(bench.table(report))
    bench.save_json(report, args.json)
    print(f"\nwrote {args.json}")
    if bench.chart(report, args.png):
        print(f"wrote {args.png}")
    else:
        print("matplotlib is not installed: no chart (pip install stoker[bench])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
