"""Ranks of a user's accelerate script with `DataLoaderConfiguration(use_stateful_dataloader=True)`,
for test_saved_accelerate.py:

    saved_accelerate_main.py world MODE OUT    starts 2 ranks of MODE (saved_ranks.launch)
    saved_accelerate_main.py MODE OUT          one rank

Each rank prepares, after `set_seed`, in the same order in every mode, LOADERS: a torch
DataLoader (accelerate builds torchdata's StatefulDataLoader: the control) and a
stoker.torch DataLoader, each over a shuffled map-style dataset and over an iterable that
splits itself over the workers and keeps no state (accelerate's IterableDatasetShard splits it
over the ranks), 2 workers each. Two settings besides `use_stateful_dataloader=True`:
`use_seedable_sampler=True` (the Trainer's default), so that an epoch's order is a function of
the seed and the epoch (with torch's RandomSampler it is drawn from a generator that
torchdata's `state_dict()` at `prepare` has already drawn from, and torchdata's own resume
then continues another order); and `dispatch_batches=False`, so that each rank reads its own
share of the iterable: `save_state` writes one file per loader, not per rank (every rank's
state must be the same), and with dispatching only the main rank's loader reads.
Modes, each writing OUT/MODE-RANK.json:

- full: 2 epochs of every loader, uninterrupted.
- train: STOP batches of every loader, `accelerator.save_state(OUT/state)`, AFTER more
  batches of each (their workers busy mid-epoch), then SIGKILL.
- resume: first accelerate's `skip_first_batches(loader, STOP)` of every prepared loader (the
  map loaders' generators put back where they were), then `accelerator.load_state(OUT/state)`
  and every loader to the end of the second epoch.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import saved_ranks  # beside this script
import torch.utils.data as tud
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed

import stoker.torch as st

N = 48  # 24 a rank: 6 batches of 4 an epoch
BATCH = 4
WORKERS = 2
EPOCHS = 2
STOP = 2
AFTER = 2
SEED = 11
FLAVOURS = ("torchdata", "stoker")
KINDS = ("map", "stream")
LOADERS = [f"{kind}-{flavour}" for flavour in FLAVOURS for kind in KINDS]


def _worker() -> tuple[int, int]:
    info = tud.get_worker_info() or st.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class Items(tud.Dataset):
    """Map-style: item i is i."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


class Stream(tud.IterableDataset):
    """A generator with no state: worker w of n yields w, w + n, ..."""

    def __iter__(self) -> Any:
        first, step = _worker()
        yield from range(first, N, step)


def given(name: str) -> Any:
    """The loader the user writes: torch's (the control) or stoker.torch's."""
    kind, flavour = name.split("-")
    cls = st.DataLoader if flavour == "stoker" else tud.DataLoader
    if kind == "map":
        return cls(Items(), batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    return cls(Stream(), batch_size=BATCH, num_workers=WORKERS)


def kind_of(loader: Any) -> str:
    base = type(vars(loader).get("base_dataloader", loader))
    return f"{base.__module__}.{base.__qualname__}"


def steps(batches: Any) -> list[list[int]]:
    return [[int(i) for i in batch] for batch in batches]


def rank_main(mode: str, out: Path) -> None:
    config = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True, dispatch_batches=False)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    rank = accelerator.process_index
    set_seed(SEED)  # the seedable sampler's seed: torch's initial seed
    users = {name: given(name) for name in LOADERS}
    prepared = dict(zip(LOADERS, accelerator.prepare(*users.values())))
    record: dict[str, Any] = {"kinds": {name: kind_of(loader) for name, loader in prepared.items()}}
    state = str(out / "state")
    if mode == "full":
        for name, loader in prepared.items():
            record[name] = [steps(loader) for _ in range(EPOCHS)]
    elif mode == "train":
        iterators = {name: iter(loader) for name, loader in prepared.items()}
        for name, iterator in iterators.items():
            record[name] = {"head": steps(next(iterator) for _ in range(STOP))}
        accelerator.save_state(state)
        for name, iterator in iterators.items():  # on past the checkpoint: what the kill throws away
            record[name]["after"] = steps(next(iterator) for _ in range(AFTER))
        saved_ranks.write(out / f"{mode}-{rank}.json", record)
        accelerator.wait_for_everyone()  # both ranks past the checkpoint, mid-epoch
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "resume":
        # accelerate's way without a loader state: skip the batches trained on (the seedable
        # sampler draws epoch 0's order again, whatever was drawn before)
        record["skipped"], record["skipped_kinds"] = {}, {}
        for name, loader in prepared.items():
            skipped = accelerator.skip_first_batches(loader, STOP)
            record["skipped"][name] = steps(skipped)
            record["skipped_kinds"][name] = kind_of(skipped)
        # with use_stateful_dataloader=True, accelerate's docs: load_state, no skipping
        accelerator.load_state(state)
        for name, loader in prepared.items():
            record[name] = [steps(loader) for _ in range(EPOCHS)]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    saved_ranks.write(out / f"{mode}-{rank}.json", record)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    saved_ranks.main(__file__, rank_main)
