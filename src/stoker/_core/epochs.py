"""Opening an epoch: what a loader iterator hands its scheduler when an epoch begins.

An iterator opens its first epoch when it is made (`EpochOpener.open_first`) and each later
epoch of a map-style dataset when that epoch begins (`open_next`). Opening an epoch does,
in order (a resumed epoch records its origin once its draws are replayed and checked):

1. Record the epoch's origin under its number, what replays its draws and what a state saves
   (`Progress.point`): taken now for a fresh epoch (`resume.capture_epoch`: the random
   streams' states just before it draws), else the saved one (a resumed state's, or one drawn
   ahead, `Progress.pending`, taken once). Origins of epochs already delivered are forgotten.
2. Make the epoch's order: a fresh epoch iterates the index sampler; a saved origin is put
   back (`resume.open_epoch`), which redraws the same order and steps over the batches
   already consumed.
3. Wrap the order: a user's stateful sampler has its state recorded after each batch is drawn
   (`resume.recording`), each batch is cut to the rows this process loads (`take_rows`), and
   a dataset that fetches ahead hears of each batch as it is drawn (`ahead.drawing_ahead`).
4. First epoch only: the workers' base seed, drawn once the sampler's iterator exists, as
   torch draws it (a generator the two share is consumed in torch's order), or the saved one,
   refused when the replayed draws give another. A torch IterDataPipe's shared seed is drawn
   before a fresh base seed and after a resumed one. The run's first base seed is kept for
   per-sample draws (`RandomSource.run_seed`); a resumed state's drawn next epoch waits in
   `Progress.pending`.
5. First epoch only: where the scheduler starts (a resumed state's position, the batches
   delivered after it, the next worker).

An IterableDataset's epoch has no order to draw: its replicas restore their own states (see
engines), and only its origin and base seed are opened here. The iterator keeps the
scheduling: it gives what is opened to its scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .._base.hooks import upcoming_of
from .ahead import MOST_AHEAD, drawing_ahead
from .plan import LoadPlan
from .resume import Progress, capture_epoch, open_epoch, recording, stateful_user_sampler


@dataclass(frozen=True)
class Opened:
    """An iterator's first epoch, opened: what its engine and scheduler start from."""

    source: Iterator[Any] | None  # the epoch's indices; None for an IterableDataset
    base_seed: int  # the workers' base seed
    run_seed: int  # the run's first base seed, kept by per-sample draws in every epoch
    pipe_seed: int | None  # a torch IterDataPipe's shared seed for this epoch
    start: int  # the position the epoch resumes at (0: its start)
    skip: list[int]  # positions past `start` already delivered (out of order)
    first_worker: int  # the worker whose batch comes first


class EpochOpener:
    """Opens one iterator's epochs, keeping their origins in its `Progress`."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress

    def open_first(self, plan: LoadPlan, draw_pipe_seed: Callable[[], int] | None = None) -> Opened:
        """Open the iterator's first epoch, afresh or where `plan.resume` says. `draw_pipe_seed`
        draws a torch IterDataPipe's shared seed (None: the dataset is not one).

        Raises ValueError when replaying the state's draws gives another base seed than the
        state's (another generator), or when the state's random generators are of other kinds
        than this loader's."""
        progress = self._progress
        source, base, pipe_seed = self._first(plan, draw_pipe_seed)
        if draw_pipe_seed is not None and pipe_seed is None:  # resumed: a seed of its own
            pipe_seed = draw_pipe_seed()
        progress.base_seed = base
        # per-sample draws keep the run's first base seed in every epoch, whether this iterator
        # lives on (persistent) or each epoch draws its own, as torch's do (see RandomSource.run_seed)
        if plan.seed_source.run_seed is None:
            plan.seed_source.run_seed = base
        start, skip, first_worker = 0, [], 0
        if plan.resume is not None:
            start, skip = plan.resume["position"], plan.resume.get("delivered_after", [])
            first_worker = (plan.resume.get("replicas") or {}).get("next_worker", 0)
            if plan.iterable and first_worker:  # a state taken now names the same next worker
                progress.last_worker = (first_worker - 1) % max(plan.num_workers, 1)
        return Opened(source, base, plan.seed_source.run_seed, pipe_seed, start, skip, first_worker)

    def _first(
        self, plan: LoadPlan, draw_pipe_seed: Callable[[], int] | None
    ) -> tuple[Iterator[Any] | None, int, int | None]:
        """The first epoch's source, base seed and (fresh) pipe seed."""
        origins = self._progress.origins
        resume = plan.resume
        if plan.iterable:  # the replicas restore their own states (see engines)
            if resume is not None and resume.get("origin") is not None:
                # redraw the base seed, so that the loader's generator goes on as it did
                _, drawn = open_epoch(None, plan.seed_source, resume["origin"], 0, resume.get("drawn", True))
                origins[plan.first_epoch] = resume["origin"]
                base = resume["base_seed"] if resume.get("base_seed") is not None else drawn
                assert base is not None
                return None, int(base), None
            origins[plan.first_epoch] = capture_epoch(None, plan.seed_source, draws_seed=True)
            # torch draws the pipe's shared seed before the base seed
            pipe_seed = draw_pipe_seed() if draw_pipe_seed is not None else None
            return None, int(plan.seed_source.seed64()), pipe_seed
        if resume is None:
            origins[plan.first_epoch] = capture_epoch(plan.index_sampler, plan.seed_source, draws_seed=True)
            source = self._recorded(plan, iter(plan.index_sampler), plan.first_epoch, 0)
            return source, int(plan.seed_source.seed64()), None
        source, drawn = open_epoch(
            plan.index_sampler, plan.seed_source, resume["origin"], resume["position"], resume.get("drawn", True)
        )
        saved = resume.get("base_seed")
        if drawn is not None and saved is not None and drawn != saved:
            raise ValueError(
                "this DataLoader state was saved with another generator: replaying its draws gave "
                f"base seed {drawn}, the state says {saved}; give the loader the generator (seed) "
                "it was saved with"
            )
        origins[plan.first_epoch] = resume["origin"]
        source = self._recorded(plan, source, plan.first_epoch, resume["position"])
        if resume.get("next_origin") is not None:  # the saved run had drawn its next epoch too
            self._progress.pending = (plan.first_epoch + 1, resume["next_origin"])
        base = saved if saved is not None else drawn
        if base is None:  # an epoch whose saved run drew no base seed, in a new iterator
            base = plan.seed_source.seed64()
        return source, int(base), None

    def open_next(self, plan: LoadPlan, number: int, current: int | None) -> Iterator[Any]:
        """Open epoch `number` of a map-style dataset: its indices, replayed from the origin
        drawn ahead for it if any, else drawn now. `current`: the epoch still delivering
        (None: none), whose origin is kept with those after it."""
        progress = self._progress
        origin = progress.take_pending(number)
        if origin is not None:
            source, _ = open_epoch(plan.index_sampler, plan.seed_source, origin, 0)
        else:
            origin = capture_epoch(plan.index_sampler, plan.seed_source, draws_seed=False)
            source = iter(plan.index_sampler)
        for old in [e for e in progress.origins if e < (number if current is None else current)]:
            del progress.origins[old]
            progress.user_states.pop(old, None)
        progress.origins[number] = origin
        return self._recorded(plan, source, number, 0)

    def _recorded(self, plan: LoadPlan, source: Iterator[Any], epoch: int, start: int) -> Iterator[Any]:
        """A user's stateful sampler has its state recorded after each batch is drawn; each
        batch is cut to the rows this process loads (`take_rows`); a dataset that fetches
        ahead (`_base/hooks.py`'s `FetchesAhead`) hears of each batch as it is drawn (ahead)."""
        hook = upcoming_of(plan.dataset)
        user = stateful_user_sampler(plan.index_sampler)
        if user is not None:
            record = self._progress.user_states.setdefault(epoch, {})
            keep = plan.window + 2 + (MOST_AHEAD if hook is not None else 0)
            source = recording(source, user, record, start, keep=keep)
        if plan.take_rows is not None:
            source = map(plan.take_rows, source)
        return source if hook is None else drawing_ahead(source, hook, plan.window)
