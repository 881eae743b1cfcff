"""A user's Lightning script, for tests/frameworks/test_lightning.py:
`python lightning_main.py CASE FLAVOUR OUTDIR`. FLAVOUR "torch" imports DataLoader, Dataset and
IterableDataset from torch.utils.data (the control), "stoker" from stoker.torch: the only
difference between the two. Each rank writes OUTDIR/CASE-FLAVOUR-RANK.json.

CASE "ddp" starts two CPU ranks (Lightning's ddp strategy runs this script again for rank 1)
and, in that one process group, runs in turn:

- fit: a LightningModule's shuffled train loader and its val loader, 2 epochs, then
  `trainer.validate` and `trainer.predict` with a BasePredictionWriter (write_interval="batch");
- datamodule: a LightningDataModule's train loader, and a stream (IterableDataset) as its val
  loader, which Lightning leaves alone;
- no_sampler: `Trainer(use_distributed_sampler=False)`, 2 epochs;
- fabric: `Fabric(strategy="ddp").setup_dataloaders(loader)`, 2 epochs;
- full / first: 2 epochs of a shuffled loader; the same run stopped after step 3
  (`max_steps=3`) with a checkpoint saved at that step by `ModelCheckpoint`;
- auto (stoker only: torch's loader has no "auto"): `num_workers="auto"` for a train loader
  given to `fit` (Lightning re-creates it from its attributes) and a val loader made in a hook
  (from its recorded arguments), 1 epoch; what each re-created loader's "auto" chose.

- own (stoker only): for stoker's own samplers of a rank's share (ShardedSampler over shards in
  OUTDIR/own-shards, which the test wrote, and StreamSampler over packed rows; see
  own_samplers.py), a loader returned by `train_dataloader` under the default
  `use_distributed_sampler=True`: 2 epochs, and the same run stopped after step 3 with a
  checkpoint at that step.

CASE "resume" starts a new process group that resumes "first" (and, stoker only, each own
sampler's stopped run) from its checkpoint (`trainer.fit(model, ckpt_path=...)`) and runs to the
end of the second epoch.

Every sample is (x, index, the id torch.utils.data.get_worker_info() gives in the worker that
made it, 1 if stoker's worker made it): a stage's record is its batches, each
[epoch, indices, worker ids, stoker flags], and the loader Lightning iterated in it.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import warnings
from typing import Any

import torch

CASE, FLAVOUR, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
N = 64  # samples of the map-style dataset
STREAM = 16  # items of the stream

if FLAVOUR == "stoker":
    import stoker.torch as data
else:
    import torch.utils.data as data

import pytorch_lightning as pl  # noqa: E402
from lightning_fabric import Fabric  # noqa: E402
from pytorch_lightning.callbacks import BasePredictionWriter, ModelCheckpoint  # noqa: E402

DataLoader, Dataset, IterableDataset = data.DataLoader, data.Dataset, data.IterableDataset
if FLAVOUR == "stoker":
    import own_samplers  # beside this script


def made_by_stoker() -> int:
    """1 inside one of stoker's workers (stoker is never imported in the torch flavour)."""
    stoker = sys.modules.get("stoker")
    return int(stoker is not None and stoker.get_worker_info() is not None)


def worker_id() -> int:
    info = torch.utils.data.get_worker_info()
    return -1 if info is None else info.id


class Numbers(Dataset):  # type: ignore[misc,valid-type]
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int, int]:
        return torch.tensor([float(i)]), i, worker_id(), made_by_stoker()


class Stream(IterableDataset):  # type: ignore[misc,valid-type]
    """0..STREAM-1, split across the loader's workers with torch's get_worker_info (and not
    across ranks: every rank reads all of it)."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(first, STREAM, step):
            yield torch.tensor([float(i)]), i, worker_id(), made_by_stoker()


def kind(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def describe(loader: Any) -> dict[str, Any]:
    """The loader Lightning iterates in a stage (the one it re-created, if it did)."""
    if isinstance(loader, (list, tuple)):
        (loader,) = loader
    batch_sampler = getattr(loader, "batch_sampler", None)
    return {
        "type": kind(loader),
        "id": id(loader),
        "sampler": kind(getattr(loader, "sampler", None)),
        "batch_sampler": kind(batch_sampler),
        "batch_sampler_sampler": kind(getattr(batch_sampler, "sampler", None)),
        "num_workers": getattr(loader, "num_workers", None),
        "is_torch_loader": isinstance(loader, torch.utils.data.DataLoader),
    }


def auto_choice(loader: Any) -> dict[str, Any]:
    """What a stoker loader's num_workers reads and what its "auto" chose (None: nothing)."""
    if isinstance(loader, (list, tuple)):
        (loader,) = loader
    return {"num_workers_is_int": isinstance(loader.num_workers, int), "choice": loader.stats().choice}


class Recorder(pl.LightningModule):
    """Writes what each stage saw into `record`; its *_dataloader hooks note the id of the
    loader they return (Lightning may iterate a re-created one)."""

    def __init__(self, record: dict[str, Any], batch_size: int = 8, hooks: bool = True) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.record = record
        self.batch_size = batch_size
        self.hooks = hooks
        for stage in ("train", "val", "validate", "predict"):
            record.setdefault(stage, [])
        record.setdefault("loaders", {})
        record.setdefault("given", {})

    def note(self, stage: str, batch: Any, loader: Any) -> None:
        _, i, worker, stoker_flag = batch
        self.record[stage].append([self.current_epoch, i.tolist(), worker.tolist(), stoker_flag.tolist()])
        self.record["loaders"][stage] = describe(loader)

    def training_step(self, batch: Any, index: int) -> Any:
        self.note("train", batch, self.trainer.train_dataloader)
        return self.layer(batch[0]).sum()

    def validation_step(self, batch: Any, index: int) -> None:
        stage = "validate" if self.trainer.state.fn == "validate" else "val"
        self.note(stage, batch, self.trainer.val_dataloaders)

    def predict_step(self, batch: Any, index: int) -> Any:
        self.note("predict", batch, self.trainer.predict_dataloaders)
        return batch[1]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def given(self, stage: str, loader: Any) -> Any:
        if stage == "val" and self.trainer.state.fn == "validate":
            stage = "validate"  # the val hook, called again by trainer.validate
        self.record["given"][stage] = id(loader)
        return loader


class Module(Recorder):
    def train_dataloader(self) -> Any:
        return self.given("train", DataLoader(Numbers(), batch_size=self.batch_size, shuffle=True, num_workers=2))

    def val_dataloader(self) -> Any:
        return self.given("val", DataLoader(Numbers(), batch_size=8, num_workers=2))

    def predict_dataloader(self) -> Any:
        return self.given("predict", DataLoader(Numbers(), batch_size=8, num_workers=2))


class TrainOnly(Recorder):
    def train_dataloader(self) -> Any:
        return self.given("train", DataLoader(Numbers(), batch_size=self.batch_size, shuffle=True, num_workers=2))


class Numbers64(pl.LightningDataModule):
    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__()
        self.record = record

    def train_dataloader(self) -> Any:
        loader = DataLoader(Numbers(), batch_size=8, shuffle=True, num_workers=2)
        self.record["given"]["train"] = id(loader)
        return loader

    def val_dataloader(self) -> Any:
        loader = DataLoader(Stream(), batch_size=4, num_workers=2)
        self.record["given"]["val"] = id(loader)
        return loader


class Writer(BasePredictionWriter):
    """What Lightning tells a prediction writer: each batch's dataset indices, beside the
    indices the batch holds."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(write_interval="batch")
        self.record = record
        record["writer"] = []

    def write_on_batch_end(
        self,
        trainer: Any,
        module: Any,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        indices = None if batch_indices is None else [int(i) for i in batch_indices]
        self.record["writer"].append([indices, batch[1].tolist(), prediction.tolist()])


def trainer(**extra: Any) -> pl.Trainer:
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=OUT,
    )
    settings.update(extra)
    return pl.Trainer(**settings)


def unsharded(caught: list[warnings.WarningMessage]) -> list[str]:
    """The UnshardedWarnings caught (their category, by name: torch has none)."""
    return [kind(w.category()) for w in caught if w.category.__name__ == "UnshardedWarning"]


def fit_case(runs: dict[str, Any]) -> int:
    record: dict[str, Any] = {}
    run = trainer(callbacks=[Writer(record)])
    model = Module(record)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(model)
        run.validate(model, verbose=False)
        run.predict(model, return_predictions=False)
    record["unsharded"] = unsharded(caught)
    runs["fit"] = record
    return run.global_rank


def datamodule_case(runs: dict[str, Any]) -> None:
    record: dict[str, Any] = {}
    run = trainer(max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(Recorder(record), datamodule=Numbers64(record))
    record["unsharded"] = unsharded(caught)
    runs["datamodule"] = record


def no_sampler_case(runs: dict[str, Any]) -> None:
    record: dict[str, Any] = {}
    run = trainer(use_distributed_sampler=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(Module(record))
    record["unsharded"] = unsharded(caught)
    if FLAVOUR == "stoker":
        import stoker.torch

        record["unsharded_is_user_warning"] = all(
            issubclass(w.category, stoker.torch.UnshardedWarning) and issubclass(w.category, UserWarning)
            for w in caught
            if w.category.__name__ == "UnshardedWarning"
        )
    runs["no_sampler"] = record


def fabric_case(runs: dict[str, Any]) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()  # the process group is up already: nothing more is started
    given = DataLoader(Numbers(), batch_size=8, shuffle=True, num_workers=2)
    loader = fabric.setup_dataloaders(given)
    epochs = []
    for _ in range(2):
        epochs.append([[int(i) for i in batch[1]] for batch in loader])
    flags = [int(f) for batch in loader for f in batch[3]]
    inner = getattr(loader, "_dataloader", loader)
    runs["fabric"] = {
        "epochs": [[i for batch in epoch for i in batch] for epoch in epochs],
        "stoker_flags": flags,
        "loader": describe(inner),
        "recreated": inner is not given,
        "rank": fabric.global_rank,
    }


class AutoVal(Recorder):
    def val_dataloader(self) -> Any:
        return self.given("val", DataLoader(Numbers(), batch_size=8, num_workers="auto"))

    def on_fit_end(self) -> None:
        # the epochs are over: each re-created loader has made its choice
        self.record["auto"] = {
            "train": auto_choice(self.trainer.train_dataloader),
            "val": auto_choice(self.trainer.val_dataloaders),
        }


def auto_case(runs: dict[str, Any]) -> None:
    record: dict[str, Any] = {}
    given = DataLoader(Numbers(), batch_size=8, shuffle=True, num_workers="auto")
    record["given_num_workers"] = given.num_workers
    model = AutoVal(record)
    model.given("train", given)
    trainer(max_epochs=1).fit(model, train_dataloaders=given)
    runs["auto"] = record


def checkpoint_dir() -> str:
    return os.path.join(OUT, f"checkpoints-{FLAVOUR}")


def resume_runs(runs: dict[str, Any], phase: str) -> int:
    """full: 2 epochs; first: stopped after step 3, a checkpoint saved at that step;
    second: resumed from that checkpoint. Batches of 4: 8 a rank an epoch."""
    pl.seed_everything(5)  # the injected DistributedSampler's seed: PL_GLOBAL_SEED
    record: dict[str, Any] = {}
    model = TrainOnly(record, batch_size=4)
    if phase == "full":
        run = trainer()
        run.fit(model)
    elif phase == "first":
        saver = ModelCheckpoint(dirpath=checkpoint_dir(), every_n_train_steps=3, save_top_k=-1)
        run = trainer(max_steps=3, enable_checkpointing=True, callbacks=[saver])
        run.fit(model)
    else:
        (path,) = glob.glob(os.path.join(checkpoint_dir(), "*.ckpt"))
        saved = torch.load(path, map_location="cpu", weights_only=False)
        loop = saved["loops"]["fit_loop"]
        record["checkpoint"] = {
            "name": os.path.basename(path),
            "loader_states": len(loop["state_dict"].get("combined_loader", [])),
            "batches_completed": loop["epoch_loop.batch_progress"]["current"]["completed"],
        }
        run = trainer()
        run.fit(model, ckpt_path=path)
    runs[phase] = record
    return run.global_rank


class OwnSampler(pl.LightningModule):
    """Trains on a loader with one of stoker's own samplers; notes each batch's identities."""

    def __init__(self, kind: str, record: dict[str, Any]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.kind = kind
        self.record = record
        record["train"] = []

    def training_step(self, batch: Any, index: int) -> Any:
        self.record["train"].append([self.current_epoch, own_samplers.identities(self.kind, batch)])
        self.record["loader"] = describe(self.trainer.train_dataloader)
        return self.layer(torch.ones(1, 1)).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        loader = own_samplers.loader(self.kind, os.path.join(OUT, "own-shards"), num_workers=1)
        self.record["given"] = id(loader)
        return loader


def own_sampler_runs(runs: dict[str, Any], phase: str) -> None:
    """Per own sampler, as resume_runs: full (2 epochs), first (stopped after step 3, a
    checkpoint saved there) or second (resumed from it)."""
    for kind in own_samplers.KINDS:
        record: dict[str, Any] = {}
        folder = os.path.join(OUT, f"checkpoints-own-{kind}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if phase == "full":
                trainer().fit(OwnSampler(kind, record))
            elif phase == "first":
                saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1)
                trainer(max_steps=3, enable_checkpointing=True, callbacks=[saver]).fit(OwnSampler(kind, record))
            else:
                (path,) = glob.glob(os.path.join(folder, "*.ckpt"))
                trainer().fit(OwnSampler(kind, record), ckpt_path=path)
        record["unsharded"] = unsharded(caught)
        runs[f"own-{kind}-{phase}"] = record


def dump(rank: int, runs: dict[str, Any]) -> None:
    runs["rank"] = rank
    runs["stoker_imported"] = "stoker" in sys.modules
    path = os.path.join(OUT, f"{CASE}-{FLAVOUR}-{rank}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(runs, out)
    os.replace(path + ".tmp", path)


def main() -> None:
    runs: dict[str, Any] = {}
    if CASE == "ddp":
        rank = fit_case(runs)
        datamodule_case(runs)
        no_sampler_case(runs)
        fabric_case(runs)
        resume_runs(runs, "full")
        resume_runs(runs, "first")
        if FLAVOUR == "stoker":
            auto_case(runs)
            own_sampler_runs(runs, "full")
            own_sampler_runs(runs, "first")
    elif CASE == "resume":
        rank = resume_runs(runs, "second")
        if FLAVOUR == "stoker":
            own_sampler_runs(runs, "second")
    else:
        raise SystemExit(f"unknown case {CASE!r}")
    dump(rank, runs)
    torch.distributed.barrier()  # both ranks have written
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
