"""One rank of a user's Hugging Face Trainer script whose Accelerator has
`use_stateful_dataloader=True`, run by test_saved_trainer.py under
`python -m torch.distributed.run --nproc_per_node 2` (CPU, gloo, nothing downloaded):

    saved_trainer_main.py OUT PHASE

For each FLAVOUR: "torchdata", the Trainer as it comes (accelerate builds torchdata's
StatefulDataLoader: the control), and "stoker", the same Trainer with
`stoker.torch.adopt(trainer)`. Each rank writes OUT/PHASE-RANK.json with, per flavour and run,
the sample ids the model's forward saw at every step and the loaders that made them.

PHASE "first": an uninterrupted run (2 epochs of 8 steps a rank), then the same run with a
checkpoint at step STOP (save_steps) that goes on one more step and stops. PHASE "second" (a new
process group): each flavour resumes from its checkpoint (`resume_from_checkpoint`) to the end.

The setting: `TrainingArguments(accelerator_config={"use_stateful_dataloader": True})` where
this transformers takes it; transformers 5's `AcceleratorConfig` has no such field (the pull
request that adds it, huggingface/transformers#34205, is not merged) and refuses it with a
TypeError, so the Trainer then gets it the way users patch it in: its Accelerator's
`DataLoaderConfiguration`, set in `_build_accelerator_args`. Each record says which way.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import transformers.trainer
from transformers import Trainer, TrainerCallback, TrainingArguments

import stoker.torch

OUT, PHASE = sys.argv[1], sys.argv[2]
if os.environ.get("STACKS_AFTER_S"):  # a hung rank shows where it waits, then exits
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["STACKS_AFTER_S"]), exit=True)

N = 64
STOP = 3
FLAVOURS = ("torchdata", "stoker")
record: dict[str, Any] = {"steps": [], "kinds": set()}


class Indexed(torch.utils.data.Dataset):
    """The user's dataset: torch's, in both flavours."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.tensor([float(i)]), "labels": torch.tensor([1.0]), "idx": i}


class Tiny(torch.nn.Module):
    """A model whose forward(**batch) returns a loss, and notes which samples it got."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def forward(self, x: Any, labels: Any, idx: Any) -> dict[str, Any]:
        record["steps"].append(idx.tolist())
        return {"loss": ((self.layer(x) - labels) ** 2).mean()}


def kind(loader: Any) -> str:
    base = vars(loader).get("base_dataloader", loader) if hasattr(loader, "__dict__") else loader
    return f"{type(base).__module__}.{type(base).__qualname__}"


class Watch(TrainerCallback):
    """Notes the loader the Trainer iterates; stops a run `stop_after` steps in."""

    def __init__(self, stop_after: int | None) -> None:
        self.stop_after = stop_after

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        record["kinds"].add(kind(kwargs["train_dataloader"]))
        if state.global_step == self.stop_after:
            control.should_training_stop = True
        return control


# the Trainer resumes mid-epoch through accelerate's skip_first_batches: note what it gives back
skip = transformers.trainer.skip_first_batches


def noting_skip(dataloader: Any, num_batches: int = 0) -> Any:
    skipped = skip(dataloader, num_batches)
    record["kinds"].add("skipped " + kind(skipped))
    return skipped


transformers.trainer.skip_first_batches = noting_skip  # type: ignore[attr-defined]


class StatefulTrainer(Trainer):
    """The Trainer, its Accelerator given `use_stateful_dataloader=True` where its
    TrainingArguments cannot carry it."""

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["dataloader_config"].use_stateful_dataloader = True
        return args


def arguments(output_dir: str, **kwargs: Any) -> tuple[TrainingArguments, str]:
    """The run's TrainingArguments, and which way the stateful setting goes."""
    common: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_train_epochs=2,
        use_cpu=True,
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=2,
        seed=3,
        logging_strategy="no",
        disable_tqdm=True,
        **kwargs,
    )
    try:
        return TrainingArguments(**common, accelerator_config={"use_stateful_dataloader": True}), "accelerator_config"
    except TypeError as exc:
        if "use_stateful_dataloader" not in str(exc):
            raise
        return TrainingArguments(**common), "dataloader_config"


def train(flavour: str, name: str, stop_after: int | None = None, resume: str | None = None) -> dict[str, Any]:
    record.update(steps=[], kinds=set())
    save = {"save_strategy": "steps", "save_steps": STOP} if stop_after else {"save_strategy": "no"}
    args, setting = arguments(os.path.join(OUT, f"{flavour}-{name}"), **save)
    trainer_class = Trainer if setting == "accelerator_config" else StatefulTrainer
    trainer = trainer_class(model=Tiny(), args=args, train_dataset=Indexed(), callbacks=[Watch(stop_after)])
    if flavour == "stoker":
        stoker.torch.adopt(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return {
        "steps": record["steps"],
        "kinds": sorted(record["kinds"]),
        "rank": args.process_index,
        "setting": setting,
        "stateful": trainer.accelerator.dataloader_config.use_stateful_dataloader,
    }


def main() -> None:
    runs: dict[str, Any] = {}
    for flavour in FLAVOURS:
        if PHASE == "first":
            runs[f"{flavour}-full"] = train(flavour, "full")
            runs[f"{flavour}-stopped"] = train(flavour, "stopped", stop_after=STOP + 1)
        else:
            checkpoint = os.path.join(OUT, f"{flavour}-stopped", f"checkpoint-{STOP}")
            runs[f"{flavour}-resumed"] = train(flavour, "resumed", resume=checkpoint)
    rank = runs[next(iter(runs))]["rank"]
    with open(os.path.join(OUT, f"{PHASE}-{rank}.json"), "w") as out:
        json.dump(runs, out)
    # the Trainer leaves its process group to the interpreter's exit, where a gloo thread can
    # abort the rank (see transformers_main.py): end it first
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
