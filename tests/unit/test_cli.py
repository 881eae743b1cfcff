"""`stoker bench` end to end on a tiny plan, and its argument errors."""

from __future__ import annotations

import json

import pytest

from stoker._cli import main


def test_bench_quick_writes_table_json_and_chart(tmp_path, capsys) -> None:
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    code = main(
        ["bench", "--quick", "--workloads", "W1,W4", "--workers", "0,1", "--no-torch",
         "--json", str(out_json), "--png", str(out_png)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "W1" in printed and "W4" in printed and "memcpy ceiling" in printed
    report = json.loads(out_json.read_text())
    rows = {(r["workload"], r["loader"], r["workers"]) for r in report["results"]}
    assert rows == {(w, "stoker", n) for w in ("W1", "W4") for n in (0, 1)}
    assert all(r["median"] > 0 for r in report["results"])
    assert report["machine"]["memcpy_gbps"] > 0
    assert out_png.exists() and out_png.stat().st_size > 0


def test_bench_rejects_unknown_workloads_and_workers(capsys) -> None:
    assert main(["bench", "--workloads", "W9"]) == 2
    assert "unknown workloads" in capsys.readouterr().err
    assert main(["bench", "--workers", "two"]) == 2
    assert "--workers takes integers" in capsys.readouterr().err


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and "stoker 0.1.0" in capsys.readouterr().out
