"""The Hugging Face Trainer on two CPU ranks (gloo, `torch.distributed.run`, inside a network
namespace with only the loopback interface; nothing downloaded), as it comes (its own torch
DataLoader: the control) and with `stoker.torch.adopt(trainer)`, the documented line
(transformers_main.py): the ranks train on disjoint samples that cover the dataset in every
epoch, a run resumed from a mid-epoch checkpoint (`save_steps`, `resume_from_checkpoint`) trains
on exactly the samples the uninterrupted run trained on after that step, rank by rank — and when
adopted, the loader the Trainer prepares, and the one it resumes with, is stoker's and stoker's
workers make every sample. Two launches per flavour, shared by the tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)


import own_samplers  # noqa: E402
from tests.support.namespaces import loopback_only, run_in_namespace  # noqa: E402

SCRIPT = Path(__file__).with_name("transformers_main.py")
# A bound on a hang, not on speed: a launch takes ~30-60 s on a quiet 2-core machine and
# several times that on a busy one.
LAUNCH_TIMEOUT_S = 600  # the stoker flavour runs its own samplers too
FLAVOURS = ["torch", "stoker"]
LOADER = {"torch": "torch.utils.data.dataloader.DataLoader", "stoker": "stoker._core.torch_loader.DataLoader"}
STEPS_PER_EPOCH = 8  # 64 samples, 2 ranks, 4 a step
STOP_AT = 3

NO_NAMESPACE = loopback_only()
pytestmark = [
    pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE)),
    pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 20),  # the first test of a flavour launches twice
]


def launch(flavour: str, phase: str, out: Path) -> list[dict[str, Any]]:
    """transformers_main.py on two ranks; each rank's record."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(sys.path),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONWARNINGS="ignore",
        STACKS_AFTER_S=str(LAUNCH_TIMEOUT_S - 10),
    )
    program = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "29500",
        str(SCRIPT),
        flavour,
        str(out),
        phase,
    ]
    run_in_namespace(program, out, env, LAUNCH_TIMEOUT_S, f"{flavour} {phase}")
    return [json.loads((out / f"{flavour}-{phase}-{rank}.json").read_text()) for rank in range(2)]


_runs: dict[str, dict[str, Any]] = {}
_folders: dict[str, Path] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """runs(flavour) -> {"full": [rank 0, rank 1], "stopped": [...], "resumed": [...]}."""

    def get(flavour: str) -> dict[str, Any]:
        if flavour not in _runs:
            out = tmp_path_factory.mktemp(f"trainer-{flavour}")
            _folders[flavour] = out
            if flavour == "stoker":  # the shards the own samplers read
                own_samplers.write(str(out / "own-shards"))
            first, second = (launch(flavour, phase, out) for phase in ("first", "second"))
            _runs[flavour] = {
                "full": [rank["full"] for rank in first],
                "stopped": [rank["stopped"] for rank in first],
                "resumed": [rank["resumed"] for rank in second],
            }
            for run in (first, second):
                for name in run[0]:
                    if name.startswith("own-"):
                        _runs[flavour][name] = [rank[name] for rank in run]
        return _runs[flavour]

    yield get
    _runs.clear()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_ranks_train_on_disjoint_samples_covering_each_epoch(flavour: str, runs: Any) -> None:
    full = runs(flavour)["full"]
    assert [rank["rank"] for rank in full] == [0, 1]
    for epoch in range(2):
        shards = [
            [i for step in rank["steps"][epoch * STEPS_PER_EPOCH : (epoch + 1) * STEPS_PER_EPOCH] for i in step]
            for rank in full
        ]
        assert [len(shard) for shard in shards] == [32, 32]
        assert not set(shards[0]) & set(shards[1])
        assert set(shards[0]) | set(shards[1]) == set(range(64))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_run_resumed_mid_epoch_continues_where_it_stopped(flavour: str, runs: Any) -> None:
    result = runs(flavour)
    for full, stopped, resumed in zip(result["full"], result["stopped"], result["resumed"]):
        assert len(full["steps"]) == 2 * STEPS_PER_EPOCH
        assert stopped["steps"] == full["steps"][:STOP_AT]
        assert resumed["steps"] == full["steps"][STOP_AT:]  # the rest of that epoch, then the next


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_loader_doing_the_work_is_the_flavours(flavour: str, runs: Any) -> None:
    result = runs(flavour)
    for run in ("full", "stopped", "resumed"):
        for rank in result[run]:
            assert rank["by_stoker"] == [flavour == "stoker"], (run, rank["rank"])
            expected = [LOADER[flavour]] + (["skipped " + LOADER[flavour]] if run == "resumed" else [])
            assert sorted(rank["kinds"]) == sorted(expected), (run, rank["rank"])


def test_adopted_the_ranks_see_what_torchs_loader_gives_them(runs: Any) -> None:
    torch_run, stoker_run = runs("torch"), runs("stoker")
    for run in ("full", "resumed"):
        assert [rank["steps"] for rank in stoker_run[run]] == [rank["steps"] for rank in torch_run[run]]


@pytest.mark.parametrize("kind", own_samplers.KINDS)
def test_own_samplers_give_each_rank_its_share_as_without_the_trainer(kind: str, runs: Any) -> None:
    """A Trainer whose _get_train_sampler gives a ShardedSampler or StreamSampler, adopted: each
    rank trains on exactly what the plain loader gives it without the Trainer, in order, both
    epochs (accelerate's shard left open, the sampler's epoch set); a run resumed from a
    mid-epoch checkpoint continues with exactly the rest, and stoker's loader does the work."""
    result = runs("stoker")
    folder = str(_folders["stoker"] / "own-shards")
    per_epoch = -(-own_samplers.share(kind) // own_samplers.BATCH)
    for rank in range(2):
        full, stopped, resumed = (result[f"own-{kind}-{run}"][rank] for run in ("full", "stopped", "resumed"))
        expected = own_samplers.plain(kind, folder, rank)
        assert len(full["steps"]) == 2 * per_epoch, rank
        for epoch in range(2):
            steps = full["steps"][epoch * per_epoch : (epoch + 1) * per_epoch]
            assert [i for step in steps for i in step] == expected[epoch], (rank, epoch)
        assert stopped["steps"] == full["steps"][:STOP_AT]
        assert resumed["steps"] == full["steps"][STOP_AT:], rank
        assert full["kinds"] == [LOADER["stoker"]]
        assert sorted(resumed["kinds"]) == sorted([LOADER["stoker"], "skipped " + LOADER["stoker"]])
