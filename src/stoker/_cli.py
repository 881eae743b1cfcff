"""The `stoker` console script: `stoker doctor`, `stoker index URL` (and `--version`). The
benchmarks are not here: they run from a clone of the repository (benchmarks/run.py)."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="stoker", description="stoker: a data loader that keeps an accelerator fed")
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser(
        "doctor",
        help="is the loader the bottleneck? measure a dataset or DataLoader and recommend a setting",
        description="MODULE:FACTORY names a zero-argument callable (MODULE: a dotted module name or a "
        "path to a .py file) that returns a map-style or iterable dataset or a DataLoader (stoker's, "
        "stoker.torch's or torch's). Within --seconds it times dataset[i] and collate in this process, "
        "sweeps num_workers (processes and threads) and prefetch_factor, reads each worker process's "
        "memory, and prints a table, a recommendation, the headroom and the traps it found.",
    )
    doctor.add_argument("target", metavar="MODULE:FACTORY", help="e.g. examples/image_pipeline.py:make_loader")
    doctor.add_argument("--seconds", type=float, default=60.0, help="time budget for the whole run (default 60)")
    doctor.add_argument(
        "--batch-size", type=int, default=32, help="batch size when FACTORY returns a dataset (default 32)"
    )
    doctor.add_argument(
        "--step-ms", type=float, default=None, help="your model's step per batch in ms: estimate and measure readiness"
    )
    doctor.add_argument("--plot", default=None, metavar="PNG", help="write a chart (needs matplotlib)")
    doctor.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON")
    index = commands.add_parser(
        "index",
        help="scan the shards at a URL and write their index (stoker-index.json) beside them",
        description="Lists the prefix once, reads every .tar (WebDataset layout) or .parquet object "
        "under it, and writes stoker-index.json there: each shard's size, sha256, samples and where "
        "each sample is. A loader reads only that file at its start. s3:// takes its endpoint from "
        "AWS_ENDPOINT_URL and its credentials from the environment.",
    )
    index.add_argument("url", metavar="URL", help="the prefix: s3://bucket/data, file:///path or a local folder")
    index.add_argument(
        "--format", choices=("tar", "parquet"), default=None, help="which shards to index (default: the kind present)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `stoker` command."""
    args = _parser().parse_args(argv)
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "index":
        return _index(args)
    return 2


def _index(args: argparse.Namespace) -> int:
    # One line on stderr for any problem: the arguments' or the prefix's contents (exit 2), the
    # store's or a shard's (exit 1). No traceback.
    from ._shards.index import INDEX_NAME, build_index

    try:
        index = build_index(args.url, format=args.format)
    except (ValueError, ImportError) as exc:
        print(f"stoker index: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"stoker index: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.url.rstrip('/')}/{INDEX_NAME}: {len(index.shards)} {index.format} shards, {len(index)} samples")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    # Every problem is one line on stderr: the target's (import, factory, what it returned:
    # exit 2) or the measurement's (the dataset raised: exit 1). No traceback.
    import time

    started = time.perf_counter()
    from ._doctor.errors import DoctorError, MeasureError
    from ._doctor.plot import plot
    from ._doctor.report import render, save_json
    from ._doctor.sweep import run
    from ._doctor.target import describe_target, load_target

    if args.seconds <= 0 or args.batch_size < 1 or (args.step_ms is not None and args.step_ms <= 0):
        print("stoker doctor: --seconds, --batch-size and --step-ms take positive numbers", file=sys.stderr)
        return 2
    try:
        made = load_target(args.target)
        target = describe_target(args.target, made, args.batch_size)
    except DoctorError as exc:
        print(f"stoker doctor: {exc}", file=sys.stderr)
        return 2
    reserve_s = 1.0 if args.plot else 0.3  # importing matplotlib and drawing take most of a second
    try:
        report = run(target, args.seconds, args.step_ms, started=started, reserve_s=reserve_s)
    except MeasureError as exc:
        print(f"stoker doctor: {args.target}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        text = str(exc).strip().splitlines()
        print(
            f"stoker doctor: {args.target}: measuring failed: {type(exc).__name__}: {text[0] if text else ''}",
            file=sys.stderr,
        )
        return 1
    print(render(report), flush=True)
    if args.json:
        save_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        if plot(report, args.plot):
            print(f"wrote {args.plot}")
        else:
            print("matplotlib is not installed: no chart (pip install stoker[bench])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
