"""stoker never forks while a thread of its own runs: a fork copies the locks other threads
hold into a child where those threads do not exist, and Python 3.12+ warns at each such fork
(`DeprecationWarning: This process ... is multi-threaded, use of fork() may lead to deadlocks
in the child`). Loaders with fork workers over a numpy dataset and over shards in a local
folder (whose downloads ahead run threads in the loader's process), two epochs each,
persistent and not, with statistics and the progress bar on: at every fork no thread but the
main one runs, and on 3.12+ no such warning is raised. Run in a fresh interpreter
(fork_threads_child.py): pytest's own threads (its timeout's, faulthandler's) would make every
fork of the test process multi-threaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_TIMEOUT_S = 100
SAMPLES = list(range(48))
# each scenario: 2 workers forked for each of 2 epochs, then 2 persistent ones; numpy and shards
FORKS = 2 * (2 * 2 + 2)
WARNS_AT_FORK = sys.version_info >= (3, 12)


def run(tmp_path: Any, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "fork_threads_child.py"), str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, f"failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[0][len("RESULT ") :])


@pytest.mark.timeout(120)
def test_no_thread_of_stokers_runs_when_it_forks_workers(tmp_path: Any) -> None:
    result = run(tmp_path)
    for epochs in result["epochs"]:
        assert epochs == [SAMPLES, SAMPLES]
    assert len(result["forks"]) == FORKS
    assert result["forks"] == [[]] * FORKS, "threads running at the forks"
    assert result["fork_warnings"] == []


@pytest.mark.timeout(120)
def test_the_checks_see_a_thread_that_runs_at_a_fork(tmp_path: Any) -> None:
    """The control: a thread of the user's own, running throughout, is seen at every fork by
    the record, and by Python's warning where Python warns (3.12+)."""
    result = run(tmp_path, "control")
    assert result["forks"] == [["the-users-thread"]] * FORKS
    if WARNS_AT_FORK:
        assert len(result["fork_warnings"]) == FORKS, result["fork_warnings"]
    else:
        assert result["fork_warnings"] == []
