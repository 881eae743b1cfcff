"""A process forked from the one running a loader never touches that loader: the parent's
epoch goes on with every sample once, however the child ends, and nothing of stoker's runs
in the child against the parent's workers. Each case runs fork_child.py in a subprocess
under a hard timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_TIMEOUT_S = 60
SAMPLES = list(range(40))
# what stoker's cleanup, run in a forked child, printed there
NOT_IN_A_CHILD = ("can only join a child process", "Exception ignored", "WorkerDiedError")


def run(scenario: str, method: str) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "fork_child.py"), scenario, method],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, f"failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[0][len("RESULT ") :]), proc.stderr


def check(result: dict[str, Any], stderr: str) -> None:
    for line in NOT_IN_A_CHILD:
        assert line not in stderr, stderr
    first, second = result["epochs"]
    assert first == SAMPLES, "the epoch during which the children ran lost or repeated samples"
    assert second == SAMPLES, "the next epoch lost or repeated samples"
    assert result["leaks"] == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_os_fork_children_that_end_any_way_leave_the_parents_loader_alone(method: str) -> None:
    result, stderr = run("os_fork", method)
    assert result["children"] == {
        "exit": "exit 0",
        "raise": "exit 1",
        "sigterm": "SIGTERM",
        "sigkill": "SIGKILL",
        "iterate": "exit 0",  # its own epoch, on its own workers, had every sample once
    }
    assert "RuntimeError: the forked child fails" in stderr  # the raising child's own traceback
    check(result, stderr)


@pytest.mark.timeout(90)
def test_multiprocessing_fork_children_never_run_a_parents_finalizer() -> None:
    result, stderr = run("mp_fork", "fork")
    assert result["children"] == {"0": "exit 0", "1": "exit 0"}
    check(result, stderr)


@pytest.mark.timeout(90)
def test_torchs_fork_workers_never_run_a_failed_stoker_iterators_finalizer() -> None:
    pytest.importorskip("torch")
    result, stderr = run("torch_fork", "fork")
    assert result["children"] == {"torch": "batches 4"}
    check(result, stderr)
