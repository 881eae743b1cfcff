"""The fault matrix: a worker that raises, is SIGKILLed, segfaults (a real one, or SIGSEGV sent
to itself), exits or hangs — in `__getitem__`, collate, `worker_init_fn`, an iterable's
`__iter__` or its items — under fork (everything), spawn and forkserver (a subset) and
thread workers (raise and hang).

Each case runs in a child process (scenario.py) under a hard timeout; the child reports
what the loop saw (batches, error type and message, the faulting pid, when the fault
happened and when the error came) and whether any process, thread, fd or /dev/shm entry
was left behind once the iterator was dropped.
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
CHILD_TIMEOUT_S = 100  # a bound on a hang (the child's own waits are bounded by 60 s: scenario.READY_S)


def run_scenario(tmp_path, **spec) -> dict:
    spec.setdefault("stamp", str(tmp_path / "fault-time"))
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "scenario.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


# the places where the fault hits sample 5 itself; batches 0..4 must all come first
AT_SAMPLE_5 = ("getitem", "collate", "next")
SIGNALS = {"sigkill": "SIGKILL (9)", "sigsegv": "SIGSEGV (11)", "sigsegv_signal": "SIGSEGV (11)", "exit": None}
# The loader's timeout in the hang cases. The scenario asks for batches only once the hang has
# begun and the other worker is running (scenario.wait_for_the_hang), so it bounds no worker's
# start-up, whatever the engine or the machine's load: only the hang reaches it.
HANG_TIMEOUT_S = 2


def check_common(result: dict, kind: str, place: str) -> None:
    batches = result["batches"]
    assert batches == list(range(len(batches))), f"batches out of order or lost: {batches}"
    assert len(batches) <= 5, "a batch at or after the fault was delivered"
    if place in AT_SAMPLE_5:
        # a dead worker costs nothing already made: batches before its first owed one come first
        assert batches == [0, 1, 2, 3, 4], f"the batches before the faulty one must come first: {batches}"
    if place == "init" and kind != "hang":  # worker 1 fails in worker_init_fn: batch 1 is its first
        assert batches == [0], f"batch 0 (worker 0's) must come before worker 1's failure: {batches}"
    assert result["error"] is not None, "the fault was never reported"
    assert "fault_pid" in result, "the planted fault never ran"
    assert result["leaks"] == [], result["leaks"]


def check_raise(result: dict, place: str) -> None:
    assert result["error"] == "ValueError", result
    message = result["message"]
    match = re.search(r"Caught ValueError in DataLoader (thread )?worker (\d) \(pid (\d+)\)", message)
    assert match, message
    assert int(match.group(3)) == result["fault_pid"], f"wrong pid named: {message}"
    assert "planted fault at 5" in message, message
    if place in ("getitem", "collate"):
        assert "sample indices [5]" in message, message
        assert match.group(2) == "1", f"sample 5 is worker 1's (round robin): {message}"
    if place == "init":
        assert "worker_init_fn" in message, message
    if place in ("iter", "next"):
        assert "iterable dataset" in message, message
    assert result["has_remote_traceback"]
    if place in ("getitem", "collate"):
        assert result["after_error"] == "yielded", "a sample's error must not end the epoch"


def check_died(result: dict, kind: str, place: str) -> None:
    assert result["is_worker_died"] and result["is_runtime_error"], result
    message = result["message"]
    if place in AT_SAMPLE_5:
        assert "(batch 5 of epoch 0)" in message, f"the first batch the dead worker owed must be named: {message}"
    if place in ("getitem", "collate"):
        assert "sample indices [5]" in message, message
    assert f"(pid {result['fault_pid']})" in message, f"the dead worker's pid must be named: {message}"
    signal_name = SIGNALS[kind]
    if signal_name is not None:
        assert f"killed by signal {signal_name}" in message, message
    else:
        assert "exit code 7" in message, message
    assert result["after_error"] == "RuntimeError", "a broken iterator must refuse to continue"


def check_hang(result: dict, engine: str) -> None:
    assert result["error"] == "RuntimeError" and not result["is_worker_died"], result
    message = result["message"]
    assert f"timed out after {HANG_TIMEOUT_S} seconds" in message, message
    assert "waiting for batch" in message and "from worker" in message, message
    if engine != "threads":
        assert f"(pid {result['fault_pid']})" in message, f"the hung worker's pid must be named: {message}"


def check(result: dict, kind: str, place: str, engine: str) -> None:
    check_common(result, kind, place)
    if kind == "raise":
        check_raise(result, place)
    elif kind == "hang":
        check_hang(result, engine)
    else:
        check_died(result, kind, place)


def spec_for(kind: str, place: str, engine: str) -> dict:
    spec = {"kind": kind, "place": place, "engine": engine}
    if kind == "hang":
        spec["timeout"] = HANG_TIMEOUT_S
    return spec


@pytest.mark.timeout(120)
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("kind", ["raise", "sigkill", "sigsegv", "sigsegv_signal", "exit", "hang"])
def test_fork_fault_matrix(tmp_path, kind: str, place: str) -> None:
    check(run_scenario(tmp_path, **spec_for(kind, place, "fork")), kind, place, "fork")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["spawn", "forkserver"])
@pytest.mark.parametrize(
    ("kind", "place"),
    [("raise", "getitem"), ("sigkill", "getitem"), ("sigkill", "next"), ("hang", "collate"), ("sigsegv", "init")],
)
def test_spawn_and_forkserver_faults(tmp_path, engine: str, kind: str, place: str) -> None:
    check(run_scenario(tmp_path, **spec_for(kind, place, engine)), kind, place, engine)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("kind", ["raise", "hang"])
def test_thread_worker_faults(tmp_path, kind: str, place: str) -> None:
    # A hung thread cannot be killed: the scenario ends its hang once the timeout is reported,
    # after which it must exit on its own; the leak check waits for that.
    check(run_scenario(tmp_path, **spec_for(kind, place, "threads")), kind, place, "threads")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["fork", "spawn"])
@pytest.mark.parametrize("kind", ["sigkill", "exit"])
def test_death_does_not_discard_earlier_batches_of_live_workers(tmp_path, engine: str, kind: str) -> None:
    """Worker 0 is still making sample 4 (it waits for worker 1's death) when worker 1 dies at
    sample 5: batches 0..4 are owed by a live worker and must still be delivered, in order,
    before the error."""
    result = run_scenario(tmp_path, kind=kind, place="getitem", engine=engine, slow_at=4)
    assert result["slow_at"] == 4
    check(result, kind, "getitem", engine)
