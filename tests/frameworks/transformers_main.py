"""One rank of a user's Hugging Face Trainer script, run by test_transformers.py under
`python -m torch.distributed.run --nproc_per_node 2` (CPU, gloo, nothing downloaded):

    transformers_main.py FLAVOUR OUT PHASE

FLAVOUR "torch": the Trainer as it comes (its own torch DataLoader); "stoker": the same script
with `stoker.torch.adopt(trainer)`, the documented line. Each rank writes
OUT/FLAVOUR-PHASE-RANK.json with the sample indices of every training step, whether a stoker
worker made them, and which loader the Trainer iterated.

PHASE "first": an uninterrupted run (2 epochs of 8 steps a rank), then the same run stopped after
its step 3 with a checkpoint there (save_steps=3). PHASE "second" (a new process group): resume
from that checkpoint (resume_from_checkpoint) to the end.

With stoker, each phase does the same for stoker's own samplers of a rank's share
(own_samplers.py: ShardedSampler over the shards the test wrote to OUT/own-shards, StreamSampler
over packed rows), given to the adopted Trainer by overriding its `_get_train_sampler`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from typing import Any

import torch

FLAVOUR, OUT, PHASE = sys.argv[1], sys.argv[2], sys.argv[3]
if os.environ.get("STACKS_AFTER_S"):  # a hung rank shows where it waits, then exits
    faulthandler.dump_traceback_later(float(os.environ["STACKS_AFTER_S"]), exit=True)

if FLAVOUR == "stoker":
    import own_samplers  # beside this script

    import stoker.torch

import transformers.trainer  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

N = 64
STOP_AT = 3
record: dict[str, Any] = {"steps": [], "by_stoker": set(), "kinds": set()}


class Indexed(torch.utils.data.Dataset):  # the user's dataset: torch's, in both flavours
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        stoker_torch = sys.modules.get("stoker.torch")
        by_stoker = stoker_torch is not None and stoker_torch.get_worker_info() is not None
        return {"x": torch.tensor([float(i)]), "labels": torch.tensor([1.0]), "idx": i, "by_stoker": by_stoker}


class Tiny(torch.nn.Module):
    """A model whose forward(**batch) returns a loss, and notes which samples it got."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def forward(self, x: Any, labels: Any, idx: Any, by_stoker: Any) -> dict[str, Any]:
        record["steps"].append(idx.tolist())
        record["by_stoker"].update(by_stoker.tolist())
        return {"loss": ((self.layer(x) - labels) ** 2).mean()}


def kind(loader: Any) -> str:
    base = vars(loader).get("base_dataloader", loader) if hasattr(loader, "__dict__") else loader
    return f"{type(base).__module__}.{type(base).__qualname__}"


class Watch(TrainerCallback):
    """Notes the loader the Trainer prepared; stops the "stopped" run after STOP_AT steps."""

    def __init__(self, stop: bool) -> None:
        self.stop = stop

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        record["kinds"].add(kind(kwargs["train_dataloader"]))
        if self.stop and state.global_step == STOP_AT:
            control.should_training_stop = True
        return control


# the Trainer resumes mid-epoch through accelerate's skip_first_batches: note what it gives back
skip = transformers.trainer.skip_first_batches


def noting_skip(dataloader: Any, num_batches: int = 0) -> Any:
    skipped = skip(dataloader, num_batches)
    record["kinds"].add("skipped " + kind(skipped))
    return skipped


transformers.trainer.skip_first_batches = noting_skip  # type: ignore[attr-defined]


def train(name: str, stop: bool = False, resume: str | None = None) -> dict[str, Any]:
    record.update(steps=[], by_stoker=set(), kinds=set())
    args = TrainingArguments(
        output_dir=os.path.join(OUT, f"{FLAVOUR}-{name}"),
        per_device_train_batch_size=4,
        num_train_epochs=2,
        use_cpu=True,
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=2,
        seed=3,
        save_strategy="steps" if stop else "no",
        save_steps=STOP_AT,
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Indexed(), callbacks=[Watch(stop)])
    if FLAVOUR == "stoker":
        stoker.torch.adopt(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return {
        "steps": record["steps"],
        "by_stoker": sorted(record["by_stoker"]),
        "kinds": sorted(record["kinds"]),
        "rank": args.process_index,
    }


class OwnModel(torch.nn.Module):
    """Notes the identities of each batch it gets (a dict: the Trainer calls forward(**batch))."""

    def __init__(self, sampler: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.sampler = sampler

    def forward(self, **batch: Any) -> dict[str, Any]:
        record["steps"].append(own_samplers.identities(self.sampler, batch))
        return {"loss": (self.layer(torch.ones(1, 1)) ** 2).mean()}


class OwnSamplerTrainer(Trainer):
    """The Trainer builds its own sampler; a user's own is given where it does."""

    own: str

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return own_samplers.sampler(self.own, self.train_dataset if train_dataset is None else train_dataset)


def own_train(sampler: str, name: str, stop: bool = False, resume: str | None = None) -> dict[str, Any]:
    record.update(steps=[], by_stoker=set(), kinds=set())
    args = TrainingArguments(
        output_dir=os.path.join(OUT, f"own-{sampler}-{name}"),
        per_device_train_batch_size=own_samplers.BATCH,
        num_train_epochs=2,
        use_cpu=True,
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=2,
        seed=3,
        save_strategy="steps" if stop else "no",
        save_steps=STOP_AT,
        logging_strategy="no",
        disable_tqdm=True,
    )
    data = own_samplers.dataset(sampler, os.path.join(OUT, "own-shards"))
    collate = own_samplers.collate(sampler)
    trainer = OwnSamplerTrainer(
        model=OwnModel(sampler),
        args=args,
        train_dataset=data,
        callbacks=[Watch(stop)],
        **({} if collate is None else {"data_collator": collate}),
    )
    trainer.own = sampler
    stoker.torch.adopt(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return {"steps": record["steps"], "kinds": sorted(record["kinds"])}


def main() -> None:
    if PHASE == "first":
        runs = {"full": train("full"), "stopped": train("stopped", stop=True)}
        if FLAVOUR == "stoker":
            for sampler in own_samplers.KINDS:
                runs[f"own-{sampler}-full"] = own_train(sampler, "full")
                runs[f"own-{sampler}-stopped"] = own_train(sampler, "stopped", stop=True)
    else:
        runs = {"resumed": train("resumed", resume=os.path.join(OUT, f"{FLAVOUR}-stopped", f"checkpoint-{STOP_AT}"))}
        if FLAVOUR == "stoker":
            for sampler in own_samplers.KINDS:
                checkpoint = os.path.join(OUT, f"own-{sampler}-stopped", f"checkpoint-{STOP_AT}")
                runs[f"own-{sampler}-resumed"] = own_train(sampler, "resumed", resume=checkpoint)
    rank = runs[next(iter(runs))]["rank"]
    with open(os.path.join(OUT, f"{FLAVOUR}-{PHASE}-{rank}.json"), "w") as out:
        json.dump(runs, out)
    # the Trainer leaves its process group to the interpreter's exit, where a gloo thread still
    # freeing the last all_gather's tensors can need the GIL as Python finalizes and abort the
    # rank (std::terminate in ProcessGroupGloo::runLoop, about 1 run in 20): end it first
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
