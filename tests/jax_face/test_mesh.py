"""One JAX program over 8 CPU devices, as 1 process x 8 devices and as 2 processes x 4 devices
(jax.distributed on loopback, inside a network namespace with only the loopback interface):
a Flax NNX model trained on a stoker.jax.DataLoader (2 forkserver workers per process, shuffled)
with an Orbax checkpoint of the model and the loader mid-epoch, the processes SIGKILLed after
they went on past it (mesh_main.py). Then each world is restored from the checkpoint the other
saved, and goes on exactly as the uninterrupted runs did.

Four launches, shared by the tests: train on 1 x 8, train on 2 x 4, resume on 1 x 8 from the
2 x 4 checkpoint, resume on 2 x 4 from the 1 x 8 checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

from tests.support.namespaces import loopback_only, run_in_namespace

SCRIPT = Path(__file__).with_name("mesh_main.py")
# A bound on a hang, not on speed: a launch takes ~30-60 s on a quiet 2-core machine and
# several times that on a busy one.
LAUNCH_TIMEOUT_S = 600  # the script's own limit per world is below it
N, BATCH, STEPS, SAVE_AT = 320, 32, 14, 6  # mesh_main.py's
RUNS = [("train", 1, "1"), ("train", 2, "2"), ("resume", 1, "2"), ("resume", 2, "1")]  # mode, processes, ckpt of

NO_NAMESPACE = loopback_only()
pytestmark = [
    pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE)),
    pytest.mark.timeout(len(RUNS) * LAUNCH_TIMEOUT_S + 30),  # the first test launches them all
]

_runs: dict[tuple[str, int], list[dict[str, Any]]] = {}


def launch(mode: str, processes: int, ckpt: Path, out: Path) -> list[dict[str, Any]]:
    """mesh_main.py's MODE on `processes` processes; each process's record."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(sys.path),
        PYTHONWARNINGS="ignore",
        WORLD_TIMEOUT_S=str(LAUNCH_TIMEOUT_S - 15),
    )
    env.pop("XLA_FLAGS", None)  # each process sets its own device count
    label = f"{mode} on {processes} x {8 // processes}"
    run_in_namespace(
        [str(SCRIPT), "world", mode, str(out), str(processes), str(ckpt)], out, env, LAUNCH_TIMEOUT_S, label, grace_s=10
    )
    world = json.loads((out / f"world-{mode}-{processes}.json").read_text())
    expected = [-9 if mode == "train" else 0] * processes
    if world["codes"] != expected:
        outputs = "\n".join(
            f"--- process {i} exited {c}:\n{o[-4000:]}"
            for i, (c, o) in enumerate(zip(world["codes"], world["outputs"]))
        )
        pytest.fail(f"{label}: the processes exited {world['codes']}, not {expected}\n{outputs}")
    return [json.loads((out / f"{mode}-{processes}-{i}.json").read_text()) for i in range(processes)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """{(mode, processes): each process's record}, launched once."""
    if not _runs:
        out = tmp_path_factory.mktemp("mesh")
        for mode, processes, ckpt_of in RUNS:
            _runs[(mode, processes)] = launch(mode, processes, out / f"ckpt-{ckpt_of}", out)
    return _runs


def global_ids(record: list[dict[str, Any]], step: int) -> dict[int, list[int]]:
    """{first row: ids} of every process's shards at `step` (1-based)."""
    rows: dict[int, list[int]] = {}
    for process in record:
        entry = process["steps"][step - 1 - (process["steps"][0]["step"] - 1)]
        assert entry["step"] == step
        for start, ids in entry["ids"]:
            rows[start] = ids
    return rows


def test_each_process_holds_the_rows_of_its_devices(runs: Any) -> None:
    one, two = runs[("train", 1)], runs[("train", 2)]
    assert all(len(p["steps"]) == STEPS for p in one + two)
    for step in range(1, STEPS + 1):
        whole = global_ids(one, step)
        assert sorted(whole) == list(range(0, BATCH, BATCH // 8))
        seen = []
        for process in two:  # its addressable shards: the global batch's rows for its devices
            entry = process["steps"][step - 1]
            for start, ids in entry["ids"]:
                assert ids == whole[start], (step, start)
                seen.append(start)
            starts = [start for start, _ in entry["ids"]]
            assert len(starts) == 4 and starts == sorted(starts)
        assert sorted(seen) == sorted(whole)  # every row in exactly one process
    # an epoch is N // BATCH steps: each epoch's ids are a permutation of the dataset
    epoch = [i for step in range(1, N // BATCH + 1) for ids in global_ids(one, step).values() for i in ids]
    assert sorted(epoch) == list(range(N))
    assert two[0]["devices"] != two[1]["devices"]


def test_a_sharding_over_another_process_s_devices_is_refused_naming_it(runs: Any) -> None:
    for process in runs[("train", 2)]:
        assert "sharding" in process["refused"] and "no device this process" in process["refused"]
    assert "refused" not in runs[("train", 1)][0]  # one process addresses every device


def test_the_model_trains_the_same_on_2_x_4_as_on_1_x_8(runs: Any) -> None:
    one = [s["loss"] for s in runs[("train", 1)][0]["steps"]]
    for process in runs[("train", 2)]:
        np.testing.assert_allclose([s["loss"] for s in process["steps"]], one, rtol=1e-5)
    assert one[-1] < one[0] / 4  # it learns: the comparison is of a real training run


@pytest.mark.parametrize("processes", [1, 2], ids=["on-1x8-from-2x4", "on-2x4-from-1x8"])
def test_restored_from_orbax_after_sigkill_goes_on_exactly(runs: Any, processes: int) -> None:
    resumed, uninterrupted = runs[("resume", processes)], runs[("train", processes)]
    for process in resumed:
        assert [s["step"] for s in process["steps"]] == list(range(SAVE_AT + 1, STEPS + 1))
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert global_ids(resumed, step) == global_ids(uninterrupted, step)
    for process, before in zip(resumed, uninterrupted):
        np.testing.assert_allclose(
            [s["loss"] for s in process["steps"]], [s["loss"] for s in before["steps"][SAVE_AT:]], rtol=1e-5
        )
