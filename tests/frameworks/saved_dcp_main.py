"""Ranks of a torchtitan-style training script for test_saved_dcp.py: a data loader that is also
`torch.distributed.checkpoint`'s `Stateful` and stores this data-parallel rank's state under its
own key (torchtitan's ParallelAwareDataloader does so; this one is written for the test), saved
and loaded with `torch.distributed.checkpoint` (DCP) on gloo ranks.

    saved_dcp_main.py world MODE OUT    starts 2 ranks of MODE (saved_ranks.launch)
    saved_dcp_main.py MODE OUT          one rank

Every rank runs LOADERS: torchdata's StatefulDataLoader and stoker.torch's, each over a
map-style dataset with torch's `DistributedSampler` (shuffled, seeded: the same order for both)
and over an iterable dataset that shards itself by rank and worker and keeps its position
(Stateful), 2 workers each. Modes, each writing OUT/MODE-RANK.json with the items of every step:

- train: 2 epochs of every loader, uninterrupted (loaders of their own); then STOP steps of
  new loaders, one `dcp.save` of all of them (and the epoch) to OUT/checkpoint, AFTER more
  steps of each (their workers busy mid-epoch), and SIGKILL.
- resume: new loaders, `dcp.load` from OUT/checkpoint, then to the end of the second epoch.

The test names the loader classes it checks in LIBRARIES (a comma-separated environment
variable; both by default).
"""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path
from typing import Any

import saved_ranks  # beside this script
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils.data as tud
from torch.distributed.checkpoint.stateful import Stateful

N = 24  # items: 12 a rank, 6 batches of 2 an epoch
BATCH = 2
WORKERS = 2
EPOCHS = 2
STOP = 2  # steps before the checkpoint
AFTER = 2  # steps after it, before the kill
SEED = 3
KINDS = ("map", "stream")


def _worker() -> tuple[int, int]:
    info = tud.get_worker_info()
    if info is None:
        import stoker.torch

        info = stoker.torch.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class Items(tud.Dataset):
    """Map-style: item i is i."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


class RankStream(tud.IterableDataset):
    """Shards itself: rank r's replica in worker w takes the items i with
    i % (world * workers) == r * workers + w, in order, and keeps its position."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.position = 0
        self.taken: dict[int, int] = {}  # items taken, by i % 3: int keys, to come back as ints

    def __iter__(self) -> Any:
        worker, workers = _worker()
        mine = list(range(self.rank * workers + worker, N, self.world * workers))
        while self.position < len(mine):
            item = mine[self.position]
            self.position += 1
            self.taken[item % 3] = self.taken.get(item % 3, 0) + 1
            yield item
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "taken": dict(self.taken)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not all(type(key) is int for key in state["taken"]):
            raise TypeError(f"the stream's int keys came back as {[type(k).__name__ for k in state['taken']]}")
        self.position = state["position"]
        self.taken = dict(state["taken"])


def data_parallel(base: type) -> type:
    """`base` (a loader class) made DCP's Stateful, keeping this rank's state under its own key."""

    class DataParallelLoader(base, Stateful):  # type: ignore[misc,valid-type]
        def __init__(self, dataset: Any, *, dp_rank: int, dp_world_size: int, **kwargs: Any) -> None:
            super().__init__(dataset, **kwargs)
            self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
            self.rank_key = f"dp_rank_{dp_rank}"

        def state_dict(self) -> dict[str, Any]:
            # each rank writes only its own key; pickled, so that DCP stores it as one object
            return {self.rank_key: pickle.dumps(super().state_dict()), "world_size": self.dp_world_size}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            if not state:
                return
            if self.rank_key not in state:
                raise KeyError(f"no data loader state for {self.rank_key} in the checkpoint")
            if state["world_size"] != self.dp_world_size:
                raise ValueError(f"saved by {state['world_size']} data-parallel ranks, loaded by {self.dp_world_size}")
            super().load_state_dict(pickle.loads(state[self.rank_key]))

    DataParallelLoader.__qualname__ = f"DataParallel{base.__name__}"
    return DataParallelLoader


def loader_class(library: str) -> type:
    if library == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return data_parallel(StatefulDataLoader)
    import stoker.torch

    return data_parallel(stoker.torch.StatefulDataLoader)


def make(library: str, kind: str, rank: int, world: int) -> Any:
    """`library`'s loader (data-parallel) over `kind` for `rank` of `world`."""
    kwargs: dict[str, Any] = {"batch_size": BATCH, "num_workers": WORKERS, "dp_rank": rank, "dp_world_size": world}
    if kind == "map":
        dataset: Any = Items()
        kwargs["sampler"] = tud.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    else:
        dataset = RankStream(rank, world)
    return loader_class(library)(dataset, **kwargs)


def start_epoch(loader: Any, epoch: int) -> Any:
    if isinstance(loader.sampler, tud.DistributedSampler):
        loader.sampler.set_epoch(epoch)
    return iter(loader)


def steps(batches: Any) -> list[list[int]]:
    return [[int(i) for i in batch] for batch in batches]


def rank_main(mode: str, out: Path) -> None:
    libraries = os.environ.get("LIBRARIES", "torchdata,stoker").split(",")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [f"{kind}-{library}" for library in libraries for kind in KINDS]
    record: dict[str, Any] = {name: {} for name in names}
    if mode == "train":
        # the uninterrupted run first, loaders of its own: an order is a function of the
        # seed and the epoch, so the stopped loaders below read the same
        for name in names:
            full = make(*name.split("-")[::-1], rank, world)
            record[name]["full"] = [steps(start_epoch(full, epoch)) for epoch in range(EPOCHS)]
    loaders = {name: make(*name.split("-")[::-1], rank, world) for name in names}
    bases = {name: type(loader).__mro__[1] for name, loader in loaders.items()}
    record["bases"] = {name: f"{b.__module__}.{b.__qualname__}" for name, b in bases.items()}
    if mode == "train":
        iterators = {name: start_epoch(loaders[name], 0) for name in names}
        for name in names:
            record[name]["head"] = [steps([next(iterators[name])])[0] for _ in range(STOP)]
        # DCP calls state_dict() / load_state_dict() of the Stateful values at the top level
        dcp.save({**loaders, "progress": {"epoch": 0}}, checkpoint_id=str(out / "checkpoint"))
        for name in names:  # on past the checkpoint: what the kill throws away
            record[name]["after"] = [steps([next(iterators[name])])[0] for _ in range(AFTER)]
        saved_ranks.write(out / f"{mode}-{rank}.json", record)
        dist.barrier()  # both ranks past the checkpoint, mid-epoch, workers busy
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "resume":
        progress: dict[str, Any] = {"epoch": -1}
        dcp.load({**loaders, "progress": progress}, checkpoint_id=str(out / "checkpoint"))
        for name in names:
            epochs = range(progress["epoch"], EPOCHS)
            record[name]["resumed"] = [steps(start_epoch(loaders[name], epoch)) for epoch in epochs]
        record["epoch"] = progress["epoch"]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    saved_ranks.write(out / f"{mode}-{rank}.json", record)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    saved_ranks.main(__file__, rank_main)
