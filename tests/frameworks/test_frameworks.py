"""stoker.torch inside the real training frameworks — Lightning (Trainer and Fabric), accelerate
and the Hugging Face Trainer — on two CPU ranks over gloo, inside a network namespace with only
the loopback interface. Each case runs twice, once with torch.utils.data (the control) and once
with stoker.torch, the import the only difference: the ranks' samples are disjoint and cover
the dataset as with torch, the loader doing the work is stoker's, and a run resumed from a
mid-epoch checkpoint continues where it stopped. Nothing is left running afterwards."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)


from namespaces import loopback_only, run_in_namespace  # noqa: E402

SCRIPT = Path(__file__).with_name("run_frameworks.py")
TIMEOUT_S = 240
N = 64
FLAVOURS = ["torch", "stoker"]
STOKER_LOADER = "stoker._core.torch_loader.DataLoader"


NO_NAMESPACE = loopback_only()
# a test runs up to three two-rank launches, each under TIMEOUT_S: pyproject's 120 s per test
# would stop the whole run on a loaded machine
pytestmark = [pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE)),
              pytest.mark.timeout(3 * TIMEOUT_S + 60)]


def run(case: str, flavour: str, out: Path, phase: str = "", launcher: str = "self") -> list[dict[str, Any]]:
    """Run one case on two ranks (one for lightning-order); each rank's record."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MASTER_ADDR="127.0.0.1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    arguments = [str(SCRIPT), case, flavour, str(out)] + ([phase] if phase else [])
    if launcher == "torchrun":
        arguments = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                     "--master_port", "29533", *arguments]
    run_in_namespace(arguments, out, env, TIMEOUT_S, f"{case} ({flavour})")
    name = "-".join(part for part in (case, flavour, phase) if part)
    ranks = sorted(out.glob(f"{name}-[0-9].json"))
    return [json.loads(path.read_text()) for path in ranks]


def halves(records: list[dict[str, Any]], key: str) -> list[list[int]]:
    return [[i for batch in record[key] for i in (batch[1] if key == "train" else batch)] for record in records]


def assert_disjoint_cover(shards: list[list[int]], n: int = N) -> None:
    assert len(shards) == 2
    assert all(len(shard) == n // 2 for shard in shards), [len(s) for s in shards]
    assert not set(shards[0]) & set(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(range(n))


# ------------------------------------------------------------------- Lightning
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_lightning_ddp_gives_each_rank_its_shard_in_every_stage(flavour: str, tmp_path: Path) -> None:
    records = run("lightning-fit", flavour, tmp_path)
    for stage in ("train", "val", "validate", "predict"):
        assert_disjoint_cover(halves(records, stage))
    for record in records:
        # the prediction writer gets each batch's dataset indices (its predictions are the indices)
        assert record["writer"] and all(indices == prediction for indices, prediction in record["writer"])
        if flavour == "stoker":
            assert record["kinds"]["train"] == STOKER_LOADER


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_lightning_datamodule_shards_and_leaves_a_stream_alone(flavour: str, tmp_path: Path) -> None:
    records = run("lightning-datamodule", flavour, tmp_path)
    assert_disjoint_cover(halves(records, "train"))
    for record in records:  # no sampler is injected into a stream: each rank reads all of it
        assert sorted(i for batch in record["val"] for i in batch) == list(range(16))
        if flavour == "stoker":
            assert record["kinds"]["train"] == STOKER_LOADER


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_lightning_without_its_sampler_keeps_the_loader_and_stoker_warns(flavour: str, tmp_path: Path) -> None:
    records = run("lightning-no-sampler", flavour, tmp_path)
    for record in records:
        assert sorted(halves([record], "train")[0]) == list(range(N))  # the loader as given
        # once per loader (train and val), from stoker only
        assert record["unsharded_warnings"] == (2 if flavour == "stoker" else 0)


def test_lightning_one_process_order_equals_torchs(tmp_path: Path) -> None:
    orders = [run("lightning-order", flavour, tmp_path)[0]["train"] for flavour in FLAVOURS]
    assert orders[0] == orders[1] and len(orders[0]) == 16  # 2 epochs of 8 batches, same order


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_lightning_resumes_mid_epoch(flavour: str, tmp_path: Path) -> None:
    full = run("lightning-resume", flavour, tmp_path, "full")
    first = run("lightning-resume", flavour, tmp_path, "first")
    second = run("lightning-resume", flavour, tmp_path, "second")
    for whole, before, after in zip(full, first, second):
        assert len(whole["train"]) == 16 and len(before["train"]) == 3  # 2 epochs of 8 batches
        if flavour == "stoker":  # the loader's state came back with the checkpoint: exact
            assert before["train"] + after["train"] == whole["train"]
            assert whole["kinds"]["train"] == STOKER_LOADER
        else:  # torch's loader has no state: the epoch restarts, as Lightning documents
            assert [b for _, b in after["train"][:3]] == [b for _, b in whole["train"][:3]]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fabric_setup_dataloaders_takes_and_shards_the_loader(flavour: str, tmp_path: Path) -> None:
    records = run("fabric", flavour, tmp_path)
    assert_disjoint_cover([record["train"] for record in records])
    if flavour == "stoker":
        assert all(record["kind"] == STOKER_LOADER for record in records)


# ------------------------------------------------------------------ accelerate
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_accelerate_prepare_shards_places_accumulates_and_gathers(flavour: str, tmp_path: Path) -> None:
    records = run("accelerate", flavour, tmp_path, launcher="torchrun")
    for epoch in range(2):
        assert_disjoint_cover([record["epochs"][epoch] for record in records], n=144)
    for record in records:
        # batches arrive on the accelerator's device (its type: accelerate names cpu "cpu:0")
        assert [d.split(":")[0] for d in record["devices"]] == [record["device"].split(":")[0]]
        for syncs, steps in zip(record["syncs"], record["steps"]):
            # 9 batches, accumulation 2: steps at batches 2, 4, 6, 8 and at the epoch's end
            assert syncs == [False, True] * 4 + [True] and steps == 5
        assert sorted(record["gathered"]) == list(range(17))  # the padding dropped
        assert len(record["skipped"]) == 7 * 8
        if flavour == "stoker":
            assert set(record["kinds"].values()) == {STOKER_LOADER}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_accelerate_resumes_mid_epoch_from_the_loaders_state(flavour: str, tmp_path: Path) -> None:
    if flavour == "torch":
        pytest.skip("torch's DataLoader has no state_dict: accelerate's own resume is skip_first_batches")
    full = run("accelerate-resume", flavour, tmp_path, "full", launcher="torchrun")
    first = run("accelerate-resume", flavour, tmp_path, "first", launcher="torchrun")
    second = run("accelerate-resume", flavour, tmp_path, "second", launcher="torchrun")
    for whole, before, after in zip(full, first, second):
        assert len(whole["batches"]) == 16 and len(before["batches"]) == 3
        assert before["batches"] + after["batches"] == whole["batches"]
        assert whole["kind"] == STOKER_LOADER


# ------------------------------------------------------------ the Hugging Face Trainer
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_trainer_with_stoker_adopted_shards_and_resumes_mid_epoch(flavour: str, tmp_path: Path) -> None:
    full = run("trainer", flavour, tmp_path, "full", launcher="torchrun")
    for epoch in range(2):
        shards = [[i for batch in record["batches"][epoch * 8:(epoch + 1) * 8] for i in batch] for record in full]
        assert_disjoint_cover(shards)
    first = run("trainer", flavour, tmp_path, "first", launcher="torchrun")
    second = run("trainer", flavour, tmp_path, "second", launcher="torchrun")
    for whole, before, after in zip(full, first, second):
        assert len(before["batches"]) == 3
        assert before["batches"] + after["batches"] == whole["batches"]  # the rest, in order
        if flavour == "stoker":
            assert whole["kind"] == STOKER_LOADER
