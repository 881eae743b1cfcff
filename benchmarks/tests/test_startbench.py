"""W10 (start-up per worker count) and W11 (many small batches): rows for both loaders, the
table, the JSON, and the per-worker fit."""

from __future__ import annotations

import json

import pytest

from stoker_bench import startbench
from stoker_bench.cli import main


def test_the_fit_recovers_a_line() -> None:
    intercept, slope = startbench.fit([(1, 12.0), (2, 19.0), (4, 33.0), (8, 61.0)])
    assert intercept == pytest.approx(5.0) and slope == pytest.approx(7.0)
    assert startbench.fit([(2, 10.0), (2, 12.0)]) == (11.0, 0.0)  # one worker count: no slope


def test_w10_and_w11_quick(tmp_path, capsys) -> None:
    pytest.importorskip("torch")
    assert main(["--quick", "--workloads", "W10,W11", "--workers", "1,2", "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "W10 start-up" in printed and "W11 small samples" in printed and "per worker" in printed
    assert not (tmp_path / "bench.json").exists()  # W1-W9's report is not made for these alone
    report = json.loads((tmp_path / "startbench.json").read_text())
    start = {(r["method"], r["workers"], r["loader"]) for r in report["startup"]["rows"]}
    assert start == {("fork", w, loader) for w in (1, 2) for loader in startbench.LOADERS}
    for row in report["startup"]["rows"]:
        assert 0 < row["iter_ms"] <= row["first_batch_ms"]
    assert {f["loader"] for f in report["startup"]["fits"]} == set(startbench.LOADERS)
    small = {(r["workers"], r["loader"]) for r in report["small"]["rows"]}
    assert small == {(w, loader) for w in startbench.SMALL_WORKERS for loader in startbench.LOADERS}
    assert all(r["samples_per_s"] > 0 and r["main_us_per_batch"] > 0 for r in report["small"]["rows"])
