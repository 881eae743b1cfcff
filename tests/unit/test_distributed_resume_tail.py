"""A DistributedSampler resumed from another rank's state on the same world size (issue 45, item 5).

Lightning saves rank 0's loader state and every rank loads it. On the same world size, each rank
must go on exactly as its uninterrupted run: the rest of its share, with the epoch's tail padded
as the uninterrupted epoch pads it (an odd dataset over 2 ranks repeats one sample), and the
epochs after unchanged.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pytest

import stoker

N = 23  # odd: over 2 ranks without drop_last, the last rank's share ends with a padded sample
WORLD = 2
BATCH = 2


class Numbers(stoker.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array(i)


def flavours() -> list[Any]:
    found: list[Any] = [pytest.param(stoker, id="stoker")]
    try:
        import stoker.torch as st
    except ImportError:
        return found
    return [*found, pytest.param(st, id="stoker.torch")]


def make(module: Any, rank: int, shuffle: bool, drop_last: bool, **kwargs: Any) -> tuple[Any, Any]:
    dataset = Numbers()
    sampler = module.DistributedSampler(dataset, num_replicas=WORLD, rank=rank, shuffle=shuffle, drop_last=drop_last)
    return module.DataLoader(dataset, batch_size=BATCH, sampler=sampler, **kwargs), sampler


def samples(batches: Any) -> list[int]:
    return [int(i) for batch in batches for i in np.asarray(batch).ravel()]


def two_epochs(loader: Any, sampler: Any) -> tuple[list[int], list[int]]:
    """The (rest of the) loader's epoch, then the next epoch (set_epoch(1))."""
    rest = samples(loader)
    sampler.set_epoch(1)
    return rest, samples(loader)


@pytest.mark.parametrize("module", flavours())
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_every_rank_resumed_from_rank_0s_state_goes_on_as_its_uninterrupted_run(
    module: Any, shuffle: bool, drop_last: bool, steps: int
) -> None:
    uninterrupted = {}
    for rank in range(WORLD):
        loader, sampler = make(module, rank, shuffle, drop_last)
        uninterrupted[rank] = two_epochs(loader, sampler)
    if not drop_last:  # the case the test is about: the last rank's share ends with a padded sample
        assert Counter(uninterrupted[0][0] + uninterrupted[1][0])[uninterrupted[0][0][0]] == 2

    saver, _ = make(module, 0, shuffle, drop_last)
    batches = iter(saver)
    for _ in range(steps):
        next(batches)
    state = json.loads(json.dumps(saver.state_dict()))  # as a checkpoint file holds it
    del batches, saver

    union, whole = Counter(), Counter()
    for rank in range(WORLD):
        loader, sampler = make(module, rank, shuffle, drop_last)
        loader.load_state_dict(state)  # every rank loads rank 0's state
        rest, after = two_epochs(loader, sampler)
        assert rest == uninterrupted[rank][0][steps * BATCH :], f"rank {rank}'s rest of the epoch"
        assert after == uninterrupted[rank][1], f"rank {rank}'s next epoch"
        union += Counter(uninterrupted[rank][0][: steps * BATCH] + rest)
        whole += Counter(uninterrupted[rank][0])
    assert union == whole  # together: the uninterrupted epoch, its padded repeat included


@pytest.mark.parametrize("shuffle", [False, True])
def test_rank_1_resumed_from_rank_0s_state_with_process_workers(shuffle: bool) -> None:
    loader, sampler = make(stoker, 1, shuffle, False)
    expected = two_epochs(loader, sampler)
    saver, _ = make(stoker, 0, shuffle, False, num_workers=2, multiprocessing_context="fork")
    batches = iter(saver)
    for _ in range(4):
        next(batches)
    state = json.loads(json.dumps(saver.state_dict()))
    del batches, saver
    resumed, resumed_sampler = make(stoker, 1, shuffle, False, num_workers=2, multiprocessing_context="fork")
    resumed.load_state_dict(state)
    rest, after = two_epochs(resumed, resumed_sampler)
    assert (rest, after) == (expected[0][4 * BATCH :], expected[1])


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_resume_elastic_on_the_same_world_gives_the_ranks_uninterrupted_share(shuffle: bool, rank: int) -> None:
    sampler = stoker.DistributedSampler(Numbers(), num_replicas=WORLD, rank=rank, shuffle=shuffle)
    sampler.set_epoch(2)
    share = list(sampler)
    for consumed in range(len(share) + 1):
        sampler.resume_elastic(consumed, WORLD, sampler.total_size)
        assert len(sampler) == len(share) - consumed
        assert list(sampler) == share[consumed:]
        assert list(sampler) == share  # the epoch after the resumed one is ordinary
