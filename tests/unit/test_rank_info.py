"""Ranks without a process group: torchrun's variables, the sampler's default seed, `shard_for`,
the rank in worker seeds and worker info, a chosen sampler seed checked against a state, and the
device LOCAL_RANK picks. The real multi-process runs are in tests/integration/test_ranks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import stoker
from stoker._core.pin import local_device_index
from stoker._core.seeding import _global_seeds
from stoker._core.torch_place import default_device
from stoker._core.worker import WorkerConfig
from stoker._data.distributed import ranks


@pytest.fixture
def torchrun(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def set_env(rank: int, world: int, local: int | None = None) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        if local is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", str(local))

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return set_env


def test_ranks_come_from_torchrun_variables(torchrun: Any) -> None:
    assert ranks() == (0, 1, None)
    torchrun(2, 4, 0)
    assert ranks() == (2, 4, 0)


def test_sampler_seed_none_is_the_default_seed_with_no_process_group(torchrun: Any) -> None:
    torchrun(1, 2)  # two ranks and no process group: nothing to agree through, nothing needed
    default = stoker.DistributedSampler(range(10))
    unset = stoker.DistributedSampler(range(10), seed=None)
    assert default.seed == unset.seed == 0
    assert list(unset) == list(default) == list(stoker.DistributedSampler(range(10), seed=0))
    assert list(stoker.DistributedSampler(range(10), seed=None, rank=0)) != list(unset)  # disjoint halves
    with pytest.raises(TypeError, match="seed should be an int or None, but got seed='1'"):
        stoker.DistributedSampler(range(10), num_replicas=1, rank=0, seed="1")  # type: ignore[arg-type]


def test_shard_for_covers_ranks_times_workers_once(torchrun: Any) -> None:
    shards = []
    for rank in range(3):
        for worker in range(2):
            info = stoker.WorkerInfo(worker, 2, 0, None, rank=rank, world_size=3)
            shards.append(stoker.shard_for(info))
    assert [s.index for s in shards] == list(range(6)) and {s.count for s in shards} == {6}
    taken = [x for s in shards for x in s.take(iter(range(100)))]
    assert sorted(taken) == list(range(100))
    assert sorted(i for s in shards for i in s.indices(100)) == list(range(100))
    torchrun(1, 2)  # the main process (num_workers=0): shards by rank alone
    assert stoker.shard_for(None) == stoker.Shard(1, 2)


class WhoAmI(stoker.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[int, int, int, int, int]:
        info = stoker.get_worker_info()
        assert info is not None
        return (i, info.rank, info.world_size, -1 if info.local_rank is None else info.local_rank, info.seed)


@pytest.mark.filterwarnings("ignore::stoker.UnshardedWarning")  # one rank of 2 reads all on purpose
def test_worker_info_reports_the_rank_and_seeds_mix_it_in(torchrun: Any) -> None:
    torchrun(1, 2, 1)
    loader = stoker.DataLoader(WhoAmI(), batch_size=2, num_workers=2, thread_pool=True, generator=7)
    rows = np.concatenate([np.stack(b, axis=1) for b in loader])  # a batch is 5 columns
    assert set(map(tuple, rows[:, 1:4].tolist())) == {(1, 2, 1)}
    seeds_rank1 = set(rows[:, 4].tolist())
    torchrun(0, 2, 0)
    loader = stoker.DataLoader(WhoAmI(), batch_size=2, num_workers=2, thread_pool=True, generator=7)
    rows0 = np.concatenate([np.stack(b, axis=1) for b in loader])
    seeds_rank0 = set(rows0[:, 4].tolist())
    assert len(seeds_rank0) == len(seeds_rank1) == 2 and not seeds_rank0 & seeds_rank1
    # without torch.distributed, a DistributedSampler's rank and world size win over the environment's
    sampler = stoker.DistributedSampler(WhoAmI(), num_replicas=3, rank=2, shuffle=False)
    loader = stoker.DataLoader(WhoAmI(), batch_size=2, sampler=sampler, num_workers=1, thread_pool=True)
    assert {tuple(r[1:3]) for b in loader for r in np.stack(b, axis=1).tolist()} == {(2, 3)}


def test_worker_config_seed_is_torchs_on_rank_zero() -> None:
    config = WorkerConfig(1, 4, 100, None, "map", True, list, False, None, False)
    assert config.seed == 101
    ranked = WorkerConfig(1, 4, 100, None, "map", True, list, False, None, False, rank=2, world_size=3)
    assert ranked.seed == 100 + 2 * 4 + 1


def test_seed_each_batch_seeds_differ_by_rank_and_rank_zero_keeps_its_own() -> None:
    zero, one = _global_seeds(5, 1, 3), _global_seeds(5, 1, 3, rank=1)
    assert zero[0] == _global_seeds(5, 1, 3, rank=0)[0]
    assert zero[0] != one[0] and zero[2] != one[2]


def test_a_chosen_sampler_seed_must_match_the_states(torchrun: Any) -> None:
    def make(seed: int) -> stoker.DataLoader:
        sampler = stoker.DistributedSampler(range(20), num_replicas=1, rank=0, seed=seed)
        return stoker.DataLoader(range(20), batch_size=4, sampler=sampler, generator=1)

    saved = make(0)
    next(iter(saved))
    state = saved.state_dict()
    other = make(5)
    with pytest.raises(ValueError, match="sampler_seed: saved 0, this loader 5"):
        other.load_state_dict(state)


def test_local_rank_picks_the_device(torchrun: Any) -> None:
    assert default_device() == "cuda"
    assert local_device_index(4) is None
    torchrun(3, 4, 2)
    assert default_device() == "cuda:2"
    assert local_device_index(4) == 2
    assert local_device_index(2) is None  # LOCAL_RANK names no device here: the current one


class Draws(stoker.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        return stoker.sample_seed()


def _batch_seed(samples: list[int]) -> tuple[int, list[int]]:
    return stoker.sample_seed(), samples  # the collate_fn's draw is batch-level


@pytest.mark.filterwarnings("ignore::stoker.UnshardedWarning")  # one rank of 2 reads all on purpose
def test_batch_level_seeds_mix_in_the_rank_and_sample_seeds_do_not(torchrun: Any) -> None:
    def run(workers: int) -> list[tuple[int, list[int]]]:
        loader = stoker.DataLoader(
            Draws(), batch_size=4, generator=7, collate_fn=_batch_seed, num_workers=workers, thread_pool=workers > 0
        )
        return list(loader)

    alone = run(0)
    torchrun(0, 2)
    assert run(0) == alone == run(2)  # rank 0: as without ranks, whatever the workers
    torchrun(1, 2)
    on_rank_1 = run(0)
    assert run(2) == on_rank_1
    assert [samples for _, samples in on_rank_1] == [samples for _, samples in alone]
    assert all(a != b for (a, _), (b, _) in zip(alone, on_rank_1))
