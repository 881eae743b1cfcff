"""Real training frameworks over stoker.torch or torch.utils.data, as a new user would run them:
`python run_frameworks.py CASE FLAVOUR OUTDIR [PHASE]`. Each rank writes OUTDIR/CASE-FLAVOUR[-PHASE]-RANK.json
with what it trained, validated and predicted on, and which loader class did the work.

FLAVOUR "torch" imports DataLoader, Dataset and IterableDataset from torch.utils.data, "stoker"
from stoker.torch: the only difference between the two runs. Lightning's ddp strategy starts the
second rank itself by running this script again; accelerate's and the Trainer's cases run under
torch.distributed.run (see test_frameworks.py).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch

CASE, FLAVOUR, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
PHASE = sys.argv[4] if len(sys.argv) > 4 else ""
N = 64

if FLAVOUR == "stoker":
    import stoker.torch as data
else:
    import torch.utils.data as data

DataLoader, Dataset, IterableDataset = data.DataLoader, data.Dataset, data.IterableDataset


class Numbers(Dataset):  # type: ignore[misc,valid-type]
    """Sample i is (tensor([i.]), i)."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(i)]), i


class Stream(IterableDataset):  # type: ignore[misc,valid-type]
    """0..n-1, split across loader workers with torch's get_worker_info (not across ranks)."""

    def __init__(self, n: int = 16) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return ((torch.tensor([float(i)]), i) for i in range(first, self.n, step))


def kind(loader: Any) -> str:
    return f"{type(loader).__module__}.{type(loader).__qualname__}"


def dump(rank: int, record: dict[str, Any]) -> None:
    name = "-".join(part for part in (CASE, FLAVOUR, PHASE, str(rank)) if part)
    with open(os.path.join(OUT, name + ".json"), "w") as out:
        json.dump(record, out)


# ------------------------------------------------------------------- Lightning
def lightning_cases() -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import BasePredictionWriter

    record: dict[str, Any] = {"train": [], "val": [], "validate": [], "predict": [], "writer": [], "kinds": {}}

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, index: int) -> Any:
            x, i = batch
            record["train"].append([self.current_epoch, i.tolist()])
            record["kinds"]["train"] = kind(self.trainer.train_dataloader)
            return self.layer(x).sum()

        def validation_step(self, batch: Any, index: int) -> None:
            stage = "validate" if self.trainer.state.fn == "validate" else "val"
            record[stage].append(batch[1].tolist())

        def predict_step(self, batch: Any, index: int) -> Any:
            record["predict"].append(batch[1].tolist())
            return batch[1]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Writer(BasePredictionWriter):
        def write_on_batch_end(self, trainer: Any, module: Any, prediction: Any, batch_indices: Any,
                               batch: Any, batch_index: int, dataloader_index: int) -> None:
            record["writer"].append([list(batch_indices or []), prediction.tolist()])

    class Module(Model):
        def train_dataloader(self) -> Any:
            return DataLoader(Numbers(), batch_size=8, shuffle=True, num_workers=2)

        def val_dataloader(self) -> Any:
            return DataLoader(Numbers(), batch_size=8, num_workers=2)

        def predict_dataloader(self) -> Any:
            return DataLoader(Numbers(), batch_size=8)

    class Numbers64(pl.LightningDataModule):
        def train_dataloader(self) -> Any:
            return DataLoader(Numbers(), batch_size=8, shuffle=True, num_workers=2)

        def val_dataloader(self) -> Any:
            return DataLoader(Stream(), batch_size=4, num_workers=2)  # a stream: left alone

    def trainer(**extra: Any) -> Any:
        settings = dict(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
        settings.update(extra)
        return pl.Trainer(**settings)

    if CASE == "lightning-fit":
        run = trainer(callbacks=[Writer(write_interval="batch")])
        model = Module()
        run.fit(model)
        run.validate(model)
        run.predict(model, return_predictions=False)
    elif CASE == "lightning-datamodule":
        run = trainer()
        run.fit(Model(), datamodule=Numbers64())
    elif CASE == "lightning-no-sampler":
        run = trainer(use_distributed_sampler=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run.fit(Module())
        record["unsharded_warnings"] = sum("does not split the dataset by rank" in str(w.message) for w in caught)
    elif CASE == "lightning-resume":
        class Stop(pl.Callback):
            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, index: int) -> None:
                if PHASE == "first" and trainer.global_step == 3:
                    trainer.save_checkpoint(os.path.join(OUT, f"mid-{FLAVOUR}.ckpt"))
                    raise SystemExit(0)  # stop mid-epoch, as a preemption would

        pl.seed_everything(5)

        class Resumed(Module):
            def train_dataloader(self) -> Any:
                return DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2)

        run = trainer(max_epochs=2, callbacks=[Stop()], limit_val_batches=0)
        checkpoint = os.path.join(OUT, f"mid-{FLAVOUR}.ckpt") if PHASE == "second" else None
        try:
            run.fit(Resumed(), ckpt_path=checkpoint)
        except SystemExit:
            pass
    elif CASE == "lightning-order":  # one process: the order seed_everything gives
        pl.seed_everything(7)
        run = trainer(devices=1, strategy="auto", max_epochs=2, limit_val_batches=0)
        run.fit(Module())
    else:
        raise SystemExit(f"unknown case {CASE}")
    dump(run.global_rank, record)


def fabric_case() -> None:
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    loader = fabric.setup_dataloaders(DataLoader(Numbers(), batch_size=8, shuffle=True, num_workers=2))
    seen = [int(i) for _, batch in loader for i in batch]
    dump(fabric.global_rank, {"train": seen, "kind": kind(getattr(loader, "_dataloader", loader))})


# ------------------------------------------------------------------ accelerate
def accelerate_case() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    rank = accelerator.process_index
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train = DataLoader(Numbers(144), batch_size=8, shuffle=True, num_workers=2)  # 9 batches a rank
    evaluate = DataLoader(Numbers(17), batch_size=4)
    model, optimizer, train, evaluate = accelerator.prepare(model, optimizer, train, evaluate)
    record: dict[str, Any] = {"epochs": [], "syncs": [], "steps": [], "devices": set()}
    steps = 0

    def step_counter(*args: Any, **kwargs: Any) -> None:
        nonlocal steps
        steps += 1

    optimizer.optimizer.register_step_post_hook(step_counter)
    for _ in range(2):
        seen, syncs, before = [], [], steps
        for x, i in train:
            record["devices"].add(str(x.device))
            with accelerator.accumulate(model):
                loss = model(x).sum()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            seen += i.tolist()
            syncs.append(bool(accelerator.sync_gradients))
        record["epochs"].append(seen)
        record["syncs"].append(syncs)
        record["steps"].append(steps - before)
    gathered = []
    for _, i in evaluate:
        gathered += accelerator.gather_for_metrics(i).tolist()
    record["gathered"] = gathered
    skipped = accelerator.skip_first_batches(train, 2)
    record["skipped"] = [j for _, batch in skipped for j in batch.tolist()]
    record["kinds"] = {
        "train": kind(train.base_dataloader),
        "evaluate": kind(evaluate.base_dataloader),
        "skipped": kind(getattr(skipped, "base_dataloader", skipped)),
    }
    record["devices"] = sorted(record["devices"])
    record["device"] = str(accelerator.device)
    dump(rank, record)


def accelerate_resume_case() -> None:
    """full: two epochs; first: 3 batches, then the loader's state to a file; second: a new
    process group loads it and runs to the end of the second epoch."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(11)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    loader = accelerator.prepare(DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2))
    state_file = os.path.join(OUT, f"accelerate-state-{FLAVOUR}-{rank}.json")
    batches: list[list[int]] = []
    if PHASE == "second":
        with open(state_file) as saved:
            loader.load_state_dict(json.load(saved))
    for epoch in range(2):
        if PHASE == "second" and epoch == 0:
            loader.set_epoch(0)
        for number, (_, i) in enumerate(loader):
            batches.append(i.tolist())
            if PHASE == "first" and number == 2:
                with open(state_file, "w") as out:
                    json.dump(loader.state_dict(), out)
                dump(rank, {"batches": batches, "kind": kind(loader.base_dataloader)})
                return
    dump(rank, {"batches": batches, "kind": kind(loader.base_dataloader)})


# ---------------------------------------------------------- the Hugging Face Trainer
def trainer_case() -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import stoker.torch

    class Indexed(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"x": torch.tensor([float(i)]), "labels": torch.tensor([1.0]), "idx": i}

    seen: list[list[int]] = []

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def forward(self, x: Any, labels: Any, idx: Any) -> dict[str, Any]:
            seen.append(idx.tolist())
            return {"loss": ((self.layer(x) - labels) ** 2).mean()}

    class StopAt(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if PHASE == "first" and state.global_step == 3:
                control.should_training_stop = True
            return control

    args = TrainingArguments(
        output_dir=os.path.join(OUT, f"trainer-{FLAVOUR}"), per_device_train_batch_size=4, num_train_epochs=2,
        use_cpu=True, report_to=[], remove_unused_columns=False, dataloader_num_workers=2,
        save_strategy="steps", save_steps=3, logging_strategy="no", disable_tqdm=True, seed=3,
    )
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Indexed(), callbacks=[StopAt()])
    if FLAVOUR == "stoker":
        stoker.torch.adopt(trainer)
    checkpoint = os.path.join(args.output_dir, "checkpoint-3") if PHASE == "second" else None
    trainer.train(resume_from_checkpoint=checkpoint)
    loader = trainer.get_train_dataloader()
    dump(args.process_index, {"batches": seen, "kind": kind(getattr(loader, "base_dataloader", loader))})


def _leave_the_process_group() -> None:
    """Destroy the process group before exit: otherwise gloo's threads may still be tearing
    down work objects while Python finalises, and about one exit in twenty aborts (SIGABRT,
    "terminate called without an active exception"), whatever the loader."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    if CASE.startswith("lightning"):
        lightning_cases()
    elif CASE == "fabric":
        fabric_case()
    elif CASE == "accelerate":
        accelerate_case()
        _leave_the_process_group()
    elif CASE == "accelerate-resume":
        accelerate_resume_case()
        _leave_the_process_group()
    elif CASE == "trainer":
        trainer_case()
        _leave_the_process_group()
    else:
        raise SystemExit(f"unknown case {CASE}")
