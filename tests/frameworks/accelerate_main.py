"""One rank of a user's accelerate script, run by test_accelerate.py under
`python -m torch.distributed.run --nproc_per_node 2` (CPU, gloo):

    accelerate_main.py FLAVOUR OUT PHASE

FLAVOUR "torch" imports DataLoader and Dataset from torch.utils.data, "stoker" from stoker.torch:
the only difference between the two runs. Each rank writes OUT/FLAVOUR-PHASE-RANK.json.

With stoker, each phase also runs stoker's own samplers of a rank's share (own_samplers.py:
ShardedSampler over the shards the test wrote to OUT/own-shards, StreamSampler over packed
rows), each in a stoker loader given to `prepare`: "first" iterates 2 epochs (gathering the
sharded one's identities in the first), skip_first_batches into a third, stops a resumable one
after 3 batches (its state_dict() to a file, and save_state of an Accelerator of its own), and
prepares them under split_batches and dispatch_batches to catch stoker's warnings; "second"
resumes the stopped ones with load_state and with load_state_dict.

PHASE "first": a shuffled 64-sample loader (2 epochs, then a third for skip_first_batches), a
144-sample one under gradient accumulation 2 (9 batches a rank), gather_for_metrics over 17
samples, and a resumable loader stopped after 3 batches: its state_dict() to a file and
accelerator.save_state; with stoker, a loader asking for `num_workers="auto"` (and persistent
workers), prepared and iterated. PHASE "second" (a new process group): the same loaders prepared in the
same order, accelerator.load_state; then the resumable loader uninterrupted, resumed by
skip_first_batches and (stoker) by load_state_dict.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import warnings
from typing import Any

import torch

FLAVOUR, OUT, PHASE = sys.argv[1], sys.argv[2], sys.argv[3]
if os.environ.get("STACKS_AFTER_S"):  # a hung rank shows where it waits, then exits
    faulthandler.dump_traceback_later(float(os.environ["STACKS_AFTER_S"]), exit=True)

if FLAVOUR == "stoker":
    import stoker.torch as data
else:
    import torch.utils.data as data

from accelerate import Accelerator  # noqa: E402  (after the import that is the difference)
from accelerate.utils import set_seed  # noqa: E402

DataLoader, Dataset = data.DataLoader, data.Dataset
if FLAVOUR == "stoker":
    import own_samplers  # beside this script
RESUME_SEED = 11
STOP_AFTER = 3  # batches of the resumable loader before the "first" phase stops


class Numbers(Dataset):  # type: ignore[misc,valid-type]
    """Sample i is (tensor([i.]), i, whether a stoker worker made it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, bool]:
        stoker_torch = sys.modules.get("stoker.torch")  # imported by the stoker flavour only
        by_stoker = stoker_torch is not None and stoker_torch.get_worker_info() is not None
        return torch.tensor([float(i)]), i, by_stoker


def kind(loader: Any) -> str:
    return f"{type(loader).__module__}.{type(loader).__qualname__}"


def indices(batches: Any) -> list[list[int]]:
    return [batch[1].tolist() for batch in batches]


def resumable(accelerator: Any) -> Any:
    set_seed(RESUME_SEED)  # accelerate seeds the sampler's generator from the global RNG
    return accelerator.prepare(DataLoader(Numbers(64), batch_size=4, shuffle=True, num_workers=2))


def own_loader(sampler: str) -> Any:
    return own_samplers.loader(sampler, os.path.join(OUT, "own-shards"), num_workers=2)


def own_ids(sampler: str, loader: Any) -> list[int]:
    return [i for batch in loader for i in own_samplers.identities(sampler, batch)]


def own_resumable(sampler: str) -> tuple[Any, Any]:
    """An Accelerator of its own (its save_state holds just these loaders), and sampler's loader
    prepared by it."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    return accelerator, accelerator.prepare(own_loader(sampler))


def own_samplers_first(accelerator: Any) -> dict[str, Any]:
    from accelerate import DataLoaderConfiguration

    out: dict[str, Any] = {}
    for sampler in own_samplers.KINDS:
        record: dict[str, Any] = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = accelerator.prepare(own_loader(sampler))
            record["len"] = len(loader)
            gathered: list[int] = []
            epochs = []
            for epoch in range(2):
                seen = []
                for batch in loader:
                    seen += own_samplers.identities(sampler, batch)
                    if sampler == "sharded" and epoch == 0:
                        gathered += accelerator.gather_for_metrics(batch["cls"]).tolist()
                epochs.append(seen)
            skipped = accelerator.skip_first_batches(loader, 2)  # into the third epoch
            record.update(
                epochs=epochs,
                gathered=gathered,
                skipped=own_ids(sampler, skipped),
                kinds=sorted({kind(loader.base_dataloader), kind(skipped.base_dataloader)}),
            )
            own, resumable = own_resumable(sampler)
            iterator = iter(resumable)
            record["head"] = [i for _ in range(STOP_AFTER) for i in own_samplers.identities(sampler, next(iterator))]
            with open(os.path.join(OUT, f"own-{sampler}-{accelerator.process_index}.json"), "w") as saved:
                json.dump(resumable.state_dict(), saved)
            own.save_state(os.path.join(OUT, f"own-state-{sampler}"))
            iterator.close()
        record["warnings"] = [str(w.message) for w in caught if "stoker" in str(w.message) or "share" in str(w.message)]
        warned = {}
        for setting in ("split_batches", "dispatch_batches"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                config = DataLoaderConfiguration(**{setting: True})
                Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=config).prepare(
                    own_loader(sampler)
                )
            warned[setting] = [str(w.message) for w in caught if "share" in str(w.message)]
        record["warned"] = warned
        out[sampler] = record
    return out


def own_samplers_second() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sampler in own_samplers.KINDS:
        own, loader = own_resumable(sampler)
        own.load_state(os.path.join(OUT, f"own-state-{sampler}"))
        record = {"after_load_state": own_ids(sampler, loader)}
        _, loader = own_resumable(sampler)
        with open(os.path.join(OUT, f"own-{sampler}-{own.process_index}.json")) as saved:
            loader.load_state_dict(json.load(saved))
        record["after_load_state_dict"] = own_ids(sampler, loader)
        out[sampler] = record
    return out


def main() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    rank = accelerator.process_index
    set_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    shard = DataLoader(Numbers(64), batch_size=8, shuffle=True, num_workers=2)  # 4 batches a rank
    accumulate = DataLoader(Numbers(144), batch_size=8, shuffle=True, num_workers=2)  # 9 a rank
    evaluate = DataLoader(Numbers(17), batch_size=4, num_workers=2)
    shuffler = shard.sampler
    generator_before = shuffler.generator is not None
    model, optimizer, shard, accumulate, evaluate = accelerator.prepare(model, optimizer, shard, accumulate, evaluate)
    state_dir = os.path.join(OUT, f"state-{FLAVOUR}")
    record: dict[str, Any] = {"rank": rank, "device": str(accelerator.device)}
    if PHASE == "first":
        record["sampler"] = {
            "generator_before": generator_before,
            "generator_after": isinstance(shuffler.generator, torch.Generator),
            "shard_wraps_it": shard.batch_sampler.batch_sampler.sampler is shuffler,
            "shard": type(shard.batch_sampler).__name__,
        }
        # each rank's shard, two epochs; where the batches are and who made them
        epochs, devices, made_by_stoker = [], set(), set()
        for _ in range(2):
            seen = []
            for x, i, by_stoker in shard:
                devices.add(str(x.device))
                made_by_stoker.update(by_stoker.tolist())
                seen += i.tolist()
            epochs.append(seen)
        record.update(epochs=epochs, devices=sorted(devices), made_by_stoker=sorted(made_by_stoker))

        # gradient accumulation: the optimizer steps every 2 batches and at each epoch's end
        steps = 0

        def count(*args: Any, **kwargs: Any) -> None:
            nonlocal steps
            steps += 1

        optimizer.optimizer.register_step_post_hook(count)
        syncs, stepped = [], []
        for _ in range(2):
            epoch_syncs, before = [], steps
            for x, _, _ in accumulate:
                with accelerator.accumulate(model):
                    accelerator.backward(model(x).sum())
                    optimizer.step()
                    optimizer.zero_grad()
                epoch_syncs.append(bool(accelerator.sync_gradients))
            syncs.append(epoch_syncs)
            stepped.append(steps - before)
        record.update(syncs=syncs, steps=stepped)

        # gather_for_metrics drops the samples accelerate repeated to even out the ranks
        gathered = []
        for _, i, _ in evaluate:
            gathered += accelerator.gather_for_metrics(i).tolist()
        record["gathered"] = gathered

        # skip_first_batches: the third epoch, then the same epoch without its first 2 batches
        generator = shard.batch_sampler.batch_sampler.sampler.generator
        start = generator.get_state()
        record["epoch3"] = [j for batch in indices(shard) for j in batch]
        generator.set_state(start)
        skipped = accelerator.skip_first_batches(shard, 2)
        record["skipped"] = [j for batch in indices(skipped) for j in batch]
        record["kinds"] = {
            "shard": kind(shard.base_dataloader),
            "accumulate": kind(accumulate.base_dataloader),
            "evaluate": kind(evaluate.base_dataloader),
            "skipped": kind(getattr(skipped, "base_dataloader", skipped)),
        }

        # stop a resumable loader after 3 batches, as a preempted run would
        loader = resumable(accelerator)
        iterator = iter(loader)
        record["head"] = [next(iterator)[1].tolist() for _ in range(STOP_AFTER)]
        if FLAVOUR == "stoker":
            with open(os.path.join(OUT, f"loader-{rank}.json"), "w") as saved:
                json.dump(loader.state_dict(), saved)
        accelerator.save_state(state_dir)
        record["resumable"] = kind(loader.base_dataloader)
        iterator.close()

        if FLAVOUR == "stoker":  # after save_state: "second" prepares the loaders above only
            # accelerate builds a torch DataLoader from the loader's attributes (torch's checks
            # compare num_workers as an int), then stoker's rebuild: still "auto"
            given = DataLoader(Numbers(64), batch_size=8, shuffle=True, num_workers="auto", persistent_workers=True)
            prepared = accelerator.prepare(given)
            seen = [j for batch in indices(prepared) for j in batch]
            base = prepared.base_dataloader
            record["auto"] = {
                "given_num_workers": given.num_workers,
                "seen": seen,
                "kind": kind(base),
                "num_workers_is_int": isinstance(base.num_workers, int),
                "choice": base.stats().choice,
            }
            record["own"] = own_samplers_first(accelerator)
    else:
        # accelerate's checkpoint, back into loaders prepared in the same order
        loader = resumable(accelerator)
        accelerator.load_state(state_dir)
        record["after_load_state"] = indices(loader)
        record["full"] = indices(resumable(accelerator))  # an uninterrupted epoch
        record["after_skip"] = indices(accelerator.skip_first_batches(resumable(accelerator), STOP_AFTER))
        if FLAVOUR == "stoker":
            loader = resumable(accelerator)
            with open(os.path.join(OUT, f"loader-{rank}.json")) as saved:
                loader.load_state_dict(json.load(saved))
            record["after_load_state_dict"] = indices(loader)
            record["resumed_kind"] = kind(loader.base_dataloader)
            record["own"] = own_samplers_second()
    with open(os.path.join(OUT, f"{FLAVOUR}-{PHASE}-{rank}.json"), "w") as out:
        json.dump(record, out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
