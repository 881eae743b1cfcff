"""Datasets the Ray tests read; a module (not a test file) so that Ray's workers import it
by name (the cluster's processes get this directory on PYTHONPATH)."""

from __future__ import annotations

import os
import threading

import numpy as np

import stoker


class Indexed(stoker.Dataset):
    """Sample i is the int i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


class Seeded(Indexed):
    """Sample i is (i, a draw from stoker.sample_rng())."""

    def __getitem__(self, i: int) -> tuple[int, int]:
        return int(i), int(stoker.sample_rng().integers(1 << 30))


class BatchSeeded(Indexed):
    """Fetches whole batches: each sample carries a draw from the batch's sample_rng()."""

    def __getitem__(self, i: int) -> tuple[int, int]:
        raise AssertionError("the loader must use __getitems__")

    def __getitems__(self, indices: list[int]) -> list[tuple[int, int]]:
        rng = stoker.sample_rng()
        return [(int(i), int(rng.integers(1 << 30))) for i in indices]


class NodeReporting(Indexed):
    """Sample i is (i, the Ray node id and pid of the process that read it)."""

    def __getitem__(self, i: int) -> tuple[int, str, int]:
        import ray

        return int(i), ray.get_runtime_context().get_node_id(), os.getpid()


class Mixed(Indexed):
    """Samples of several kinds, which Ray Data's own rows would change."""

    def __getitem__(self, i: int) -> object:
        kind = i % 4
        if kind == 0:
            return {"image": np.full((2, 3), i, np.uint8), "label": np.int64(i), "name": f"s{i}"}
        if kind == 1:
            return (i, f"text {i}", None, [1.5, i])
        if kind == 2:
            return np.arange(i, dtype=np.float16).reshape(-1, 1)
        return {"ragged": [np.zeros(k) for k in range(i % 5)], "bytes": bytes([i % 256]) * 3}


class Failing(Indexed):
    """Raises at one index."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise KeyError(f"no sample {i} here")
        return int(i)


class HoldsLock(Indexed):
    """Cannot be pickled: it holds a lock."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = threading.Lock()


class Images(Indexed):
    """3x8x8 uint8 images: sample i is filled with i % 256."""

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full((3, 8, 8), i % 256, np.uint8)
