"""Lightning's own data-loading utilities on stoker.torch loaders, in this process: what its
tests check for torch's DataLoader (re-creation keeping the arguments, with a loader made
inside Lightning's argument-capturing hook and outside it; shuffle detection; `has_len`;
custom subclasses) holds for stoker's, and stoker's own arguments survive re-creation."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")

import torch.utils.data as tud  # noqa: E402
from lightning_fabric.utilities.data import (  # noqa: E402
    _replace_dunder_methods,
    _update_dataloader,
    has_len,
)
from pytorch_lightning.utilities.data import _is_dataloader_shuffled  # noqa: E402

import stoker.torch as st  # noqa: E402


class Numbers(st.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return i


def seen(loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch]


def made_in_a_hook(**kwargs: Any) -> Any:
    """A loader made as Lightning's *_dataloader hooks make it: inside the context that
    records each DataLoader subclass's __init__ arguments."""
    with _replace_dunder_methods(tud.DataLoader, "dataset"), _replace_dunder_methods(tud.BatchSampler):
        return st.DataLoader(Numbers(), **kwargs)


@pytest.mark.parametrize("in_hook", [True, False], ids=["captured", "attributes"])
def test_update_dataloader_keeps_stokers_arguments_and_takes_the_new_sampler(in_hook: bool) -> None:
    kwargs = dict(
        batch_size=4,
        shuffle=True,
        num_workers=2,
        max_worker_restarts=2,
        thread_pool=True,
        persistent_workers=True,
        prefetch_factor=3,
        seed_each_batch=False,
        drop_last=True,
    )
    loader = made_in_a_hook(**kwargs) if in_hook else st.DataLoader(Numbers(), **kwargs)
    sampler = tud.DistributedSampler(loader.dataset, num_replicas=2, rank=0, shuffle=False)
    again = _update_dataloader(loader, sampler)
    assert type(again) is st.DataLoader and again.sampler is sampler
    assert (
        again.num_workers,
        again.max_worker_restarts,
        again.thread_pool,
        again.persistent_workers,
        again.prefetch_factor,
        again.batch_size,
        again.drop_last,
    ) == (2, 2, True, True, 3, 4, True)
    assert seen(again) == list(range(0, 16, 2))


def test_stats_off_survives_a_captured_recreation() -> None:
    loader = made_in_a_hook(batch_size=4, stats=False)
    again = _update_dataloader(loader, tud.SequentialSampler(loader.dataset))
    assert again.stats_enabled is False


def test_shuffle_is_detected_as_for_torch() -> None:
    assert _is_dataloader_shuffled(st.DataLoader(Numbers(), shuffle=True))
    assert not _is_dataloader_shuffled(st.DataLoader(Numbers(), shuffle=False))
    assert _is_dataloader_shuffled(made_in_a_hook(shuffle=True))
    assert not _is_dataloader_shuffled(
        st.DataLoader(Numbers(), batch_sampler=tud.BatchSampler(tud.SequentialSampler(Numbers()), 4, False))
    )


def test_has_len_as_for_torch() -> None:
    assert has_len(st.DataLoader(Numbers(), batch_size=4))

    class Stream(st.IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(3))

    assert not has_len(st.DataLoader(Stream(), batch_size=2))


def test_a_subclass_of_stokers_loader_is_recreated_with_its_own_arguments() -> None:
    class Custom(st.DataLoader):
        def __init__(self, dataset: Any, tag: str, **kwargs: Any) -> None:
            self.tag = tag
            super().__init__(dataset, **kwargs)

    with _replace_dunder_methods(tud.DataLoader, "dataset"), _replace_dunder_methods(tud.BatchSampler):
        loader = Custom(Numbers(), "mine", batch_size=4, num_workers=1)
    again = _update_dataloader(loader, tud.DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False))
    assert type(again) is Custom and again.tag == "mine" and again.num_workers == 1
    assert seen(again) == list(range(1, 16, 2))


def test_an_argument_stoker_does_not_take_is_a_type_error_naming_it() -> None:
    loader = st.DataLoader(Numbers(), batch_size=4)
    with pytest.raises(TypeError, match="made_up"):
        type(loader)(Numbers(), made_up=1)  # type: ignore[call-arg]
