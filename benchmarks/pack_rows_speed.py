"""How fast stoker's sequence packers place documents into rows (`stoker._mix.pack_rows`).

The packers alone, no loader: random document lengths (uniform in 10..seq_len, seed 0),
`seq_len` 2048, windows of K = 64 documents (`pack_window`) and of K = 64 rows
(`pack_rows_window`, with what does not fit carried to the next window), best-fit and
greedy. Per case: documents packed, tokens per second and microseconds per document (the
median of `--reps` timed passes over the whole sequence, after one untimed pass), and the
utilisation (real tokens over rows x seq_len) of the packing.

This is where the speed of packing is measured (it moved out of tests/unit/test_pack_rows.py,
whose tests check what the packers produce, not how fast: a test that times itself fails on a
busy machine). The figures are printed, not judged against a floor.

Results go to stdout and `bench-results/pack_rows_speed.json` (`--out`).
Run: `python benchmarks/pack_rows_speed.py [--quick]` (also run by `make bench`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from stoker_bench.mixpack import packed_windows

SEQ_LEN = 2048
K = 64


def by_documents(lengths: np.ndarray, method: str) -> list[list[Any]]:
    """Rows of each window of K consecutive documents."""
    return packed_windows(lengths, K, SEQ_LEN, method, "documents")


def by_rows(lengths: np.ndarray, method: str) -> list[list[Any]]:
    """Rows of each window of K rows, what does not fit carried to the next one, until every
    document is placed."""
    return packed_windows(lengths, K, SEQ_LEN, method, "rows")


def utilisation(windows: list[list[Any]]) -> float:
    rows = [row for window in windows for row in window]
    return sum(e - s for row in rows for _, s, e in row) / (len(rows) * SEQ_LEN) if rows else 0.0


def measure(pack: Callable[[np.ndarray, str], list[list[Any]]], lengths: np.ndarray, method: str, reps: int) -> dict:
    windows = pack(lengths, method)  # untimed: warms numpy's and the packer's paths
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        pack(lengths, method)
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    return {
        "documents": len(lengths),
        "tokens_per_s": float(lengths.sum()) / seconds,
        "us_per_doc": seconds / len(lengths) * 1e6,
        "utilisation": utilisation(windows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer documents and passes (a smoke run)")
    parser.add_argument("--docs", type=int, default=K * 200, help="documents to pack (default: 200 windows)")
    parser.add_argument("--reps", type=int, default=5, help="timed passes per case; the median is reported")
    parser.add_argument("--out", type=Path, default=Path("bench-results/pack_rows_speed.json"))
    args = parser.parse_args()
    docs, reps = (K * 20, 2) if args.quick else (args.docs, args.reps)
    lengths = np.random.default_rng(0).integers(10, SEQ_LEN + 1, size=docs).astype(np.int64)
    results = []
    print(f"packing {docs} documents (lengths 10..{SEQ_LEN}), seq_len {SEQ_LEN}, K = {K}; median of {reps} passes")
    print(f"{'window':<14}{'method':<10}{'M tokens/s':>12}{'us/doc':>10}{'utilisation':>13}")
    for unit, pack in (("K documents", by_documents), ("K rows", by_rows)):
        for method in ("best_fit", "greedy"):
            row = {"window": unit, "method": method, **measure(pack, lengths, method, reps)}
            results.append(row)
            print(
                f"{unit:<14}{method:<10}{row['tokens_per_s'] / 1e6:>12.0f}{row['us_per_doc']:>10.2f}"
                f"{row['utilisation']:>13.4f}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seq_len": SEQ_LEN, "k": K, "reps": reps, "results": results}, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
