"""Several training ranks under torchrun, each reading its own shard through stoker.torch.

    torchrun --standalone --nproc-per-node=2 examples/ranks.py

Every rank passes the same sampler seed (the default, 0, as in torch), so the ranks' shards are
disjoint and nothing is communicated to agree on it; every rank seeds its global RNG alike, so
the loaders' base seeds agree too (a sample's `stoker.sample_rng()` is the same whichever rank
reads it), while each rank's workers get their own global seeds. Each rank checks what it
read against the others and saves a resumable state, as a training loop would with its
checkpoint. On GPUs, initialise with "nccl" and wrap the loader in
`stoker.torch.to_device(loader)`: it copies to the device LOCAL_RANK names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from image_pipeline import EncodedImages  # the sibling example's dataset

import stoker.torch as st


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same on every rank, as for the model's initial weights
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = EncodedImages(n=240)
    sampler = st.DistributedSampler(dataset, seed=0)  # the same seed on every rank
    loader = st.DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        count, checksum = 0, 0.0
        for images, labels in loader:
            count += len(labels)
            checksum += float(images.sum())
        totals = torch.tensor([count, checksum], dtype=torch.float64)
        dist.all_reduce(totals)
        if rank == 0:
            print(
                f"epoch {epoch}: {int(totals[0])} samples over {world} ranks "
                f"(the dataset has {len(dataset)}), checksum {float(totals[1]):.1f}"
            )
    state = loader.state_dict()  # save it with the model's checkpoint, on every rank
    if rank == 0:
        print(f"shuffling seed {sampler.seed} on every rank; a state is {len(str(state))} characters")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
