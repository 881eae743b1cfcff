"""The Hugging Face Trainer with `use_stateful_dataloader=True` on two CPU ranks (gloo,
`torch.distributed.run`, inside a network namespace with only the loopback interface; nothing
downloaded; saved_trainer_main.py): adopted (`stoker.torch.adopt(trainer)`), the loader the
Trainer prepares is stoker's StatefulDataLoader where accelerate would build torchdata's, and a
run resumed from a mid-epoch checkpoint (`resume_from_checkpoint`) trains on exactly the
samples the uninterrupted run trained on after that step, rank by rank, as the model's forward
sees them. The Trainer as it comes (torchdata's StatefulDataLoader) runs beside it as the
control. Two launches, shared by the tests."""

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
pytest.importorskip("torchdata", minversion="0.11")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)

from tests.support.namespaces import loopback_only, run_in_namespace  # noqa: E402

SCRIPT = Path(__file__).with_name("saved_trainer_main.py")
# A bound on a hang, not on speed: a launch takes ~30-60 s on a quiet 2-core machine and
# several times that on a busy one.
LAUNCH_TIMEOUT_S = 600
N, STOP, STEPS_PER_EPOCH = 64, 3, 8  # saved_trainer_main.py's: 64 samples, 2 ranks, 4 a step
TORCHDATA = "torchdata.stateful_dataloader.stateful_dataloader.StatefulDataLoader"
TORCH = "torch.utils.data.dataloader.DataLoader"

NO_NAMESPACE = loopback_only()
pytestmark = [
    pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE)),
    pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 20),  # the first test launches twice
]


def launch(phase: str, out: Path) -> list[dict[str, Any]]:
    """saved_trainer_main.py on two ranks; each rank's record."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(sys.path),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONWARNINGS="ignore",
        STACKS_AFTER_S=str(LAUNCH_TIMEOUT_S - 10),
    )
    program = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    program += ["--master_port", "29500", str(SCRIPT), str(out), phase]
    run_in_namespace(program, out, env, LAUNCH_TIMEOUT_S, f"Trainer {phase}")
    return [json.loads((out / f"{phase}-{rank}.json").read_text()) for rank in range(2)]


_runs: dict[str, Any] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """{"first", "second": [rank 0's record, rank 1's]}, launched once."""
    if not _runs:
        out = tmp_path_factory.mktemp("trainer-stateful")
        for phase in ("first", "second"):
            _runs[phase] = launch(phase, out)
    yield _runs
    _runs.clear()


def _run(runs: Any, rank: int, name: str) -> dict[str, Any]:
    phase = "second" if name.endswith("-resumed") else "first"
    return runs[phase][rank][name]


def test_adopted_a_run_resumed_mid_epoch_sees_what_the_uninterrupted_run_saw(runs: Any) -> None:
    for rank in range(2):
        full, stopped, resumed = (_run(runs, rank, f"stoker-{run}") for run in ("full", "stopped", "resumed"))
        assert len(full["steps"]) == 2 * STEPS_PER_EPOCH
        assert stopped["steps"] == full["steps"][: STOP + 1]  # went on past the checkpoint
        assert resumed["steps"] == full["steps"][STOP:], rank  # the rest of that epoch, then the next


def test_the_ranks_train_on_disjoint_samples_covering_each_epoch(runs: Any) -> None:
    for flavour in ("torchdata", "stoker"):
        for epoch in range(2):
            shares = [
                [i for step in _run(runs, r, f"{flavour}-full")["steps"][epoch * 8 : (epoch + 1) * 8] for i in step]
                for r in range(2)
            ]
            assert sorted(shares[0] + shares[1]) == list(range(N)), (flavour, epoch)


def test_adopted_the_loaders_are_stokers_and_stateful(runs: Any) -> None:
    for rank in range(2):
        for run in ("full", "stopped", "resumed"):
            ours, theirs = _run(runs, rank, f"stoker-{run}"), _run(runs, rank, f"torchdata-{run}")
            assert ours["stateful"] and theirs["stateful"], run  # the setting reached the Accelerator
            stoker_kinds = [k.removeprefix("skipped ") for k in ours["kinds"]]
            assert all(k.startswith("stoker.") for k in stoker_kinds), ours["kinds"]
            assert any(k.endswith(".StatefulDataLoader") for k in stoker_kinds), ours["kinds"]
            assert TORCHDATA in theirs["kinds"], theirs["kinds"]
        # the Trainer resumes mid-epoch through skip_first_batches, a plain loader
        assert any(k.startswith("skipped stoker.") for k in _run(runs, rank, "stoker-resumed")["kinds"])
        assert f"skipped {TORCH}" in _run(runs, rank, "torchdata-resumed")["kinds"]


def test_adopted_the_ranks_see_what_the_control_gives_them_where_the_control_is_right(runs: Any) -> None:
    """The same samples as the Trainer as it comes where its loader gives the seedable sampler's
    order: the uninterrupted second epoch, and the resumed rest of the first (through
    skip_first_batches, a plain loader). Elsewhere the control is not exact, and stoker is:
    torchdata's `state_dict()`, which accelerate calls while it builds the loader, starts the
    loader's first iterator (its workers prefetching) from the Trainer's RandomSampler before
    accelerate puts its seedable sampler in, and that iterator serves the first epoch the loader
    runs: epoch 0 of the uninterrupted run, epoch 1 of the resumed one (measured with
    transformers 5.24, accelerate 1.15, torchdata 0.11, 2 workers)."""
    rest = STEPS_PER_EPOCH - STOP
    for rank in range(2):
        ours, theirs = (_run(runs, rank, f"{flavour}-full")["steps"] for flavour in ("stoker", "torchdata"))
        assert ours[STEPS_PER_EPOCH:] == theirs[STEPS_PER_EPOCH:], rank
        ours, theirs = (_run(runs, rank, f"{flavour}-resumed")["steps"] for flavour in ("stoker", "torchdata"))
        assert ours[:rest] == theirs[:rest], rank
