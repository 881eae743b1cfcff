"""Worker restart (`max_worker_restarts`): workers killed (SIGKILL, a real segfault,
`os._exit`) at seeded points of an epoch are replaced and the epoch comes out exactly as
the uninterrupted one, under every start method; and where a restart must not happen, the
error says why.

Each case runs in a child process (restart_child.py) under a hard timeout; the child also
checks that nothing is left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.support.processes import START_METHODS

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_TIMEOUT_S = 60


def run_child(tmp_path, **spec) -> dict:
    spec.setdefault("marks", str(tmp_path))
    spec.setdefault("seed", 1234)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "restart_child.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["leaks"] == [], result["leaks"]
    return result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("kind", ["sigkill", "sigsegv", "exit"])
def test_restarted_workers_give_exactly_the_uninterrupted_epoch(tmp_path, method: str, kind: str) -> None:
    seed = len(kind) * 7 + len(method)
    result = run_child(tmp_path, method=method, kind=kind, deaths=3, death_seed=seed, restarts=3)
    assert result["error"] is None, result["message"]
    assert result["batches"] == result["reference"], f"deaths at samples {result['at']} changed the epoch"
    warned = result["warnings"]
    assert len(warned) == 3, warned  # one per restart
    assert all("restarted it as pid" in w and "re-sent" in w for w in warned), warned
    for sample, _ in result["at"]:
        assert any(f"{sample}" in w.split("re-sent")[1] for w in warned), f"no warning names sample {sample}: {warned}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", START_METHODS)
def test_restart_with_global_rng_keeps_every_index_once_in_order(tmp_path, method: str) -> None:
    """Samples that draw from numpy's global RNG cannot be reproduced by a replacement (it
    starts its stream again from its seed), but the indices, their order and count are."""
    result = run_child(tmp_path, method=method, kind="sigkill", deaths=3, death_seed=99, restarts=3, draw=True)
    assert result["error"] is None, result["message"]
    indices = [[[row[0] for row in batch] for batch in epoch] for epoch in result["batches"]]
    expected = [[[row[0] for row in batch] for batch in epoch] for epoch in result["reference"]]
    assert indices == expected
    flat = [i for batch in indices[0] for i in batch]
    assert sorted(flat) == list(range(48))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", START_METHODS)
def test_persistent_workers_restart_across_epochs(tmp_path, method: str) -> None:
    result = run_child(
        tmp_path, method=method, kind="exit", deaths=4, death_seed=5, restarts=4, persistent=True, epochs=3
    )
    assert result["error"] is None, result["message"]
    assert len({epoch for _, epoch in result["at"]}) > 1, f"the seed should spread deaths over epochs: {result['at']}"
    assert result["batches"] == result["reference"]
    assert len(result["warnings"]) == 4


@pytest.mark.timeout(120)
def test_unordered_loader_restarts_without_losing_or_repeating(tmp_path) -> None:
    result = run_child(tmp_path, method="fork", kind="sigkill", deaths=3, death_seed=11, restarts=3, in_order=False)
    assert result["error"] is None, result["message"]
    got = sorted(map(tuple, (row for batch in result["batches"][0] for row in batch)))
    want = sorted(map(tuple, (row for batch in result["reference"][0] for row in batch)))
    assert got == want


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_more_deaths_than_restarts_raise_at_the_first_owed_batch(tmp_path, method: str) -> None:
    result = run_child(tmp_path, method=method, kind="sigkill", deaths=3, death_seed=3, restarts=2)
    assert result["is_worker_died"], result
    assert len(result["warnings"]) == 2
    message = result["message"]
    assert "max_worker_restarts=2 restarts were already used" in message, message
    assert "killed by signal SIGKILL" in message, message
    # everything before the batch the third dead worker owed came out, in order
    batch = result["error_batch"]
    assert result["batches"][0] == result["reference"][0][:batch]
    assert f"(batch {batch} of epoch 0)" in message
    assert any(str(sample) in message.split("sample indices")[1] for sample, _ in result["at"]), message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_batch_that_kills_two_workers_in_a_row_is_not_retried(tmp_path, method: str) -> None:
    result = run_child(tmp_path, method=method, kind="sigsegv", at=[[20, 0]], always=True, restarts=3)
    assert result["is_worker_died"], result
    assert len(result["warnings"]) == 1, result["warnings"]  # one restart, then the second death
    message = result["message"]
    assert "killed two workers in a row" in message and "death 2 of max_worker_restarts=3" in message, message
    assert "20" in message.split("sample indices")[1], message
    batch = result["error_batch"]
    assert result["batches"][0] == result["reference"][0][:batch]


@pytest.mark.timeout(120)
def test_iterable_dataset_is_not_restarted_and_says_why(tmp_path) -> None:
    result = run_child(tmp_path, method="fork", kind="sigkill", at=[[7, 0]], restarts=3, iterable=True, batch_size=1)
    assert result["is_worker_died"], result
    assert "cannot resume its IterableDataset replica's stream" in result["message"], result["message"]
    assert result["warnings"] == []
    # worker 1 owed item 7 (its fourth): batches 0..6 come first
    assert [b[0][0] for b in result["batches"][0]] == list(range(7))
