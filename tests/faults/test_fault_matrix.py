"""The fault matrix: a worker that raises, is killed, segfaults, exits or hangs — in
`__getitem__`, collate, `worker_init_fn`, an iterable's `__iter__` or its items.

Each case runs in a child process (scenario.py) under a hard timeout; the child reports
what the loop saw and whether any process, thread, fd or /dev/shm entry was left behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PLACES = ["getitem", "collate", "init", "iter", "next"]
CHILD_TIMEOUT_S = 60


def run_scenario(tmp_path, **spec) -> dict:
    spec.setdefault("stamp", str(tmp_path / "fault-time"))
    env = dict(os.environ, SCENARIO_HANG_S=str(spec.pop("hang_s", 1000)))
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "scenario.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


def check_common(result: dict, place: str) -> None:
    batches = result["batches"]
    assert batches == list(range(len(batches))), f"batches out of order or lost: {batches}"
    assert len(batches) <= 5, "a batch at or after the fault was delivered"
    if place in ("getitem", "collate", "next") and result["error"] in ("ValueError",):
        assert batches == [0, 1, 2, 3, 4], "the batches before the faulty one must come first"
    assert result["leaks"] == [], result["leaks"]


def check_raise(result: dict, place: str) -> None:
    assert result["error"] == "ValueError", result
    message = result["message"]
    assert re.search(r"Caught ValueError in DataLoader (thread )?worker \d", message), message
    assert "planted fault" in message
    if place in ("getitem", "collate"):
        assert "[5]" in message, message
    assert result["has_remote_traceback"]
    if place in ("getitem", "collate"):
        assert result["after_error"] == "yielded", "a sample's error must not end the epoch"


def check_died(result: dict, signal_name: str | None) -> None:
    assert result["is_worker_died"] and result["is_runtime_error"], result
    message = result["message"]
    assert "pid" in message, message
    if signal_name is not None:
        assert signal_name in message, message
    else:
        assert "exit code 7" in message, message
    latency = result["error_at"] - result["fault_at"]
    assert latency < 1.0, f"worker death reported after {latency:.2f} s"
    assert result["after_error"] == "RuntimeError", "a broken iterator must refuse to continue"


SIGNALS = {"sigkill": "SIGKILL", "sigsegv": "SIGSEGV", "exit": None}


def check(result: dict, kind: str, place: str) -> None:
    check_common(result, place)
    if kind == "raise":
        check_raise(result, place)
    elif kind == "hang":
        check_hang(result)
    else:
        check_died(result, SIGNALS[kind])


def check_hang(result: dict) -> None:
    assert result["error"] == "RuntimeError", result
    assert "timed out after 2 seconds" in result["message"], result["message"]
    assert "waiting for batch" in result["message"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("kind", ["raise", "sigkill", "sigsegv", "exit", "hang"])
def test_fork_fault_matrix(tmp_path, kind: str, place: str) -> None:
    spec = {"kind": kind, "place": place, "engine": "fork"}
    if kind == "hang":
        spec["timeout"] = 2
    check(run_scenario(tmp_path, **spec), kind, place)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["spawn", "forkserver"])
@pytest.mark.parametrize(("kind", "place"), [("raise", "getitem"), ("sigkill", "getitem"), ("hang", "collate"), ("sigsegv", "init")])
def test_spawn_and_forkserver_faults(tmp_path, engine: str, kind: str, place: str) -> None:
    spec = {"kind": kind, "place": place, "engine": engine}
    if kind == "hang":
        spec["timeout"] = 2
    check(run_scenario(tmp_path, **spec), kind, place)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("kind", ["raise", "hang"])
def test_thread_worker_faults(tmp_path, kind: str, place: str) -> None:
    # A hung thread cannot be killed: it is left to finish its sleep (3 s), after which it
    # must exit on its own; the leak check waits for that.
    spec = {"kind": kind, "place": place, "engine": "threads", "hang_s": 3, "settle": 12}
    if kind == "hang":
        spec["timeout"] = 2
    check(run_scenario(tmp_path, **spec), kind, place)
