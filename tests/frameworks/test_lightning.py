"""stoker.torch under the real Lightning (Trainer and Fabric), beside torch.utils.data as the
control: the same assertions hold for both, and with stoker.torch the loader doing the work is
stoker's.

Two CPU ranks (Lightning's ddp strategy over gloo, inside a network namespace with only the
loopback interface) run lightning_main.py twice per flavour: once for fit (train and val
sharded, then validate, and predict with a prediction writer's batch indices), a
LightningDataModule with a stream left alone, `use_distributed_sampler=False`, Fabric's
setup_dataloaders, a run stopped after a mid-epoch checkpoint and (stoker only) loaders asking
for `num_workers="auto"`; once more for a new process group that resumes from that checkpoint. The
rest runs in this process: one-process training order against torch's, streams split with
torch's get_worker_info, fitting on a stream with checkpointing, and Lightning's data-loading
utilities (re-creation keeping every argument, shuffle detection, sampler injection, worker
seeding, the teardown of persistent workers) on stoker's loaders."""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")
dist = pytest.importorskip("torch.distributed")

import numpy as np  # noqa: E402
import own_samplers  # noqa: E402
import psutil  # noqa: E402
import torch.utils.data as tud  # noqa: E402
from lightning_fabric import Fabric  # noqa: E402
from lightning_fabric.utilities.data import (  # noqa: E402
    _auto_add_worker_init_fn,
    _replace_dunder_methods,
    _set_sampler_epoch,
    has_iterable_dataset,
    has_len,
    sized_len,
)
from pytorch_lightning.overrides.distributed import _IndexBatchSamplerWrapper  # noqa: E402
from pytorch_lightning.trainer.connectors.data_connector import _DataConnector  # noqa: E402
from pytorch_lightning.trainer.states import RunningStage  # noqa: E402
from pytorch_lightning.utilities.combined_loader import _shutdown_workers_and_reset_iterator  # noqa: E402
from pytorch_lightning.utilities.data import _is_dataloader_shuffled, _update_dataloader  # noqa: E402
from tests.support.namespaces import loopback_only, run_in_namespace  # noqa: E402
from torch.utils.data.dataloader import _DatasetKind  # noqa: E402

import stoker.torch as st  # noqa: E402

SCRIPT = Path(__file__).with_name("lightning_main.py")
# A bound on a hang, not on speed: a launch takes 30-60 s on a quiet 2-core machine and several
# times that beside other work (past 150 s beside four busy loops and another pytest run).
LAUNCH_TIMEOUT_S = 600
N = 64  # lightning_main.py's map-style dataset
STREAM = 16  # and its stream
FLAVOURS = ["torch", "stoker"]
DATA = {"torch": tud, "stoker": st}
LOADER = {"torch": "torch.utils.data.dataloader.DataLoader", "stoker": "stoker._core.torch_loader.DataLoader"}
DISTRIBUTED_SAMPLER = "torch.utils.data.distributed.DistributedSampler"

GLOO = dist.is_available() and dist.is_gloo_available()
NO_NAMESPACE = loopback_only()
on_two_ranks = pytest.mark.skipif(
    not GLOO or NO_NAMESPACE is not None,
    reason="this torch build has no gloo backend" if not GLOO else str(NO_NAMESPACE),
)
# the first test of a flavour launches its run (the resume test: two), imports and all
launching = pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)


# ------------------------------------------------------------------ launching


def launch(case: str, flavour: str, out: Path) -> list[dict[str, Any]]:
    """lightning_main.py CASE FLAVOUR OUT on two ranks (Lightning starts the second); each
    rank's record. Fails if it does not finish in time or leaves a process behind."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MASTER_ADDR="127.0.0.1")
    env.pop("PL_GLOBAL_SEED", None)
    run_in_namespace(
        [str(SCRIPT), case, flavour, str(out)], out, env, LAUNCH_TIMEOUT_S, f"{case} ({flavour})", grace_s=10
    )
    records = [json.loads((out / f"{case}-{flavour}-{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in records] == [0, 1]
    # the control is torch alone: nothing imported stoker in its ranks
    assert all(r["stoker_imported"] == (flavour == "stoker") for r in records)
    return records


_launched: dict[tuple[str, str], list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """ranks(case, flavour) -> [rank 0's record, rank 1's], launched once per module; "resume"
    resumes from the checkpoint "ddp" saved, in the same folder."""
    folders: dict[str, Path] = {}
    failed: dict[tuple[str, str], str] = {}  # a launch that failed is not launched again

    def get(case: str, flavour: str) -> list[dict[str, Any]]:
        if case == "resume":
            get("ddp", flavour)
        if (case, flavour) in failed:
            pytest.fail(f"the {case} ({flavour}) launch failed in an earlier test: {failed[case, flavour]}")
        if (case, flavour) not in _launched:
            if flavour not in folders:
                folders[flavour] = tmp_path_factory.mktemp(f"lightning-{flavour}")
                if flavour == "stoker":  # the shards the own samplers' runs read
                    own_samplers.write(str(folders[flavour] / "own-shards"))
            try:
                _launched[case, flavour] = launch(case, flavour, folders[flavour])
            except (Exception, pytest.fail.Exception) as exc:
                failed[case, flavour] = str(exc)[:2000]
                raise
        return _launched[case, flavour]

    get.folders = folders  # type: ignore[attr-defined]

    yield get
    _launched.clear()


def flat(batches: list[list[Any]], epoch: int | None = None) -> list[int]:
    """The indices in a stage's batches ([epoch, indices, workers, stoker flags] each)."""
    return [i for batch in batches if epoch is None or batch[0] == epoch for i in batch[1]]


def assert_disjoint_cover(shards: list[list[int]], n: int = N) -> None:
    assert [len(shard) for shard in shards] == [n // 2, n // 2]
    assert not set(shards[0]) & set(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(range(n))


def assert_made_by(flavour: str, batches: list[list[Any]]) -> None:
    """Every sample came from one of the loader's 2 workers (as torch's get_worker_info told
    it), and from stoker's workers exactly when the flavour is stoker's."""
    assert {w for batch in batches for w in batch[2]} == {0, 1}
    assert {f for batch in batches for f in batch[3]} == {int(flavour == "stoker")}


# ------------------------------------------------------------- two ranks: fit
@on_two_ranks
@launching
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fit_and_validate_give_each_rank_its_shard(flavour: str, ranks: Any) -> None:
    records = [r["fit"] for r in ranks("ddp", flavour)]
    for epoch in range(2):
        assert_disjoint_cover([flat(r["train"], epoch) for r in records])
        assert_disjoint_cover([flat(r["val"], epoch) for r in records])
    assert_disjoint_cover([flat(r["validate"]) for r in records])  # trainer.validate after fit
    for record in records:
        assert flat(record["train"], 0) != flat(record["train"], 1)  # set_epoch reached the sampler
        for stage in ("train", "val", "validate"):
            loader = record["loaders"][stage]
            # Lightning re-created the loader around a DistributedSampler: same class, same workers
            assert loader["id"] != record["given"][stage]
            assert (loader["type"], loader["sampler"], loader["num_workers"]) == (
                LOADER[flavour],
                DISTRIBUTED_SAMPLER,
                2,
            )
            assert loader["is_torch_loader"]
            assert_made_by(flavour, record[stage])
        assert record["unsharded"] == []  # sharded: nothing to warn about


@on_two_ranks
@launching
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_predict_writer_gets_each_batchs_indices(flavour: str, ranks: Any) -> None:
    records = [r["fit"] for r in ranks("ddp", flavour)]
    assert_disjoint_cover([flat(r["predict"]) for r in records])
    for record in records:
        loader = record["loaders"]["predict"]
        assert loader["type"] == LOADER[flavour]
        assert loader["batch_sampler"] == "pytorch_lightning.overrides.distributed._IndexBatchSamplerWrapper"
        assert_made_by(flavour, record["predict"])
        writer = record["writer"]
        assert len(writer) == len(record["predict"]) == 4  # 32 samples a rank, batches of 8
        for indices, samples, prediction in writer:
            assert indices and indices == samples == prediction


@on_two_ranks
@launching
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_datamodule_is_sharded_and_its_stream_left_alone(flavour: str, ranks: Any) -> None:
    records = [r["datamodule"] for r in ranks("ddp", flavour)]
    assert_disjoint_cover([flat(r["train"]) for r in records])
    for record in records:
        train, val = record["loaders"]["train"], record["loaders"]["val"]
        assert train["id"] != record["given"]["train"] and train["sampler"] == DISTRIBUTED_SAMPLER
        assert train["type"] == val["type"] == LOADER[flavour]
        # no sampler for a stream: the loader as given, and every rank reads all of it, each
        # item once (the dataset splits itself over the workers with get_worker_info)
        assert val["id"] == record["given"]["val"]
        assert sorted(flat(record["val"])) == list(range(STREAM))
        assert_made_by(flavour, record["train"])
        assert_made_by(flavour, record["val"])
        assert record["unsharded"] == []  # a stream may shard itself: no warning


@on_two_ranks
@launching
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_without_lightnings_sampler_the_loader_is_kept_and_stoker_warns_once_per_loader(
    flavour: str, ranks: Any
) -> None:
    records = [r["no_sampler"] for r in ranks("ddp", flavour)]
    for record in records:
        for stage in ("train", "val"):
            loader = record["loaders"][stage]
            assert loader["id"] == record["given"][stage]  # not re-created
            assert loader["type"] == LOADER[flavour]
            for epoch in range(2):  # every rank reads everything, as with torch
                assert sorted(flat(record[stage], epoch)) == list(range(N))
        assert record["loaders"]["train"]["sampler"].endswith(".RandomSampler")
        assert flat(record["train"], 0) != list(range(N))  # shuffled
        if flavour == "stoker":  # train and val, each at its first iter() only
            assert record["unsharded"] == ["stoker._core.errors.UnshardedWarning"] * 2
            assert record["unsharded_is_user_warning"]
        else:
            assert record["unsharded"] == []


@on_two_ranks
@launching
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fabric_setup_dataloaders_takes_and_shards_the_loader(flavour: str, ranks: Any) -> None:
    records = [r["fabric"] for r in ranks("ddp", flavour)]
    assert [r["rank"] for r in records] == [0, 1]
    for epoch in range(2):
        assert_disjoint_cover([r["epochs"][epoch] for r in records])
    for record in records:
        assert record["epochs"][0] != record["epochs"][1]  # Fabric set the sampler's epoch
        assert record["recreated"]
        assert (record["loader"]["type"], record["loader"]["sampler"]) == (LOADER[flavour], DISTRIBUTED_SAMPLER)
        assert set(record["stoker_flags"]) == {int(flavour == "stoker")}


@on_two_ranks
@launching
def test_the_ranks_read_what_torchs_ranks_read(ranks: Any) -> None:
    """Lightning's DistributedSampler (seed 0, or PL_GLOBAL_SEED) decides the order: with
    stoker.torch each rank's batches are torch's, batch for batch."""
    torch_ranks, stoker_ranks = ranks("ddp", "torch"), ranks("ddp", "stoker")
    for t, s in zip(torch_ranks, stoker_ranks):
        for run, stage in (
            ("fit", "train"),
            ("fit", "val"),
            ("fit", "validate"),
            ("fit", "predict"),
            ("datamodule", "train"),
            ("full", "train"),
        ):
            assert [b[:2] for b in t[run][stage]] == [b[:2] for b in s[run][stage]], (run, stage)
        assert t["fabric"]["epochs"] == s["fabric"]["epochs"]


@on_two_ranks
@launching
def test_auto_workers_survive_fit_and_lightnings_re_creation(ranks: Any) -> None:
    """num_workers="auto" under Trainer.fit: Lightning compares num_workers as an int
    (`_worker_check`) and re-creates the loader around its DistributedSampler, from the given
    loader's attributes (a train loader given to fit) or from its recorded arguments (a val
    loader made in a hook); each re-created loader still asks for "auto" and makes its own
    choice, and the ranks read their shards."""
    records = [r["auto"] for r in ranks("ddp", "stoker")]
    assert_disjoint_cover([flat(r["train"]) for r in records])
    assert_disjoint_cover([flat(r["val"]) for r in records])
    for record in records:
        assert isinstance(record["given_num_workers"], int) and record["given_num_workers"] >= 1
        for stage in ("train", "val"):
            loader = record["loaders"][stage]
            assert loader["id"] != record["given"][stage] and loader["sampler"] == DISTRIBUTED_SAMPLER
            assert loader["type"] == LOADER["stoker"]
            chosen = record["auto"][stage]
            assert chosen["num_workers_is_int"] and chosen["choice"].startswith("num_workers="), chosen


# ----------------------------------------------------------- two ranks: resume
@on_two_ranks
@launching
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_resuming_from_a_mid_epoch_checkpoint(flavour: str, ranks: Any) -> None:
    """2 epochs of 8 batches a rank; "first" stopped after step 3 with a checkpoint saved at
    that step, "second" resumed from it in a new process group. Lightning saves and restores a
    loader's state_dict() when the loader has one: stoker's continues exactly where it stopped.
    torch's has none, and Lightning starts the epoch's data again (batch 0 onwards) for the
    epoch's remaining 5 steps: batches 0-2 are trained on twice, 5-7 not at all."""
    done = ranks("ddp", flavour)
    second = [r["second"] for r in ranks("resume", flavour)]
    for rank, (whole, before, after) in enumerate(zip([r["full"] for r in done], [r["first"] for r in done], second)):
        full_batches = [b[:2] for b in whole["train"]]
        before_batches = [b[:2] for b in before["train"]]
        after_batches = [b[:2] for b in after["train"]]
        assert len(full_batches) == 16 and before_batches == full_batches[:3], rank
        assert after["checkpoint"]["name"] == "epoch=0-step=3.ckpt"
        # each rank's shard of epoch 1, whatever the flavour
        assert after_batches[-8:] == full_batches[8:], rank
        assert_made_by(flavour, after["train"])
        if flavour == "stoker":
            assert after["checkpoint"]["loader_states"] == 1  # the loader's position went with it
            assert before_batches + after_batches == full_batches, rank
            epoch0 = flat(before["train"]) + flat(after["train"], 0)
            assert sorted(epoch0) == sorted(flat(whole["train"], 0)) and len(epoch0) == N // 2
        else:
            assert after["checkpoint"]["loader_states"] == 0
            assert after_batches[:5] == full_batches[:5], rank


# ------------------------------------------- two ranks: stoker's own samplers
def _own_batches(record: dict[str, Any], epoch: int | None = None) -> list[list[int]]:
    return [batch[1] for batch in record["train"] if epoch is None or batch[0] == epoch]


@on_two_ranks
@launching
@pytest.mark.parametrize("kind", own_samplers.KINDS)
def test_own_samplers_give_each_rank_its_share_as_without_lightning(kind: str, ranks: Any) -> None:
    """A ShardedSampler or StreamSampler is a torch DistributedSampler (made while torch is
    imported): under the default use_distributed_sampler=True Lightning keeps the loader as
    given, and each rank trains on exactly what the plain loader gives it without Lightning,
    in the same order, every epoch (Lightning calls the sampler's set_epoch)."""
    records = ranks("ddp", "stoker")
    folder = str(ranks.folders["stoker"] / "own-shards")
    for rank, record in enumerate(r[f"own-{kind}-full"] for r in records):
        expected = own_samplers.plain(kind, folder, rank)
        for epoch in range(2):
            seen = [i for batch in _own_batches(record, epoch) for i in batch]
            assert len(seen) == own_samplers.share(kind)
            assert seen == expected[epoch], (rank, epoch)
        assert record["loader"]["id"] == record["given"]  # not re-created around another sampler
        assert record["loader"]["sampler"].endswith("ShardedSampler" if kind == "sharded" else "StreamSampler")
        assert record["unsharded"] == []


@on_two_ranks
@launching
@pytest.mark.parametrize("kind", own_samplers.KINDS)
def test_own_samplers_resume_from_a_mid_epoch_checkpoint(kind: str, ranks: Any) -> None:
    """Stopped after step 3 with a checkpoint there, resumed in a new process group: the
    batches before and after are the uninterrupted run's, batch for batch."""
    done = ranks("ddp", "stoker")
    resumed = ranks("resume", "stoker")
    for rank, (whole, before, after) in enumerate(
        zip(
            *(
                [r[f"own-{kind}-{phase}"] for r in rs]
                for rs, phase in ((done, "full"), (done, "first"), (resumed, "second"))
            )
        )
    ):
        assert len(_own_batches(before)) == 3, rank
        assert _own_batches(before) + _own_batches(after) == _own_batches(whole), rank
        assert [b[0] for b in before["train"] + after["train"]] == [b[0] for b in whole["train"]], rank


# ------------------------------------------------------------ one process
class Numbers(tud.Dataset):  # stoker.torch.Dataset is this very class (checked below)
    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return torch.tensor([float(i)]), i


class Stream(tud.IterableDataset):
    """0..n-1, split over the loader's workers with torch's get_worker_info."""

    def __init__(self, n: int = STREAM) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(first, self.n, step):
            yield torch.tensor([float(i)]), i, -1 if info is None else info.id


class Seeded(tud.Dataset):
    """What a worker knows about its seeding: its pid, id, base seed, and a draw from each of
    the RNGs Lightning's worker_init_fn seeds."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[int, ...]:
        info = tud.get_worker_info()
        assert info is not None
        return (
            i,
            os.getpid(),
            info.id,
            info.seed - info.id,
            int(np.random.randint(1 << 30)),
            random.randrange(1 << 30),
            int(torch.randint(1 << 30, ()).item()),
        )


def indices(loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch[1]]


def test_stokers_kinds_are_torchs() -> None:
    assert issubclass(st.DataLoader, tud.DataLoader)
    assert st.Dataset is tud.Dataset and st.IterableDataset is tud.IterableDataset
    for name in ("RandomSampler", "SequentialSampler", "BatchSampler", "DistributedSampler"):
        assert issubclass(getattr(st, name), getattr(tud, name)), name
    assert st.DataLoader(Numbers())._dataset_kind is _DatasetKind.Map
    assert st.DataLoader(Stream())._dataset_kind is _DatasetKind.Iterable
    assert issubclass(st.UnshardedWarning, UserWarning)


def _fit_one_process(flavour: str, root: Path) -> list[Any]:
    """seed_everything(7), then 2 epochs on one CPU (sanity check included): the batches of a
    shuffled loader with 2 workers, the val batches, a draw from the global RNG at each step
    and each sample's base seed."""
    data = DATA[flavour]
    seen: list[Any] = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, index: int) -> Any:
            seen.append(["train", batch[1].tolist(), float(torch.rand(()))])
            return self.layer(batch[0]).sum()

        def validation_step(self, batch: Any, index: int) -> None:
            seen.append(["val", batch[1].tolist()])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return data.DataLoader(Numbers(), batch_size=8, shuffle=True, num_workers=2)

        def val_dataloader(self) -> Any:
            return data.DataLoader(Numbers(), batch_size=16, num_workers=2)

    pl.seed_everything(7)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(Model())
    return seen


def test_one_process_training_order_equals_torchs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning draws nothing more from the RNG for stoker's loader than for torch's (an extra
    iter() would): the same batches, in the same order, and the same global RNG after them."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # seed_everything sets it; put back afterwards
    runs = {flavour: _fit_one_process(flavour, tmp_path) for flavour in FLAVOURS}
    train = [entry for entry in runs["torch"] if entry[0] == "train"]
    assert len(train) == 16 and sorted(i for entry in train[:8] for i in entry[1]) == list(range(N))
    assert runs["stoker"] == runs["torch"]


@pytest.mark.parametrize(
    "flavour, extra",
    [
        ("torch", {}),
        ("stoker", {}),
        ("torch", {"persistent_workers": True}),
        ("stoker", {"persistent_workers": True}),
        ("stoker", {"thread_pool": True}),
    ],
    ids=["torch", "stoker", "torch-persistent", "stoker-persistent", "stoker-threads"],
)
def test_a_stream_split_with_torchs_get_worker_info_yields_each_item_once(flavour: str, extra: dict[str, Any]) -> None:
    loader = DATA[flavour].DataLoader(Stream(), batch_size=3, num_workers=2, **extra)
    for _ in range(2):
        batches = list(loader)
        assert sorted(int(i) for batch in batches for i in batch[1]) == list(range(STREAM))
        assert {int(w) for batch in batches for w in batch[2]} == {0, 1}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fit_on_a_stream_with_checkpointing(flavour: str, tmp_path: Path) -> None:
    """Lightning's checkpoint asks every train loader that has a state_dict() for it (its
    fit loop's on_save_checkpoint); a stream's loader has one too (stoker's), and the epoch's
    checkpoint must still be written."""
    seen: list[int] = []
    data = DATA[flavour]

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, index: int) -> Any:
            seen.extend(batch[1].tolist())
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return data.DataLoader(Stream(), batch_size=4, num_workers=2)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Model())
    assert sorted(seen) == list(range(STREAM))
    assert [p.name for p in tmp_path.rglob("*.ckpt")] == ["epoch=0-step=4.ckpt"]


# ------------------------------------------ Lightning's data utilities, in-process
class _Trainer:
    """What Lightning's _DataConnector reads of its trainer to decide on a sampler."""

    def __init__(self, rank: int = 0, world: int = 2, use_distributed_sampler: bool = True) -> None:
        self._accelerator_connector = type(
            "Connector", (), {"use_distributed_sampler": use_distributed_sampler, "is_distributed": world > 1}
        )()
        self.distributed_sampler_kwargs = {"num_replicas": world, "rank": rank}
        self.overfit_batches = 0
        self.state = type("State", (), {"fn": None})()


def made_in_a_hook(loader_cls: Any, *args: Any, **kwargs: Any) -> Any:
    """A loader made as Lightning makes the one a *_dataloader hook returns: inside the
    context that records every DataLoader's and BatchSampler's __init__ arguments."""
    with _replace_dunder_methods(tud.DataLoader, "dataset"), _replace_dunder_methods(tud.BatchSampler):
        return loader_cls(*args, **kwargs)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_requires_distributed_sampler_as_for_torch(flavour: str) -> None:
    data = DATA[flavour]
    connector = _DataConnector(_Trainer())  # type: ignore[arg-type]
    assert connector._requires_distributed_sampler(data.DataLoader(Numbers(), shuffle=True))
    assert connector._requires_distributed_sampler(
        data.DataLoader(Numbers(), sampler=data.SequentialSampler(Numbers()))
    )
    sharded = data.DataLoader(Numbers(), sampler=data.DistributedSampler(Numbers(), num_replicas=2, rank=0))
    assert not connector._requires_distributed_sampler(sharded)
    assert not connector._requires_distributed_sampler(data.DataLoader(Stream()))
    assert has_iterable_dataset(data.DataLoader(Stream())) and not has_iterable_dataset(data.DataLoader(Numbers()))
    alone = _DataConnector(_Trainer(use_distributed_sampler=False))  # type: ignore[arg-type]
    assert not alone._requires_distributed_sampler(data.DataLoader(Numbers(), shuffle=True))


@pytest.mark.parametrize("in_hook", [True, False], ids=["captured", "attributes"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_prepare_dataloader_shards_over_ranks_keeping_the_loader(flavour: str, in_hook: bool) -> None:
    data = DATA[flavour]
    shards, loaders = [], []
    for rank in range(2):
        connector = _DataConnector(_Trainer(rank=rank))  # type: ignore[arg-type]
        kwargs = dict(batch_size=4, shuffle=True, num_workers=2, drop_last=True)
        given = (
            made_in_a_hook(data.DataLoader, Numbers(), **kwargs) if in_hook else data.DataLoader(Numbers(), **kwargs)
        )
        loader = connector._prepare_dataloader(given, shuffle=True, mode=RunningStage.TRAINING)
        assert loader is not given and type(loader) is type(given)
        assert isinstance(loader.sampler, tud.DistributedSampler) and loader.sampler.shuffle
        assert (loader.num_workers, loader.batch_size, loader.drop_last) == (2, 4, True)
        shards.append(indices(loader))
        loaders.append(loader)
    assert_disjoint_cover(shards)
    stream = data.DataLoader(Stream(), batch_size=2)
    assert _DataConnector(_Trainer())._prepare_dataloader(stream, shuffle=False, mode=RunningStage.TRAINING) is stream  # type: ignore[arg-type]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_prepare_dataloader_for_predict_tracks_the_batch_indices(flavour: str) -> None:
    data = DATA[flavour]
    connector = _DataConnector(_Trainer(rank=1))  # type: ignore[arg-type]
    given = made_in_a_hook(data.DataLoader, Numbers(10), batch_size=3, num_workers=2, drop_last=True)
    loader = connector._prepare_dataloader(given, shuffle=False, mode=RunningStage.PREDICTING)
    assert type(loader) is type(given)
    assert isinstance(loader.batch_sampler, _IndexBatchSamplerWrapper)
    batches = [batch[1].tolist() for batch in loader]
    # rank 1 of 2, without padding; drop_last is turned off to predict on every sample
    assert batches == [[1, 3, 5], [7, 9]]
    assert loader.batch_sampler.seen_batch_indices == batches


# stoker's own arguments (not torch's), none at its default
STOKER_ONLY = {"max_worker_restarts": 2, "thread_pool": True, "seed_each_batch": False}


def _collate(samples: list[Any]) -> Any:
    return ("collated", tud.default_collate(samples))


def _init(worker_id: int) -> None:
    os.environ["LIGHTNING_TEST_INIT"] = str(worker_id)


@pytest.mark.parametrize("in_hook", [True, False], ids=["captured", "attributes"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_update_dataloader_keeps_every_argument_and_takes_the_new_sampler(flavour: str, in_hook: bool) -> None:
    data = DATA[flavour]
    generator = torch.Generator().manual_seed(3)
    kwargs: dict[str, Any] = dict(
        batch_size=4,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        pin_memory=True,
        collate_fn=_collate,
        worker_init_fn=_init,
        generator=generator,
        prefetch_factor=3,
        timeout=30.0,
        drop_last=True,
    )
    if flavour == "stoker":
        kwargs.update(STOKER_ONLY)
    loader = made_in_a_hook(data.DataLoader, Numbers(), **kwargs) if in_hook else data.DataLoader(Numbers(), **kwargs)
    sampler = tud.DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False)
    again = _update_dataloader(loader, sampler)
    assert type(again) is type(loader) and again.sampler is sampler and again.dataset is loader.dataset
    assert isinstance(again.batch_sampler, tud.BatchSampler) and again.batch_sampler.sampler is sampler
    for name, value in kwargs.items():
        if name != "shuffle":
            assert getattr(again, name) == value, name
    batches = list(again)
    assert all(batch[0] == "collated" for batch in batches)
    assert [int(i) for batch in batches for i in batch[1][1]] == list(range(1, N, 2))


@pytest.mark.parametrize("in_hook", [True, False], ids=["captured", "attributes"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_update_dataloader_keeps_the_multiprocessing_context(flavour: str, in_hook: bool) -> None:
    data = DATA[flavour]
    kwargs = dict(batch_size=4, num_workers=1, multiprocessing_context="spawn")
    loader = made_in_a_hook(data.DataLoader, Numbers(), **kwargs) if in_hook else data.DataLoader(Numbers(), **kwargs)
    again = _update_dataloader(loader, tud.DistributedSampler(loader.dataset, num_replicas=2, rank=0, shuffle=False))
    assert type(again) is type(loader) and again.multiprocessing_context.get_start_method() == "spawn"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_update_dataloader_of_a_custom_batch_sampler_made_in_a_hook(flavour: str) -> None:
    data = DATA[flavour]

    class EveryOther(tud.BatchSampler):
        def __init__(self, sampler: Any, batch_size: int, drop_last: bool, skip: int = 2) -> None:
            super().__init__(sampler, batch_size, drop_last)
            self.skip = skip

        def __iter__(self) -> Any:
            for number, batch in enumerate(super().__iter__()):
                if number % self.skip == 0:
                    yield batch

    loader = made_in_a_hook(
        data.DataLoader,
        Numbers(16),
        batch_sampler=made_in_a_hook(
            EveryOther, tud.SequentialSampler(range(16)), batch_size=2, drop_last=False, skip=2
        ),
        num_workers=2,
    )
    again = _update_dataloader(loader, tud.DistributedSampler(loader.dataset, num_replicas=2, rank=0, shuffle=False))
    assert type(again) is type(loader) and type(again.batch_sampler) is EveryOther and again.batch_sampler.skip == 2
    assert indices(again) == [0, 2, 8, 10]  # rank 0's half (0, 2, ..., 14), every other batch of 2


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_shuffle_is_detected_as_for_torch(flavour: str) -> None:
    data = DATA[flavour]
    assert _is_dataloader_shuffled(data.DataLoader(Numbers(), shuffle=True))
    assert _is_dataloader_shuffled(made_in_a_hook(data.DataLoader, Numbers(), shuffle=True))
    assert _is_dataloader_shuffled(data.DataLoader(Numbers(), sampler=data.RandomSampler(Numbers())))
    assert not _is_dataloader_shuffled(data.DataLoader(Numbers()))
    assert not _is_dataloader_shuffled(made_in_a_hook(data.DataLoader, Numbers(), shuffle=False))
    batches = data.BatchSampler(data.SequentialSampler(Numbers()), 4, False)
    assert not _is_dataloader_shuffled(data.DataLoader(Numbers(), batch_sampler=batches))
    # Fabric decides by the sampler's class
    assert Fabric._get_distributed_sampler(data.DataLoader(Numbers(), shuffle=True), num_replicas=2, rank=0).shuffle
    assert not Fabric._get_distributed_sampler(data.DataLoader(Numbers()), num_replicas=2, rank=0).shuffle


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_lengths_as_for_torch(flavour: str) -> None:
    data = DATA[flavour]
    loader = data.DataLoader(Numbers(10), batch_size=4)
    assert has_len(loader) and sized_len(loader) == 3
    assert not has_len(data.DataLoader(Stream(), batch_size=4)) and sized_len(data.DataLoader(Stream())) is None


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_set_sampler_epoch_reaches_the_sampler_inside(flavour: str) -> None:
    data = DATA[flavour]
    loader = data.DataLoader(
        Numbers(), batch_size=8, sampler=tud.DistributedSampler(Numbers(), num_replicas=2, rank=0, seed=4)
    )
    _set_sampler_epoch(loader, 3)
    assert loader.sampler.epoch == 3
    expected = tud.DistributedSampler(Numbers(), num_replicas=2, rank=0, seed=4)
    expected.set_epoch(3)
    assert indices(loader) == list(expected)


def _seeded_draws(flavour: str) -> list[list[int]]:
    torch.manual_seed(3)
    loader = DATA[flavour].DataLoader(Seeded(), batch_size=4, num_workers=2)
    _auto_add_worker_init_fn(loader, rank=1)
    assert loader.worker_init_fn is not None
    return [[int(v) for v in column] for batch in loader for column in zip(*batch)]


def test_lightnings_worker_seeding_draws_what_it_draws_in_torchs_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """seed_everything(workers=True) sets PL_SEED_WORKERS, and Lightning adds its
    worker_init_fn, which seeds torch, random and numpy from torch.initial_seed() in the
    worker: in stoker's workers it draws the numbers it draws in torch's."""
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    draws = {flavour: _seeded_draws(flavour) for flavour in FLAVOURS}
    assert len(draws["torch"]) == 16
    strip_pid = [[row[0], *row[2:]] for row in draws["torch"]], [[row[0], *row[2:]] for row in draws["stoker"]]
    assert strip_pid[1] == strip_pid[0]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_lightnings_teardown_stops_persistent_workers(flavour: str) -> None:
    """At the end of a stage Lightning shuts down a loader's workers by resetting its
    `_iterator`: no worker may be left running."""
    loader = DATA[flavour].DataLoader(Seeded(), batch_size=4, num_workers=2, persistent_workers=True)
    pids = {int(pid) for _ in range(2) for batch in loader for pid in batch[1]}
    assert len(pids) == 2 and os.getpid() not in pids
    _shutdown_workers_and_reset_iterator(loader)
    assert loader._iterator is None
    gc.collect()
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
        assert time.monotonic() < deadline, f"workers {sorted(pids)} still running"
        time.sleep(0.05)
    again = {int(pid) for batch in loader for pid in batch[1]}  # and the loader still works
    assert len(again) == 2 and not again & pids
