"""One training rank reading through Ray Data: save the loader's place mid-epoch, resume exactly.

python examples/ray_resume.py
"""

import numpy as np
import ray

import stoker
import stoker.ray


class Noisy(stoker.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        # the same draw for the same (seed, epoch, sample) wherever and however it is read
        noise = stoker.sample_rng().normal(size=4).astype(np.float32)
        return {"x": np.full(4, i, np.float32) + noise, "label": i % 10}


def make_loader():
    return stoker.ray.DataLoader(Noisy(), batch_size=64, shuffle=True, seed=0, rank=0, world_size=1, drop_last=True)


if __name__ == "__main__":
    ray.init()  # a Ray of this machine's CPUs; with RAY_ADDRESS set, the cluster it names
    loader = make_loader()
    seen = 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for step, batch in enumerate(loader):
            seen += len(batch["label"])  # the training step goes here
            if epoch == 1 and step == 5:
                state = loader.state_dict()  # save it with the model's checkpoint
                break
    resumed = make_loader()
    resumed.load_state_dict(state)  # another world_size resumes elastically
    left = list(resumed)
    print(f"{seen} samples read; {len(left)} batches left of epoch {resumed.epoch}")  # 9 of 15
    ray.shutdown()
