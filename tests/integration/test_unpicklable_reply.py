"""A batch that cannot be pickled fails at its position with the worker's error, and the slot
the worker made for it goes with it: no descriptor or mapping is left in the worker."""

from __future__ import annotations

import os
import threading

import numpy as np

import stoker


class Rows(stoker.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(4096, i, np.float64)


def collate(samples):
    x = stoker.default_collate(samples)
    return (x, threading.Lock()) if int(x[0, 0]) % 16 == 8 else (x, None)


def slot_fds_and_maps(pid: int) -> tuple[int, int]:
    fds = sum("stoker-slot" in os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/maps") as maps:
        return fds, sum(1 for line in maps if "stoker-slot" in line)


def test_a_reply_that_fails_to_pickle_returns_its_slot() -> None:
    loader = stoker.DataLoader(
        Rows(), batch_size=4, num_workers=1, persistent_workers=True, multiprocessing_context="fork", collate_fn=collate
    )
    for _ in range(2):
        delivered, failed = [], 0
        it = iter(loader)
        while True:
            try:
                delivered.append(int(next(it)[0][0, 0]))
            except StopIteration:
                break
            except TypeError as exc:
                assert "while sending its batch" in str(exc)
                failed += 1
        assert failed == 4 and delivered == [b for b in range(0, 64, 4) if b % 16 != 8]
        fds, maps = slot_fds_and_maps(loader._iterator._engine.pid(0))
        assert fds == 0, "the worker kept the descriptor of a slot it made for the failed batch"
        assert maps <= len(loader._arena.slots.maps), "the worker maps a slot the loader never saw"
    del it, loader
