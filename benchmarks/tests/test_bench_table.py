"""The bench table reads on its own: a legend of the workloads it holds, and the targets with
what they are measured against and what MET and MISSED mean."""

from __future__ import annotations

import json
from dataclasses import asdict

from stoker_bench import bench as bench
from stoker_bench.bench import report as report_module


def _row(workload: str, loader: str, workers: int, rate: float, variant: str = "") -> bench.Result:
    row = bench.Result(workload, loader, workers, variant, values=[rate, rate])
    row.extra["main_us_per_batch"] = [100.0]
    return row


def _report(rows: list[bench.Result]) -> dict:
    return {
        "results": [
            asdict(r) | {"median": r.median, "gbps": r.gbps(), "main_us_per_batch": r.main_us_per_batch} for r in rows
        ],
        "targets": bench.targets(rows, ceiling=10.0),
        "machine": bench.environment() | {"memcpy_gbps": 10.0, "cpus": 2},
    }


def test_the_table_says_what_each_workload_is_and_what_the_targets_mean() -> None:
    # W1 met (6x torch against a goal of 4x), W4 missed (1.5x against 2x)
    rows = [
        _row("W1", "stoker.torch", 2, 600.0),
        _row("W1", "torch", 2, 100.0),
        _row("W4", "stoker.torch", 2, 150.0),
        _row("W4", "torch", 2, 100.0),
    ]
    report = _report(rows)
    json.dumps(report)
    text = bench.table(report)
    lines = text.splitlines()
    # the legend comes first and names only the workloads the table holds
    assert lines[0].startswith("workloads (")
    assert f"  W1  {report_module.WORKLOADS['W1']}" in lines
    assert f"  W4  {report_module.WORKLOADS['W4']}" in lines
    assert not any(line.startswith("  W7  ") for line in lines)
    assert report_module.LOADERS in lines and lines.index(report_module.LOADERS) < lines.index(
        next(line for line in lines if line.startswith("workload "))
    )
    assert set(report_module.WORKLOADS) == {f"W{n}" for n in range(1, 9)}
    # the targets: what each is measured against, that a miss fails nothing, the count met
    assert "torch.utils.data's row at the same workers" in text
    assert "a MISSED fails nothing" in text and "(2 usable CPUs here)" in text
    assert "1 of 2 met:" in text
    assert "MET    W1 tiny samples/s vs torch" in text and "MISSED W4 iterable samples/s vs torch" in text


def test_no_targets_no_note() -> None:
    text = bench.table(_report([_row("W1", "stoker", 0, 100.0)]))
    assert "W1  tiny samples" in text and "targets:" not in text and "met:" not in text
