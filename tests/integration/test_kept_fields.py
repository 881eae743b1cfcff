"""Memory held is what the user holds, array by array, as with torch's collated tensors:
keeping a batch's small field (labels) holds no slot; keeping a large field (masks) holds that
field's pages and gives the rest of its batch's back to the system; a view of an array keeps
that array's memory, and its content, whatever else of the batch goes."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from stoker import DataLoader, Dataset

IMAGE = (3, 96, 96)  # 27 KiB a sample
MASK = (1, 96, 96)  # 9 KiB a sample
BATCH = 16
PAGE = os.sysconf("SC_PAGE_SIZE")
MASK_BYTES = BATCH * int(np.prod(MASK))


class Segmentation(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {
            "image": np.full(IMAGE, i % 251, np.uint8),
            "mask": np.full(MASK, (i * 7) % 251, np.uint8),
            "label": i,
        }


def allocated_bytes(loader: DataLoader) -> int:
    """What the kernel holds for the arena's slots: the allocated blocks of each memfd."""
    return sum(os.fstat(fd).st_blocks * 512 for fd in loader._arena.slots.fds.values())


def loader_for(n: int, **kwargs) -> DataLoader:
    return DataLoader(
        Segmentation(n), batch_size=BATCH, num_workers=2, prefetch_factor=2, multiprocessing_context="fork", **kwargs
    )


def test_keeping_labels_holds_no_slot() -> None:
    loader = loader_for(BATCH * 60)
    labels = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "arena has grown" warning
        warnings.simplefilter("error", RuntimeWarning)  # stoker's categories: not the others'
        for k, batch in enumerate(loader):
            assert (batch["image"][:, 0, 0, 0] == (np.arange(BATCH * k, BATCH * (k + 1)) % 251)).all()
            labels.append(batch["label"])
            del batch
    assert len(loader._arena.slots.maps) <= 2 * 2 + 2  # the window, the handed-out one, one spare
    assert np.concatenate(labels).tolist() == list(range(BATCH * 60))


def test_keeping_masks_holds_the_masks_not_their_batches() -> None:
    batches = 40
    loader = loader_for(BATCH * batches)
    masks = []
    for batch in loader:
        masks.append(batch["mask"])
        del batch
    gc.collect()
    slots = loader._arena.slots
    slot_bytes = max(slots.sizes.values())
    # the masks, a page on each side of each, and a bounded number of whole slots: the free
    # ones and the last few whose other arrays went but are not yet given back
    bound = batches * (MASK_BYTES + 2 * PAGE) + (2 * 2 + 2 + 4 + 1) * slot_bytes
    held = allocated_bytes(loader)
    assert len(slots.fds) == len(slots.maps), "every slot's descriptor kept: all are counted"
    assert held <= bound, f"{held / 2**20:.1f} MiB held for {batches * MASK_BYTES / 2**20:.1f} MiB of masks"
    whole = batches * slot_bytes  # what holding every batch's slot would cost
    assert held < 0.5 * whole
    for k, mask in enumerate(masks):  # the pages given back were never the masks'
        want = (np.arange(BATCH * k, BATCH * (k + 1)) * 7) % 251
        assert (mask[:, 0, 0, 0] == want).all() and (mask[:, 0, -1, -1] == want).all()


def test_a_kept_view_keeps_its_array_whatever_else_goes() -> None:
    loader = loader_for(BATCH * 30)
    kept = []
    for batch in loader:
        kept.append(batch["image"][2:4, :, 10:20])  # a view of the image; the batch goes
        del batch
    for k, view in enumerate(kept):
        want = np.arange(BATCH * k + 2, BATCH * k + 4) % 251
        assert (view[:, 0, 0, 0] == want).all() and (view[:, -1, -1, -1] == want).all()


def test_torch_views_of_a_kept_field_keep_their_content() -> None:
    torch = pytest.importorskip("torch")
    import stoker.torch as st

    loader = st.DataLoader(Segmentation(BATCH * 30), batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    kept = []
    for batch in loader:
        assert isinstance(batch["mask"], torch.Tensor)
        kept.append(batch["mask"][1:3].view(2, -1))  # a tensor view of the masks
        del batch
    gc.collect()
    for k, view in enumerate(kept):
        want = torch.tensor((np.arange(BATCH * k + 1, BATCH * k + 3) * 7) % 251, dtype=torch.uint8)
        assert torch.equal(view[:, 0], want) and torch.equal(view[:, -1], want)


CHILD_SCRIPT = """
import gc, os, sys
import numpy as np
sys.path.insert(0, {tests!r})
from integration.test_kept_fields import BATCH, Segmentation
from stoker import DataLoader

loader = DataLoader(Segmentation(BATCH * 60), batch_size=BATCH, num_workers=2, prefetch_factor=2,
                    multiprocessing_context="fork", persistent_workers=True)
it = iter(loader)
masks = []
for k in range(20):
    batch = next(it)
    masks.append(batch["mask"])  # a batch partly kept: its image's pages are due back
    del batch
go, wait = os.pipe()
pid = os.fork()
if pid == 0:  # the child waits, then drops its copy of everything and leaves by a normal exit
    os.read(go, 1)
    del it, loader, masks
    gc.collect()
    sys.exit(0)
masks.clear()  # the parent's slots are free again, and the next batches reuse them
held = [(k, next(it)) for k in range(20, 40)]
os.write(wait, b"x")
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
held += [(k, next(it)) for k in range(40, 60)]
for k, batch in held:
    want = np.arange(BATCH * k, BATCH * (k + 1))
    assert (batch["image"][:, :, ::17, ::17] == (want % 251)[:, None, None, None]).all(), k
    assert (batch["mask"][:, 0, ::9, ::9] == ((want * 7) % 251)[:, None, None]).all(), k
print("OK")
"""


def test_a_forked_child_never_gives_back_its_parents_pages() -> None:
    """A child forked from the training process that drops its copy of the loader and exits
    normally runs the arena's finalizers in its own copy: they must not give back pages of the
    parent's slots, which the parent's workers are writing or the parent still holds."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_SCRIPT.format(tests=tests)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
