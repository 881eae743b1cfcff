"""A dataset holding SharedLists through worker processes under fork, spawn and forkserver:
every sample comes back right, and spawn/forkserver workers map the lists' arrays from
shared memory instead of receiving pickled copies."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stoker import DataLoader, Dataset, SharedList

N = 300_000  # blob ~15 MB, offsets and labels 2.4 MB each: all shared by handle
STRIDE = 7919


def path_of(i: int) -> str:
    return f"/data/train/class_{i % 1000:04d}/img_{i:08d}_é.jpg"


def from_shared_memory(array: np.ndarray) -> bool:
    """The array views a mapping of stoker's shared memory (not memory of its own)."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    return hasattr(base, "_unmap")


class Paths(Dataset):
    def __init__(self) -> None:
        self.paths = SharedList(path_of(i) for i in range(N))
        self.labels = SharedList(i % 1000 - 500 for i in range(N))
        self.extra = SharedList([("a", 1), b"x", 2.5, 2**70])  # small: pickled inline

    def __len__(self) -> int:
        return 200

    def __getitem__(self, j: int) -> dict:
        i = j * STRIDE % N
        arrays = self.paths.arrays[:2] + self.labels.arrays[:1]
        return {
            "j": j,
            "path": self.paths[i],
            "label": self.labels[-N + i],
            "extra": repr(self.extra[j % 4]),
            "mapped": all(from_shared_memory(a) for a in arrays),
            "pid": os.getpid(),
        }


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_shared_list_through_workers(method: str) -> None:
    dataset = Paths()
    loader = DataLoader(dataset, batch_size=16, num_workers=2, multiprocessing_context=method)
    seen = []
    mapped = set()
    pids = set()
    for batch in loader:
        for k, j in enumerate(np.asarray(batch["j"]).tolist()):
            i = j * STRIDE % N
            assert batch["path"][k] == path_of(i)
            assert int(batch["label"][k]) == i % 1000 - 500
            assert batch["extra"][k] == repr([("a", 1), b"x", 2.5, 2**70][j % 4])
            seen.append(j)
        mapped.update(np.asarray(batch["mapped"]).tolist())
        pids.update(np.asarray(batch["pid"]).tolist())
    del loader
    assert sorted(seen) == list(range(200))
    assert pids and os.getpid() not in pids
    # fork workers inherit the arrays; spawn and forkserver ones map the shared copies
    assert mapped == {method != "fork"}
