"""Opening an epoch as one step (`_core/epochs.py`): the first epoch's order and base seed, afresh
or where a state left off; a later epoch's order, replayed once from the origin drawn ahead for it;
the origins a state saves; and a BatchSampler's rollover read and written through
BatchSampler's own state methods, never a subclass's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import stoker
from stoker._core.epochs import EpochOpener
from stoker._core.plan import LoadPlan
from stoker._core.resume import Progress, open_epoch, predraw


class Numbers(stoker.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Stream(stoker.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(7))


def shuffled(seed: int = 7) -> stoker.DataLoader:
    return stoker.DataLoader(Numbers(10), batch_size=3, shuffle=True, generator=seed)


def opener(plan: LoadPlan) -> tuple[EpochOpener, Progress]:
    progress = Progress(None if plan.iterable else plan.index_sampler, plan.seed_source, plan.persistent)
    return EpochOpener(progress), progress


def test_a_fresh_first_epoch_has_the_loaders_order_and_base_seed() -> None:
    plan = shuffled()._plan()
    epochs, progress = opener(plan)
    opened = epochs.open_first(plan)
    assert opened.source is not None
    same = iter(shuffled())
    assert list(opened.source) == [batch.tolist() for batch in same]
    assert opened.base_seed == progress.base_seed == same.progress.base_seed
    assert opened.run_seed == plan.seed_source.run_seed == opened.base_seed
    assert (opened.start, opened.skip, opened.first_worker, opened.pipe_seed) == (0, [], 0, None)
    assert list(progress.origins) == [plan.first_epoch] and progress.origins[0]["draws_seed"] is True


def test_a_resumed_first_epoch_goes_on_where_the_state_left_off() -> None:
    loader = shuffled()
    run = iter(loader)
    whole = [next(run).tolist() for _ in range(4)]
    loader = shuffled()
    run = iter(loader)
    next(run), next(run)
    state = loader.state_dict()
    plan = shuffled()._plan(resume=state)
    epochs, progress = opener(plan)
    opened = epochs.open_first(plan)
    assert opened.source is not None
    assert list(opened.source) == whole[2:]
    assert (opened.start, opened.skip, opened.base_seed) == (2, [], state["base_seed"])
    assert progress.origins == {0: state["origin"]} and progress.pending is None


def test_a_state_saved_with_another_generator_is_refused_when_its_epoch_opens() -> None:
    loader = shuffled()
    next(iter(loader))
    state = dict(loader.state_dict(), base_seed=12345)
    plan = shuffled()._plan(resume=state)
    with pytest.raises(ValueError, match="saved with another generator: replaying its draws gave base seed"):
        opener(plan)[0].open_first(plan)


def test_a_torch_pipes_seed_comes_before_a_fresh_base_seed_and_after_a_resumed_one() -> None:
    def stream() -> stoker.DataLoader:
        return stoker.DataLoader(Stream(), batch_size=2, generator=5)

    draws = stream()._plan().seed_source
    first, second = int(draws.seed64()), int(draws.seed64())

    plan = stream()._plan()
    opened = opener(plan)[0].open_first(plan, lambda: int(plan.seed_source.seed64()))
    assert (opened.source, opened.pipe_seed, opened.base_seed) == (None, first, second)

    loader = stream()
    next(iter(loader))
    plan = stream()._plan(resume=loader.state_dict())
    opened = opener(plan)[0].open_first(plan, lambda: int(plan.seed_source.seed64()))
    assert (opened.source, opened.base_seed, opened.pipe_seed, opened.start) == (None, first, second, 1)


def test_a_later_epoch_replays_the_origin_drawn_ahead_for_it_once() -> None:
    plan = shuffled()._plan()
    epochs, progress = opener(plan)
    epochs.open_first(plan)
    progress.user_states[0] = {0: "kept"}
    ahead, _ = predraw(plan.index_sampler, plan.seed_source, draws_seed=False)
    progress.pending = (1, ahead)
    source = epochs.open_next(plan, 1, current=0)  # drawn ahead while epoch 0 still delivers
    assert list(source) == list(open_epoch(plan.index_sampler, plan.seed_source, ahead, 0)[0])
    assert progress.pending is None and list(progress.origins) == [0, 1] and progress.origins[1] is ahead
    assert progress.user_states == {0: {0: "kept"}}

    fresh = epochs.open_next(plan, 2, current=None)  # nothing drawn ahead: drawn now
    assert progress.origins[2]["draws_seed"] is False and list(progress.origins) == [2]
    assert progress.user_states == {}
    assert sorted(i for batch in fresh for i in batch) == list(range(10))


class OwnStateBatches(stoker.BatchSampler):
    """A batch sampler whose state methods are its own, with another meaning: stoker never calls them."""

    def state_dict(self, tag: str) -> dict[str, Any]:  # type: ignore[override]
        raise AssertionError(f"stoker called the batch sampler's own state_dict({tag})")

    def load_state_dict(self, state: dict[str, Any], tag: str) -> None:  # type: ignore[override]
        raise AssertionError(f"stoker called the batch sampler's own load_state_dict({tag})")


def rolling() -> stoker.DataLoader:
    batches = OwnStateBatches(stoker.SequentialSampler(range(10)), 4, last_batch="rollover")
    return stoker.DataLoader(Numbers(10), batch_sampler=batches)


def test_a_rollover_is_kept_and_given_back_through_batch_samplers_own_state() -> None:
    whole = rolling()
    epochs = [[b.tolist() for b in whole] for _ in range(3)]
    assert epochs[:2] == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]]
    loader = rolling()
    list(loader)
    next(iter(loader))  # epoch 1 opens with epoch 0's leftover
    state = loader.state_dict()
    assert state["origin"]["sampler"]["rollover"] == [8, 9]

    resumed = rolling()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == epochs[1][1:]
    assert [b.tolist() for b in resumed] == epochs[2]
