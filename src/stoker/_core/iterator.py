"""The loader iterator: epochs, the engine, the scheduler, worker deaths and shutdown.

A `LoaderIterator` is made from a `LoadPlan` (one frozen value the loader builds). Each
`__next__` refills the prefetch window, hands out the next batch the scheduler releases,
and otherwise waits on the engine — in slices, so that a dead worker is seen within a
second and `timeout` is honoured. Opening an epoch (its order, the base seed, the origin a
state saves) is `epochs.EpochOpener`'s; the iterator gives what it opens to its scheduler.

A worker process that dies costs nothing already made: the batches before the first one it
owed are delivered, and then either it is replaced (`max_worker_restarts`: same id and
seed, the batches it owed re-sent, one `WorkerRestartWarning` per restart) or the iterator
raises `WorkerDiedError` at that batch's position, naming it. A batch that kills two
workers in a row is not sent a third time.

With `persistent_workers`, the loader keeps one iterator and `iter(loader)` starts its
next epoch: as in torch, nothing of an epoch is read before its `iter()`, so whatever the
user sets between epochs (`dataset.set_epoch`, `sampler.set_epoch`, an attribute of a
shared object) is seen by the epoch that follows. With `auto_reload=True` the next epoch's
first batches are dispatched as soon as the current epoch's last index has been (next-epoch
prefetch), unless the sampler has `set_epoch`.

The iterator holds no reference to the loader, and its engine is closed by a
`weakref.finalize`, so workers stop when the iterator is exhausted (non-persistent),
dropped, garbage-collected, closed, or at interpreter exit; in a process forked from this
one the finalizer does nothing (see forksafe).

`stats()` gives the epoch's `LoaderStats` (see stats): the time spent inside `iter()` and
`next()` is the consumer's wait, and each batch brings its worker's timing with it.

`num_workers="auto"` (`plan.auto`): the first epoch starts with the inline engine, its first
batches timed and delivered (`auto.Head`); once they are enough, the choice is made and, if
it is workers, the inline engine is swapped for theirs between two batches — nothing is in
flight then — and the scheduler goes on with the rest of the epoch over them.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from .._base.hooks import SetsEpoch, follows
from . import forksafe, hostpin
from .auto import Head
from .datapipes import agreed_seed, distributed_share, is_iter_datapipe, seed_group, seed_pipe
from .engines import Death, Engine, ProcessEngine, SerialEngine, make_engine
from .epochs import EpochOpener
from .errors import ExceptionInfo, WorkerDiedError, WorkerRestartWarning, describe_index
from .pin import PinThread, device_setup, pin_function
from .plan import LoadPlan
from .protocol import Done, Exhausted, Failed, ReplicaBatch, Reset, Task
from .replica import Kept, Record
from .resume import Progress, is_stateful
from .scheduler import Owed, Scheduler
from .stats import EpochBar, LoaderStats, Recorder, clock
from .worker import WorkerProcess

T = TypeVar("T")

WAIT_SLICE_S = 0.5  # longest single wait on the engine; bounds how late a dead thread is seen
_AFRESH = Kept()  # a replica that began its epoch afresh and has delivered nothing yet


class LoaderIterator(Generic[T]):
    """Iterates one loader's batches; with persistent workers, across epochs."""

    def __init__(self, plan: LoadPlan, begun: float | None = None) -> None:
        """`begun`: when the consumer called `iter()` (the clock of `stats`), if earlier than now."""
        begun = clock() if begun is None else begun
        self._plan = plan
        self._progress = Progress(
            None if plan.iterable else plan.index_sampler,
            plan.seed_source,
            plan.persistent,
            num_workers=plan.num_workers,
            replicas={w: kept for w, kept in enumerate(plan.replicas) if kept is not None},
            stateful_map=not plan.iterable and is_stateful(plan.dataset),
            carries=plan.persistent or plan.num_workers == 0 or plan.threads,
        )
        self._replica_of: dict[int, tuple[int, Record]] = {}  # task -> (worker, its replica's record)
        self._finals: dict[int, tuple[int, Record]] = {}  # worker -> (task, its stream's end), until passed
        self._epochs = EpochOpener(self._progress)
        # a torch IterDataPipe: the shared seed of the epoch the workers start (or reset) with
        self._pipe = plan.iterable and is_iter_datapipe(plan.dataset)
        self._pipe_seed: int | None = None
        # with torch.distributed: where the ranks agree on rank 0's seed, and this rank's share
        self._pipe_group = seed_group() if self._pipe else None
        pipe_share = distributed_share() if self._pipe else (1, 0)
        # the first epoch's order, then the workers' base seed, drawn in torch's order (see epochs)
        opened = self._epochs.open_first(plan, self._draw_pipe_seed if self._pipe else None)
        self._base_seed, self._run_seed, self._pipe_seed = opened.base_seed, opened.run_seed, opened.pipe_seed
        self._broken: BaseException | None = None
        self._yielded = 0
        self._restarts = 0
        self._last_killer: dict[int, int] = {}  # worker id -> task it owed when it last died
        self._prefetch_next = _prefetches_next(plan)
        pin = pin_function(plan.pin_memory_device, stacklevel=4) if plan.pin_memory else None
        self._pin_given = pin
        # what a pin step runs: nothing in a slot registered with CUDA comes out (see hostpin)
        self._pin = None if pin is None else hostpin.copying_out(pin, plan.arena)
        # torch pins inline with num_workers=0 and on a pin thread with workers; so do we
        self._pin_inline = self._pin if plan.num_workers == 0 else None
        self._pinner: PinThread | None = None  # started after the workers (_start_pinning)
        # batches born pinned in a registered arena slot skip the pin thread: with
        # pin_memory="born", or in an epoch that to_device consumes (see hostpin)
        self._born = plan.pin_in_place
        self._registry: hostpin.Registry | None = None
        self._unpinned: set[int] = set()  # tasks handed to the pin thread
        self._in_place: set[int] = set()  # tasks born pinned, not handed to it
        self._head = Head(plan.auto) if plan.auto is not None else None
        self._engine: Engine = make_engine(plan, self._base_seed, self._pipe_seed, pipe_share, run_seed=self._run_seed)
        if isinstance(self._engine, SerialEngine) and plan.auto is None:  # the loader's own dataset
            self._progress.live = self._engine.go_live()
        # one Recorder for the iterator's life, counting each epoch afresh (see _begin_stats)
        self._recorder = (
            Recorder(plan.first_epoch, plan.num_workers, plan.prefetch_factor, plan.threads, [], plan.choice)
            if plan.stats
            else None
        )
        self._running = _Running(self._engine, None)  # what the finalizer stops
        self._close = forksafe.finalize(self, _shut_down, self._running, self._progress, self._recorder)
        self._engine.start()
        if self._pipe and plan.num_workers > 0:
            # torch draws one more shared seed as it primes its workers, for the main
            # process's copy: drawn here too, so that the generator goes on as torch's does
            self._new_pipe_seed()
        self._start_pinning()  # after the workers fork, as torch: no stoker thread is forked
        iterable_index: dict[str, Any] = {}
        if plan.iterable:
            iterable_index["iterable_index"] = plan.batch_size if plan.auto_collation else None
        workers = max(plan.num_workers, 1)
        self._scheduler = Scheduler(workers, plan.window, plan.in_order, first_epoch=plan.first_epoch, **iterable_index)
        self._scheduler.begin_epoch(
            opened.source, start=opened.start, skip=opened.skip, first_worker=opened.first_worker
        )
        self._progress.scheduler = self._scheduler
        self._bar: EpochBar | None = None
        self._begin_stats(plan.first_epoch, begun)
        self._pump()
        if self._recorder is not None:
            self._recorder.wait_s += clock() - begun

    # --------------------------------------------------------------- epochs
    def usable(self) -> bool:
        """The workers are running and no error has broken this iterator."""
        return self._broken is None and self._close.alive

    def start_next_epoch(self, begun: float | None = None, len_called: int | None = None) -> None:
        """`iter(loader)` again on a persistent loader: start (or adopt) the next epoch.
        `len_called`: `len(dataset)` as `len(loader)` last read it (None: not read), which
        the length warning of this epoch compares with, as torch re-reads it each epoch."""
        begun = clock() if begun is None else begun
        self._yielded = 0
        self._plan = replace(self._plan, len_called=len_called)
        scheduler = self._scheduler
        if scheduler.current_epoch is not None and self._started_current:
            dropped = scheduler.abandon_epoch()  # dropped half-way: its results are discarded
            for task_id in dropped:
                self._replica_of.pop(task_id, None)
            if self._pinner is not None:
                for task_id in dropped:
                    self._in_place.discard(task_id)
                    if task_id in self._unpinned:
                        self._unpinned.discard(task_id)
                        self._pinner.discard(task_id)
        self._born = self._plan.pin_in_place  # until to_device asks again (allow_born_pinned)
        if scheduler.current_epoch is None:
            self._begin_epoch()
        self._apply_finals()
        self._finals.clear()
        self._progress.next_epoch()  # the replicas' places in the epoch now delivering
        self._started_current = True
        self._stop_stats()
        self._begin_stats(scheduler.current_epoch, begun)
        self._pump()
        if self._recorder is not None:
            self._recorder.wait_s += clock() - begun

    def _begin_epoch(self) -> None:
        plan = self._plan
        scheduler = self._scheduler
        if plan.iterable:
            if self._pipe:  # each epoch's Reset carries its shared seed (see _pump)
                self._new_pipe_seed()
            scheduler.begin_epoch(None, reset_workers=True)
            return
        scheduler.begin_epoch(self._epochs.open_next(plan, scheduler.next_epoch_number, scheduler.current_epoch))

    @property
    def _workers(self) -> list[WorkerProcess]:
        """torch's private list of the iterator's worker processes, as read-only handles
        (`WorkerProcess`: pid, is_alive(), join(), exitcode), valid also after the workers
        stopped; empty for thread workers and num_workers=0."""
        engine = self._engine
        return engine.handles() if isinstance(engine, ProcessEngine) else []

    @property
    def progress(self) -> Progress:
        """How far this iterator got; its loader keeps it for `state_dict()`."""
        return self._progress

    @property
    def _started_current(self) -> bool:
        return self._progress.started

    @_started_current.setter
    def _started_current(self, value: bool) -> None:
        self._progress.started = value

    # ------------------------------------------------------------- iteration
    def __iter__(self) -> LoaderIterator[T]:
        return self

    def __len__(self) -> int:
        return len(self._plan.index_sampler)

    def __next__(self) -> T:
        recorder = self._recorder
        if recorder is None:
            return self._next()
        entered = clock()
        try:
            return self._next()
        finally:
            recorder.leave_next(entered)

    def _next(self) -> T:
        if self._broken is not None:
            raise RuntimeError(
                "this DataLoader iterator was shut down after an earlier error and cannot "
                "continue; create a new one with iter(loader)"
            ) from self._broken
        if not self._started_current:
            raise StopIteration
        scheduler = self._scheduler
        deadline = time.monotonic() + self._plan.timeout if self._plan.timeout > 0 else None
        while True:
            self._await_pin()
            got = scheduler.deliver()
            if got is not None:
                if self._head is not None:
                    self._measure(got[1])
                self._pump()
                if self._head is not None and scheduler.current_finished():
                    # a short first epoch's last batch: a consumer that stops after len(loader)
                    # batches (Lightning's loops) never asks for the StopIteration below
                    self._choose(start_workers=False)
                return self._hand_out(*got)
            if scheduler.current_finished():
                if self._head is not None:  # a short first epoch: the next one uses the choice
                    self._choose(start_workers=False)
                self._end_epoch()
                raise StopIteration
            self._pump()
            self._wait(deadline)

    def _measure(self, reply: Any) -> None:
        """An inline batch of an "auto" epoch is being delivered: time it, and choose when
        enough are timed."""
        head = self._head
        assert head is not None
        head.add(reply.work if isinstance(reply, Done) else None)
        if head.done():
            self._choose(start_workers=True)

    def _choose(self, start_workers: bool) -> None:
        """Make the "auto" choice, tell the loader, and (`start_workers`) move the rest of
        the epoch to the chosen workers. Nothing is in flight: the window was one batch,
        and it was just delivered."""
        head, self._head = self._head, None
        assert head is not None
        auto = head.start
        choice = head.decide()
        if self._recorder is not None:
            self._recorder.choice = choice.reason
        n = choice.num_workers
        if n == 0 or not start_workers:  # this iterator ends its epoch inline
            self._plan = replace(self._plan, choice=choice.reason, auto=None)
            auto.on_choice(choice, None)
            return
        prefetch = choice.prefetch_factor
        plan = self._plan = replace(
            self._plan,
            num_workers=n,
            window=max(1, (prefetch or 1) * n),
            persistent=auto.persistent,
            arena=None if self._plan.threads else auto.arena,
            prefetch_factor=prefetch,
            choice=choice.reason,
            auto=None,
        )
        auto.on_choice(choice, self)
        self._engine.close()
        engine = self._engine = self._running.engine = make_engine(plan, self._base_seed, run_seed=self._run_seed)
        self._prefetch_next = _prefetches_next(plan)
        try:
            engine.start()
        except BaseException as exc:  # e.g. a dataset that spawn cannot pickle
            self._fail(exc)
        if self._pin_given is not None:
            self._pin = hostpin.copying_out(self._pin_given, plan.arena)
            self._pin_inline = None
            self._start_pinning()
        self._scheduler.resize(n, plan.window)
        if self._recorder is not None:
            self._recorder.workers_changed(n, prefetch, [engine.pid(w) for w in range(n)])

    def _pump(self) -> None:
        """Top up the prefetch window, opening the next epoch early when allowed."""
        scheduler = self._scheduler
        if (
            self._prefetch_next
            and scheduler.dispatching_done()
            and not scheduler.has_prefetched_epoch()
            and scheduler.current_epoch is not None
        ):
            self._begin_epoch()
        engine = self._engine
        for worker_id, message in scheduler.dispatch():
            if self._pipe and isinstance(message, Reset):
                message = Reset(self._pipe_seed)
            engine.send(worker_id, message)

    def _new_pipe_seed(self) -> None:
        """Draw a torch IterDataPipe's next shared seed, and seed the main process's copy
        with it, as torch's loader does at each epoch (see datapipes)."""
        self._pipe_seed = self._draw_pipe_seed()
        seed_pipe(self._plan.dataset, self._pipe_seed)

    def _draw_pipe_seed(self) -> int:
        return agreed_seed(int(self._plan.seed_source.seed64()), self._pipe_group)

    def _wait(self, deadline: float | None) -> None:
        engine = self._engine
        try:
            while True:
                wait = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
                replies = engine.poll(max(wait, 0.0))
                self._take(replies)
                deaths = engine.dead()
                for death in deaths:
                    self._on_death(death)
                if replies or deaths:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    waiting = self._scheduler.waiting_for()
                    if waiting is not None and waiting.worker_id is not None:
                        engine.stuck(waiting.worker_id)
                    raise RuntimeError(self._timeout_message())
        except (KeyboardInterrupt, SystemExit, GeneratorExit) as exc:
            self._fail(exc)

    def _take(self, replies: list[tuple[int, Any]]) -> None:
        """Hand the replies that arrived to the scheduler (and the pin thread)."""
        for worker_id, reply in replies:
            if isinstance(reply, Done) and isinstance(reply.payload, ReplicaBatch):
                carried = reply.payload
                self._replica_of[reply.task_id] = (worker_id, carried.record)
                reply = Done(reply.task_id, carried.batch, reply.work)
            elif isinstance(reply, Exhausted) and reply.record is not None:
                self._finals[worker_id] = (reply.task_id, reply.record)
            if self._recorder is not None and isinstance(reply, Done) and reply.work is not None:
                self._recorder.received(worker_id, reply.work)
            kept = self._scheduler.complete(worker_id, reply)
            if kept and self._pinner is not None and isinstance(reply, Done):
                if self._born_in_place(reply.payload):
                    self._in_place.add(reply.task_id)
                else:
                    self._unpinned.add(reply.task_id)
                    self._pinner.submit(reply.task_id, reply.payload)  # pinned while we wait

    # -------------------------------------------------------------- pinning
    def _start_pinning(self) -> None:
        """The pin thread (and, born pinned, the arena's registration with CUDA), once the
        workers have started: as torch, no stoker thread exists when they fork."""
        if self._pin is None or self._plan.num_workers == 0:
            return
        self._pinner = self._running.pinner = PinThread(self._pin, init=device_setup())
        if self._born:
            self._registry = _pinned_arena(self._plan.arena)

    def allow_born_pinned(self) -> None:
        """The consumer of this epoch keeps each batch until its copy to the device has
        completed (stoker's `to_device`): hand batches out born pinned in the arena when they
        are, until the next `iter()` (see hostpin). Nothing changes without `pin_memory`."""
        if self._pin is None or self._born:
            return
        self._born = True
        if self._pinner is not None and self._registry is None:
            self._registry = _pinned_arena(self._plan.arena)

    def _born_in_place(self, batch: Any) -> bool:
        registry = self._registry
        if not self._born or registry is None:
            return False
        # to_device passes numpy arrays on as they are: then they must not view a slot either
        return registry.born_pinned(batch, strict=not self._plan.pin_in_place)

    def _await_pin(self) -> None:
        """Wait for the pin thread to pin the batch `deliver()` gives next, before it is
        delivered: Ctrl-C during the wait leaves it pending, for the next `next()` (and out of
        `state_dict()`'s position)."""
        if self._pinner is None or not self._unpinned:
            return
        upcoming = self._scheduler.upcoming()
        if isinstance(upcoming, Done) and upcoming.task_id in self._unpinned:
            self._pinner.wait(upcoming.task_id)

    def _fail(self, exc: BaseException) -> None:
        """Shut the workers down and make the iterator refuse further use, then raise."""
        self._broken = exc
        self._stop_stats()
        self._close()
        raise exc

    # ---------------------------------------------------------- worker deaths
    def _on_death(self, death: Death) -> None:
        """Replace the dead worker and re-send what it owed, or make its first owed batch
        raise at its position."""
        plan = self._plan
        worker_id = death.worker_id
        owed = self._scheduler.owed(worker_id)
        reason = ""
        if self._plan.threads:
            reason = "; a thread worker ended without being asked (an error inside stoker)"
        elif plan.max_worker_restarts > 0 and self._engine.can_restart:
            if self._restarts >= plan.max_worker_restarts:
                reason = f"; max_worker_restarts={plan.max_worker_restarts} restarts were already used"
            elif plan.iterable:
                reason = (
                    "; it was not restarted: a restarted worker cannot resume its IterableDataset "
                    "replica's stream (max_worker_restarts works for map-style datasets)"
                )
            elif owed and self._last_killer.get(worker_id) == owed[0].task_id:
                self._restarts += 1
                reason = (
                    "; this batch's fetch killed two workers in a row, so it is not sent a third "
                    f"time (death {self._restarts} of max_worker_restarts={plan.max_worker_restarts})"
                )
            else:
                self._restart(death, owed)
                return
        self._scheduler.lose_worker(worker_id, lambda task: self._death_reply(death, task, reason))

    def _restart(self, death: Death, owed: list[Owed]) -> None:
        self._restarts += 1
        worker_id = death.worker_id
        new_pid = self._engine.restart(worker_id)
        if self._recorder is not None:
            self._recorder.restarts[worker_id] += 1
            self._recorder.pids[worker_id] = new_pid
        if owed:
            self._last_killer[worker_id] = owed[0].task_id
        for task in owed:
            self._engine.send(worker_id, Task(task.task_id, task.index, task.epoch, task.batch))
        if owed:
            first = owed[0]
            resent = (
                f"re-sent {len(owed)} batch(es) from batch {first.batch} of epoch {first.epoch} "
                f"({describe_index(first.index, False).removeprefix('while fetching ')})"
            )
        else:
            resent = "it owed no batch"
        warnings.warn(
            f"{_died(death)}; restarted it as pid {new_pid} "
            f"(restart {self._restarts} of max_worker_restarts={self._plan.max_worker_restarts}) "
            f"and {resent}",
            WorkerRestartWarning,
            stacklevel=6,  # the user's next()
        )

    def _death_reply(self, death: Death, task: Owed, reason: str) -> Failed:
        iterable = self._plan.iterable
        detail = f" {describe_index(task.index, iterable)} (batch {task.batch} of epoch {task.epoch}){reason}"
        error = WorkerDiedError(death.worker_id, death.pid, death.exitcode, detail, batch=task.batch, index=task.index)
        return Failed(task.task_id, ExceptionInfo.unchanged(error))

    def _timeout_message(self) -> str:
        message = f"DataLoader timed out after {self._plan.timeout:g} seconds"
        waiting = self._scheduler.waiting_for()
        if waiting is not None:
            message += f" waiting for batch {waiting.batch} of epoch {waiting.epoch}"
            if waiting.worker_id is not None:
                message += f" from worker {waiting.worker_id}"
                pid = self._engine.pid(waiting.worker_id)
                if pid is not None:
                    message += f" (pid {pid})"
            if waiting.index is not None or self._plan.iterable:
                message += f", {describe_index(waiting.index, self._plan.iterable)}"
        return message

    # ---------------------------------------------------------------- batches
    def _hand_out(self, index: Any, reply: Any) -> T:
        if isinstance(reply, Failed):
            error = reply.error.rebuild()
            if isinstance(error, WorkerDiedError):
                self._fail(error)
            raise error
        assert isinstance(reply, Done)
        replica = self._replica_of.pop(reply.task_id, None)
        if replica is not None:  # this replica has now given the consumer this far
            self._move_replica(*replica)
            if self._plan.iterable:
                self._progress.last_worker = replica[0]
            if self._finals:
                self._apply_finals()
        self._yielded += 1
        recorder = self._recorder
        if recorder is not None and reply.work is not None:
            recorder.delivered(reply.work)
        if self._bar is not None:
            self._bar.advance(recorder)
        self._warn_if_longer_than_reported()
        if self._pinner is not None:
            if reply.task_id in self._unpinned:
                self._unpinned.discard(reply.task_id)
                return self._pinner.take(reply.task_id)  # pinned already (_await_pin)
            if reply.task_id in self._in_place:
                self._in_place.discard(reply.task_id)
                if self._born:
                    return reply.payload
            # born pinned in an epoch to_device consumed, or made before the pin thread began
            assert self._pin is not None
            return self._pin(reply.payload)
        if self._pin_inline is not None:
            return self._pin_inline(reply.payload)
        return reply.payload

    def _warn_if_longer_than_reported(self) -> None:
        """torch's warning, word for word and at torch's threshold: once `len(loader)` has
        been read (before this epoch's `iter()`), each batch past `len(dataset)` warns.
        torch counts batches against the dataset's length in samples, and so does this."""
        plan = self._plan
        if not plan.iterable or plan.len_called is None or self._yielded <= plan.len_called:
            return
        message = (
            f"Length of IterableDataset {plan.dataset} was reported to be {plan.len_called}"
            f"(when accessing len(dataloader)), but {self._yielded} samples have been fetched. "
        )
        if plan.num_workers > 0:
            message += (
                "For multiprocessing data-loading, this could be caused by not properly configuring the "
                "IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
            )
        warnings.warn(message, stacklevel=5)  # the user's next()

    def _move_replica(self, worker_id: int, record: Record) -> None:
        replicas = self._progress.replicas
        replicas[worker_id] = replicas.get(worker_id, _AFRESH).after(record)

    def _apply_finals(self) -> None:
        """A replica's stream end counts once every batch it made before it was delivered."""
        for worker_id, (task_id, record) in list(self._finals.items()):
            if not any(w == worker_id and t < task_id for t, (w, _) in self._replica_of.items()):
                del self._finals[worker_id]
                self._move_replica(worker_id, record)

    def _end_epoch(self) -> None:
        self._apply_finals()
        self._stop_stats(at_return=True)
        self._scheduler.finish_epoch()
        self._started_current = False
        if self._plan.arena is not None:  # no slot order may come for a while: settle now
            self._plan.arena.settle()
        if not self._plan.persistent:
            self._close()

    # --------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Stop the workers now; later `next()` calls end the iteration. The loader's
        `state_dict()` still gives the position reached."""
        self._progress.freeze()
        self._started_current = False
        self._stop_stats()
        self._close()

    def _shutdown_workers(self) -> None:
        """torch's private name for `close()`, which torch's own tests (and some users) call on
        a persistent loader's `_iterator` before dropping it."""
        self.close()

    # ------------------------------------------------------------ statistics
    def stats(self) -> LoaderStats:
        """The figures of the epoch this iterator is delivering (or delivered last), since
        the `iter()` that began it. Raises RuntimeError for a loader made with `stats=False`."""
        if self._recorder is None:
            raise RuntimeError(
                "this DataLoader was made with stats=False, so its iterator keeps no "
                "statistics; make it with stats=True (the default) to read stats()"
            )
        if not self.usable():
            return self._recorder.snapshot(0)
        if self._started_current and self._plan.num_workers > 0:
            self._take(self._engine.poll(0))  # what has arrived counts as ready (deaths: next())
        return self._recorder.snapshot(self._scheduler.ready_count())

    @property
    def recorder(self) -> Recorder | None:
        """The running totals behind `stats()` (its loader keeps them for `loader.stats()`)."""
        return self._recorder

    def _begin_stats(self, epoch: int | None, begun: float) -> None:
        plan = self._plan
        recorder = self._recorder
        if recorder is None:
            return
        engine = self._engine
        if plan.num_workers == 0:
            pids: list[int | None] = [os.getpid()]
        else:
            pids = [engine.pid(w) for w in range(plan.num_workers)]
        number = plan.first_epoch if epoch is None else epoch
        recorder.begin(number, begun, pids)
        if plan.progress:
            total = _length(plan.index_sampler) if not plan.iterable else None
            self._bar = EpochBar(total, number)

    def _stop_stats(self, at_return: bool = False) -> None:
        """The epoch's clock stops now, or (`at_return`: the epoch ended inside next()) when
        that next() returns, so that elapsed time covers all the time spent inside it."""
        if self._recorder is not None:
            if at_return:
                self._recorder.ending = True
            else:
                self._recorder.stop()
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.close(self._recorder)


@dataclass
class _Running:
    """The engine and pin thread an iterator runs now ("auto" replaces both once)."""

    engine: Engine
    pinner: PinThread | None


def _shut_down(running: _Running, progress: Progress, recorder: Recorder | None) -> None:
    """The one shutdown procedure: the position is kept (without the batches in flight),
    the statistics' clock stops, then the workers and the pin thread stop."""
    progress.freeze()
    if recorder is not None and not recorder.ending:  # an epoch that ended stops at its next()'s return
        recorder.stop()
    try:
        running.engine.close()
    finally:
        if running.pinner is not None:
            running.pinner.close()


def _length(sized: Any) -> int | None:
    try:
        return len(sized)
    except TypeError:
        return None


def _died(death: Death) -> str:
    return str(WorkerDiedError(death.worker_id, death.pid, death.exitcode))


def _pinned_arena(arena: Any) -> hostpin.Registry | None:
    """`arena`'s registry of slots registered with CUDA (registering them from now on), or
    None without an arena or CUDA."""
    if arena is None:
        return None
    registrar = hostpin.cuda_registrar()
    if registrar is None:
        return None
    registry: hostpin.Registry = arena.pin(registrar)
    return registry


def _prefetches_next(plan: LoadPlan) -> bool:
    """Whether the next epoch is dispatched before `iter()` asks for it: only with
    `auto_reload=True`, and never past a sampler's `set_epoch`, which must come first."""
    return plan.persistent and plan.auto_reload and not _has_set_epoch(plan.index_sampler)


def _has_set_epoch(index_sampler: Any) -> bool:
    inner = getattr(index_sampler, "sampler", None)
    return follows(index_sampler, SetsEpoch) or follows(inner, SetsEpoch)
