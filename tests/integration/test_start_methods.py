"""The loader under each start method made the default with `multiprocessing.set_start_method`
and no `multiprocessing_context` argument: forkserver, as Python 3.14 makes it the default on
Linux, and spawn, macOS's. Workers start from that method (a forkserver's workers are its
children, not the main process's), every epoch reads each sample once, persistent or not, a
worker's exception is raised in the main process with its type and message, and no worker
or thread of stoker's is left. Each case runs start_methods_child.py in a fresh interpreter
(a default start method can be set once per process) under a hard timeout."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_TIMEOUT_S = 100
SAMPLES = list(range(30))


def run(method: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "start_methods_child.py"), method],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, f"failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[0][len("RESULT ") :])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", [m for m in ("forkserver", "spawn") if m in multiprocessing.get_all_start_methods()])
def test_the_default_start_method_runs_the_loader(method: str) -> None:
    result = run(method)
    assert result["default"] == method
    for persistent, epochs in result["epochs"].items():
        assert epochs == [SAMPLES, SAMPLES], f"persistent_workers={persistent}: a sample lost or repeated"
    assert not result["read_in_main"] and result["workers"] == 2 + 2 + 2  # two per epoch, two persistent
    if method == "forkserver":
        assert result["parent_is_forkserver"], "the workers were not started by the forkserver"
    else:
        assert result["parents"] == ["main"]
    name, message = result["error"]
    assert name == "ValueError" and "sample 7 is broken" in message and "DataLoader worker" in message
    assert result["left_running"] == [], "workers still running after their loaders were dropped"
    assert result["threads"] == []
