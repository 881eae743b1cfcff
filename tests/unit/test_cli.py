"""The `stoker` command, which has the doctor only (the harness's command line is tested in
benchmarks/tests/test_bench_cli.py)."""

from __future__ import annotations

import os

import pytest

from stoker._cli import main as stoker_main


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        stoker_main(["--version"])
    assert info.value.code == 0 and "stoker 0.1.0" in capsys.readouterr().out


def test_the_stoker_command_has_the_doctor_and_no_bench(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        stoker_main(["--help"])
    assert info.value.code == 0
    printed = capsys.readouterr().out
    assert "doctor" in printed and "bench" not in printed
    with pytest.raises(SystemExit) as info:
        stoker_main(["bench", "--quick"])
    assert info.value.code == 2 and "invalid choice: 'bench'" in capsys.readouterr().err


def test_the_stoker_command_imports_none_of_the_measuring_code() -> None:
    """`stoker --help` and `--version` import the doctor's package (its CLI is there), not the
    loader, numpy or the sweep: the package's names are imported on first use."""
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    code = (
        "import sys, stoker._cli; "
        "print(sorted(m for m in sys.modules if m.startswith(('numpy', 'stoker._core', 'stoker._doctor'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=str(src)),
    )
    assert done.stdout.strip() == "[]"
