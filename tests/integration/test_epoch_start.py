"""An epoch starts at `iter()`, as torch's does: what the user sets between epochs (a dataset's
`set_epoch`, an attribute of a shared object) is seen by the epoch that follows, persistent
workers or not. `auto_reload=True` is the opt-in next-epoch prefetch."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.utils.data as torch_data  # noqa: E402

import stoker.torch as st  # noqa: E402

METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]


class EpochShuffled(torch_data.IterableDataset):
    """A stream reshuffled by `set_epoch`, the epoch held in shared memory so that persistent
    workers see it (as Hugging Face's and litdata's datasets do): each worker takes its part of
    the epoch's permutation, so an epoch read with a stale counter repeats and loses items."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = torch.zeros(1, dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __iter__(self):
        info = torch_data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + int(self.epoch)))
        # an unequal split: worker 0 takes the first 60%, the rest share the remainder
        cut = [0] + [int(self.n * (0.6 + 0.4 * k / max(workers - 1, 1))) for k in range(workers)]
        cut[-1] = self.n
        part = order[cut[worker] : cut[worker + 1]] if workers > 1 else order
        return iter(part.tolist())


class EpochValued(torch_data.Dataset):
    """Map-style: each sample carries the epoch the user set last (a shared counter); `reads`
    counts, per index, the samples made (shared, so that a test sees what the workers did)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.reads = torch.zeros(n, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        value = int(self.epoch) * 1000 + i
        self.reads[i] += 1  # one worker makes index i at a time
        return value


def _epochs(loader, dataset, epochs: int) -> list[list[int]]:
    out = []
    for epoch in range(epochs):
        dataset.set_epoch(epoch) if hasattr(dataset, "set_epoch") else dataset.epoch.fill_(epoch)
        out.append([int(v) for batch in loader for v in batch])
    return out


@pytest.mark.parametrize("method", METHODS)
def test_dataset_set_epoch_reaches_persistent_workers(method: str) -> None:
    dataset = EpochShuffled(300)
    kwargs = dict(batch_size=8, num_workers=2, persistent_workers=True, multiprocessing_context=method)
    got = _epochs(st.DataLoader(dataset, **kwargs), dataset, 3)
    want = _epochs(torch_data.DataLoader(dataset, **kwargs), dataset, 3)
    for epoch, items in enumerate(got):
        assert sorted(items) == list(range(300)), f"epoch {epoch}: items repeated or missing"
    assert got == want
    assert got[0] != got[1] != got[2]


@pytest.mark.parametrize("method", METHODS)
def test_map_style_epoch_sees_what_was_set_before_iter(method: str) -> None:
    dataset = EpochValued(24)
    loader = st.DataLoader(
        dataset, batch_size=4, num_workers=2, persistent_workers=True, prefetch_factor=4, multiprocessing_context=method
    )
    for epoch, items in enumerate(_epochs(loader, dataset, 3)):
        assert items == [epoch * 1000 + i for i in range(24)]


def test_auto_reload_prefetches_the_next_epoch_before_iter() -> None:
    """The opt-in: the next epoch's first batches are made before `iter()` asks, so they read
    what was set before the current epoch ended (what the documentation warns about)."""
    dataset = EpochValued(48)
    loader = st.DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True, auto_reload=True)
    first = [int(v) for batch in loader for v in batch]
    # the workers are already making epoch 1's first batches: wait until the first one is made
    # (its samples read a second time), as the training step between two epochs would
    deadline = time.monotonic() + 60
    while not bool((dataset.reads[:4] >= 2).all()):
        assert time.monotonic() < deadline, f"epoch 1's first batch was not made ahead in 60 s: {dataset.reads[:4]}"
        time.sleep(0.05)
    dataset.epoch.fill_(1)
    second = [int(v) for batch in loader for v in batch]
    assert first == list(range(48))
    assert second[:4] == [0, 1, 2, 3]  # prefetched: read before epoch 1 was set
    assert second[-4:] == [1044, 1045, 1046, 1047]  # made after it was set
    del loader


def test_auto_reload_arguments_are_checked() -> None:
    data = np.arange(8)
    with pytest.raises(TypeError, match="auto_reload should be True or False"):
        st.DataLoader(data, num_workers=1, persistent_workers=True, auto_reload=1)
    with pytest.raises(ValueError, match=r"auto_reload=True .* needs persistent_workers=True"):
        st.DataLoader(data, num_workers=1, auto_reload=True)
    with pytest.raises(ValueError, match="needs persistent_workers=True"):
        st.DataLoader(data, auto_reload=True)
    assert st.DataLoader(data, num_workers=1, persistent_workers=True, auto_reload=True).auto_reload is True
