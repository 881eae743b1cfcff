"""One pool of shared-memory slots for all of a loader's workers: the slots held at steady
state do not grow with the number of workers, and a slot one worker retires (outgrown) is
unmapped by every other worker that mapped it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stoker import DataLoader, Dataset

ROWS = 1 << 14  # float64 rows of 8 bytes: a 128 KiB sample, 512 KiB per batch of 4


class Fixed(Dataset):
    def __len__(self) -> int:
        return 240

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(ROWS, float(i))


class Growing(Dataset):
    """Samples that grow every 24 samples, so batches outgrow their slots again and again."""

    def __len__(self) -> int:
        return 144

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(ROWS * (1 + i // 24), float(i))


def slot_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as maps:
        return sum(1 for line in maps if "stoker-slot" in line)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_slots_held_do_not_grow_with_workers(workers: int) -> None:
    loader = DataLoader(Fixed(), batch_size=4, num_workers=workers, prefetch_factor=2, multiprocessing_context="fork")
    kept: list[np.ndarray] = []
    for k, batch in enumerate(loader):
        assert (batch[:, 0] == np.arange(4 * k, 4 * k + 4)).all()
        kept[:] = [batch]  # the consumer holds the last batch while it asks for the next
    window = 2 * workers
    # every batch in flight, the one being handed out and the one the consumer holds
    held = len(loader._arena.slots.maps)
    assert held <= window + 2


def test_a_retired_slot_is_unmapped_by_the_other_workers() -> None:
    loader = DataLoader(
        Growing(),
        batch_size=4,
        num_workers=3,
        prefetch_factor=2,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    iterator = iter(loader)
    for k, batch in enumerate(iterator):
        assert (batch[:, 0] == np.arange(4 * k, 4 * k + 4)).all()
        assert batch.shape == (4, ROWS * (1 + 4 * k // 24))
    del batch
    # the next epoch's first batches went out (next-epoch prefetch), carrying the drop notices
    first = next(iter(loader))
    pool = loader._arena.slots
    live = len(pool.maps)
    sizes = sorted(pool.sizes.values())
    assert sizes[0] >= 4 * ROWS * 8  # the small slots of the first batches were retired
    pids = [w.pid for w in loader.stats().workers]
    assert all(pid is not None and pid != os.getpid() for pid in pids)
    for pid in pids:  # no worker keeps a retired slot mapped
        assert slot_mappings(pid) <= live
    assert (first[:, 0] == np.arange(4)).all()
    iterator.close()


EXIT_SCRIPT = """
import numpy as np, stoker
try:
    import stoker.torch as st
except ImportError:  # no torch: the second loader is the numpy flavour's too
    st = stoker
class S(stoker.IterableDataset):
    def __iter__(self):
        return iter(np.arange(10.0).reshape(5, 2))
a = stoker.DataLoader(np.arange(2000.0).reshape(100, 20), batch_size=10, num_workers=1)
b = st.DataLoader(S(), batch_size=2, num_workers=1)
x, y = list(a), list(b)  # batches and loaders still referenced at interpreter exit
"""


def test_batches_kept_until_interpreter_exit_unmap_quietly() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Exception ignored" not in proc.stderr, proc.stderr
