"""Which batch goes to which worker, how far ahead, and in what order batches come out.

Pure logic: no threads, no processes, no I/O. Every engine (serial, threads, processes) is
driven by this one scheduler through three calls:

    dispatch()        -> [(worker_id, Task | Reset), ...]   fill the prefetch window
    complete(wid, r)  <- a worker's reply (Done, Failed or Exhausted)
    deliver()         -> the next reply to hand to the user, or None if it has not arrived

Task ids are global and increase across epochs. An epoch's tasks are contiguous, so
in-order delivery walks ids one by one; `in_order=False` hands out whatever has arrived.
At most `window` tasks are dispatched and not yet delivered, across all epochs, so the
next epoch's first tasks (next-epoch prefetch) share the window with the current one's last.

Map-style epochs read their task indices from the batch sampler's iterator; the epoch's
last task id is known when that iterator ends. Iterable epochs send every active worker
tasks round-robin until each has answered `Exhausted`; its last id is known when the last
worker is.

Worker choice, in order: batch b of every epoch goes to worker b mod num_workers (as
torch; per-worker RNG streams make the assignment visible in augmentations), also for a
persistent loader's prefetched next epoch; iterable epochs go round-robin over the active
replicas, restarted at worker 0 each epoch. `in_order=False`: least-loaded first, so a
slow sample does not hold up the others.

A worker that is lost (`lose_worker`: it died and is not replaced) answers every task it
owed, and every task it would have been given, with the failure the caller supplies; from
the first such failure on, nothing more is dispatched. In order, the failure is delivered
at its task's position, after every earlier batch; with `in_order=False`, after every
batch still in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .protocol import Done, Exhausted, Failed, Reply, Request, Reset, Task

_NOT_ARRIVED = object()


@dataclass
class _Epoch:
    number: int
    source: Iterator[Any] | None  # map-style: the index sampler's iterator
    first_id: int
    reset_workers: bool
    end_id: int | None = None  # one past the epoch's last task id, once known
    active: set[int] = field(default_factory=set)  # iterable: workers still producing
    unresolved: set[int] = field(default_factory=set)
    ready: dict[int, Reply] = field(default_factory=dict)
    deferred: dict[int, Reply] = field(default_factory=dict)  # in_order=False: lost workers' failures
    next_id: int = 0  # in order: the next task id to deliver or skip
    next_number: int = 0  # the position in the epoch of the next batch dispatched
    skip: set[int] = field(default_factory=set)  # positions not to dispatch (delivered before a resume)
    prefix: int = 0  # positions below this are all delivered
    beyond: set[int] = field(default_factory=set)  # delivered positions above the prefix
    delivered: int = 0
    discarded: bool = False

    def finished(self) -> bool:
        return self.end_id is not None and not self.unresolved and not self.ready and not self.deferred


@dataclass(frozen=True)
class Owed:
    """A task a worker was sent and has not answered."""

    task_id: int
    index: Any
    epoch: int
    batch: int  # its position in the epoch


@dataclass(frozen=True)
class Waiting:
    """The task the consumer is blocked on, for timeout messages."""

    task_id: int
    worker_id: int | None
    index: Any
    epoch: int
    batch: int


class Scheduler:
    """The prefetch window, worker assignment and delivery order of a loader iterator."""

    def __init__(
        self,
        num_workers: int,
        window: int,
        in_order: bool = True,
        iterable_index: Any = _NOT_ARRIVED,
        first_epoch: int = 0,
    ) -> None:
        if num_workers < 1 or window < 1:
            raise ValueError("Scheduler needs at least one worker and a window of at least 1")
        self.num_workers = num_workers
        self.window = window
        self.in_order = in_order
        self.iterable = iterable_index is not _NOT_ARRIVED
        self._iterable_index = None if not self.iterable else iterable_index
        self._next_task_id = 0
        self._epochs: list[_Epoch] = []  # [delivering, (prefetching)]
        self._epoch_of: dict[int, _Epoch] = {}
        self._owner: dict[int, int] = {}
        self._index: dict[int, Any] = {}
        self._number: dict[int, int] = {}  # task id -> its position in its epoch
        self._load = [0] * num_workers
        self._rr = 0
        self._in_flight = 0
        self._epoch_count = first_epoch  # epochs are numbered over the loader's life
        self._lost: dict[int, Callable[[Owed], Reply]] = {}
        self._halted = False  # a lost worker's failure is queued: dispatch nothing more

    # ------------------------------------------------------------------ epochs
    def begin_epoch(
        self,
        source: Iterator[Any] | None = None,
        reset_workers: bool = False,
        start: int = 0,
        skip: Iterable[int] = (),
        first_worker: int = 0,
    ) -> int:
        """Queue a new epoch; map-style epochs take the index sampler's iterator.

        A resumed epoch starts at position `start` (its source yields the batches from
        there on) and steps over the positions in `skip` (delivered out of order before)."""
        if self.iterable != (source is None):
            raise ValueError("map-style epochs need an index source; iterable epochs take none")
        if self._epochs and self._epochs[-1].end_id is None:
            raise RuntimeError("the previous epoch is still being dispatched")
        epoch = _Epoch(self._epoch_count, source, self._next_task_id, reset_workers)
        epoch.next_id = epoch.first_id
        epoch.next_number = epoch.prefix = epoch.delivered = start
        epoch.skip = set(skip)
        epoch.beyond = set(epoch.skip)  # delivered before the resume: a state taken now keeps them
        if self.iterable:
            epoch.active = set(range(self.num_workers))
            self._rr = first_worker % self.num_workers
        self._epoch_count += 1
        self._epochs.append(epoch)
        return epoch.number

    @property
    def next_epoch_number(self) -> int:
        """The number the next `begin_epoch` will give."""
        return self._epoch_count

    @property
    def current_epoch(self) -> int | None:
        return self._epochs[0].number if self._epochs else None

    def dispatching_done(self) -> bool:
        """Every task of the newest epoch has been dispatched (its last index is read)."""
        return not self._epochs or self._epochs[-1].end_id is not None

    def has_prefetched_epoch(self) -> bool:
        return len(self._epochs) > 1

    def current_finished(self) -> bool:
        """The delivering epoch has handed out every batch it will produce."""
        return bool(self._epochs) and self._epochs[0].finished()

    def finish_epoch(self) -> None:
        """Retire the delivering epoch once it is finished."""
        if not self.current_finished():
            raise RuntimeError("the current epoch is not finished")
        self._epochs.pop(0)

    def abandon_epoch(self) -> list[int]:
        """Drop the delivering epoch half-way: nothing more is dispatched or delivered for it.
        Returns the task ids of the replies that had arrived and are now dropped."""
        if not self._epochs:
            return []
        epoch = self._epochs.pop(0)
        dropped = sorted(epoch.ready)
        epoch.discarded = True
        if epoch.end_id is None:
            epoch.end_id = self._next_task_id
            epoch.source = None
        self._in_flight -= len(epoch.ready) + len(epoch.unresolved) + len(epoch.deferred)
        epoch.ready.clear()
        epoch.deferred.clear()
        return dropped

    def resize(self, num_workers: int, window: int) -> None:
        """Go on with another number of workers and window (num_workers="auto" moving from
        inline to workers); only when no task is outstanding. Batch b still goes to worker
        b mod num_workers."""
        if num_workers < 1 or window < 1:
            raise ValueError("Scheduler needs at least one worker and a window of at least 1")
        if self._owner:
            raise RuntimeError("cannot change the workers while tasks are outstanding")
        self.num_workers = num_workers
        self.window = window
        self._load = [0] * num_workers
        self._rr = 0

    # ---------------------------------------------------------------- dispatch
    def dispatch(self) -> list[tuple[int, Request]]:
        """Tasks (and resets) to send now, as (worker_id, message)."""
        out: list[tuple[int, Request]] = []
        if not self._epochs or self._halted:
            return out
        epoch = self._epochs[-1]
        if epoch.end_id is not None:
            return out
        if epoch.reset_workers:
            epoch.reset_workers = False
            out.extend((w, Reset()) for w in range(self.num_workers))
        while self._in_flight < self.window:
            number = epoch.next_number
            if epoch.source is not None:
                try:
                    index = next(epoch.source)
                    while number in epoch.skip:
                        epoch.skip.discard(number)
                        index = next(epoch.source)
                        number += 1
                except StopIteration:
                    epoch.end_id = self._next_task_id
                    epoch.source = None
                    break
                worker = self._pick_worker(epoch, number)
                assert worker is not None
            else:
                worker = self._pick_worker(epoch, number)
                if worker is None:
                    break
                index = self._iterable_index
            epoch.next_number = number + 1
            task_id = self._next_task_id
            self._next_task_id += 1
            self._epoch_of[task_id] = epoch
            self._owner[task_id] = worker
            self._index[task_id] = index
            self._number[task_id] = number
            self._load[worker] += 1
            self._in_flight += 1
            epoch.unresolved.add(task_id)
            if worker in self._lost:
                self._fail_task(task_id, self._lost[worker])
                break
            out.append((worker, Task(task_id, index, epoch.number, number)))
        return out

    def _pick_worker(self, epoch: _Epoch, number: int) -> int | None:
        candidates = epoch.active if self.iterable else None
        if candidates is not None and not candidates:
            return None
        n = self.num_workers
        if self.in_order and not self.iterable:
            return number % n
        if self.in_order:
            for step in range(n):
                worker = (self._rr + step) % n
                if candidates is None or worker in candidates:
                    self._rr = (worker + 1) % n
                    return worker
            return None
        pool = range(n) if candidates is None else sorted(candidates)
        return min(pool, key=lambda w: (self._load[w], (w - self._rr) % n))

    # ----------------------------------------------------------------- replies
    def complete(self, worker_id: int, reply: Reply) -> bool:
        """Record a worker's reply to one of its tasks; False when it is dropped (its epoch
        was abandoned, or it carries no batch)."""
        task_id = reply.task_id
        epoch = self._epoch_of.pop(task_id, None)
        if epoch is None:
            raise ValueError(f"reply for unknown task {task_id} from worker {worker_id}")
        owner = self._owner.pop(task_id)
        if owner != worker_id:
            raise ValueError(f"task {task_id} belongs to worker {owner}, not worker {worker_id}")
        self._load[owner] -= 1
        epoch.unresolved.discard(task_id)
        if isinstance(reply, Exhausted):
            if self.iterable and owner in epoch.active:
                epoch.active.discard(owner)
                if not epoch.active and epoch.end_id is None:
                    epoch.end_id = self._next_task_id
            if not epoch.discarded and self.in_order:
                epoch.ready[task_id] = reply  # a gap that in-order delivery steps over
                return False
            if not epoch.discarded:
                self._in_flight -= 1
            self._index.pop(task_id, None)
            self._number.pop(task_id, None)
            return False
        if epoch.discarded:  # its share of the window was released when it was abandoned
            self._index.pop(task_id, None)
            self._number.pop(task_id, None)
            return False
        epoch.ready[task_id] = reply
        return True

    # ---------------------------------------------------------------- delivery
    def deliver(self) -> tuple[Any, Reply] | None:
        """The next (index, reply) for the consumer, or None if it has not arrived yet."""
        if not self._epochs:
            return None
        epoch = self._epochs[0]
        while True:
            if self.in_order:
                reply = epoch.ready.pop(epoch.next_id, None)
                if reply is None:
                    return None
                epoch.next_id += 1
            elif epoch.ready:
                reply = epoch.ready.pop(min(epoch.ready))
            elif epoch.deferred and not epoch.unresolved:
                reply = epoch.deferred.pop(min(epoch.deferred))
            else:
                return None
            self._in_flight -= 1
            index = self._index.pop(reply.task_id, None)
            number = self._number.pop(reply.task_id, None)
            if isinstance(reply, Exhausted):
                continue
            epoch.delivered += 1
            if number == epoch.prefix:
                epoch.prefix += 1
                while epoch.prefix in epoch.beyond:
                    epoch.beyond.discard(epoch.prefix)
                    epoch.prefix += 1
            elif number is not None:
                epoch.beyond.add(number)
            return index, reply

    def upcoming(self) -> Reply | None:
        """The reply `deliver()` would return now, left undelivered; None if it has not arrived."""
        if not self._epochs:
            return None
        epoch = self._epochs[0]
        if self.in_order:
            task_id = epoch.next_id
            while isinstance(epoch.ready.get(task_id), Exhausted):
                task_id += 1
            return epoch.ready.get(task_id)
        if epoch.ready:
            return epoch.ready[min(epoch.ready)]
        if epoch.deferred and not epoch.unresolved:
            return epoch.deferred[min(epoch.deferred)]
        return None

    def position(self) -> tuple[int, list[int]]:
        """How far the consumer got in the delivering epoch: every position below the first
        value was delivered, and so were those listed (out of order, above it)."""
        if not self._epochs:
            return 0, []
        epoch = self._epochs[0]
        return epoch.prefix, sorted(epoch.beyond)

    # ------------------------------------------------------------ lost workers
    def owed(self, worker_id: int) -> list[Owed]:
        """What a worker was sent and has not answered, oldest first."""
        return [
            Owed(task_id, self._index.get(task_id), self._epoch_of[task_id].number, self._batch_of(task_id))
            for task_id in self.outstanding(worker_id)
        ]

    def lose_worker(self, worker_id: int, failure: Callable[[Owed], Reply]) -> None:
        """The worker is gone for good: each task it owes, and each it would be given,
        is answered with `failure(owed)`."""
        self._lost[worker_id] = failure
        for task_id in self.outstanding(worker_id):
            self._fail_task(task_id, failure)

    def _fail_task(self, task_id: int, failure: Callable[[Owed], Reply]) -> None:
        epoch = self._epoch_of.pop(task_id)
        owed = Owed(task_id, self._index.get(task_id), epoch.number, self._batch_of(task_id))
        owner = self._owner.pop(task_id)
        self._load[owner] -= 1
        epoch.unresolved.discard(task_id)
        if epoch.discarded:
            self._index.pop(task_id, None)
            self._number.pop(task_id, None)
            return
        self._halted = True
        (epoch.ready if self.in_order else epoch.deferred)[task_id] = failure(owed)

    def _batch_of(self, task_id: int) -> int:
        return self._number[task_id]

    # ------------------------------------------------------------- inspection
    def outstanding(self, worker_id: int) -> list[int]:
        """Task ids a worker has been sent and not yet answered."""
        return sorted(t for t, w in self._owner.items() if w == worker_id)

    def waiting_for(self) -> Waiting | None:
        """The task whose reply the consumer needs next."""
        if not self._epochs:
            return None
        epoch = self._epochs[0]
        if self.in_order:
            task_id = epoch.next_id
        elif epoch.unresolved:
            task_id = min(epoch.unresolved)
        else:
            return None
        return Waiting(
            task_id,
            self._owner.get(task_id),
            self._index.get(task_id),
            epoch.number,
            epoch.delivered,
        )

    @property
    def delivered(self) -> int:
        """Batches delivered in the current epoch."""
        return self._epochs[0].delivered if self._epochs else 0

    def ready_count(self) -> int:
        """Batches that have arrived and are not delivered yet (every open epoch)."""
        return sum(sum(1 for reply in epoch.ready.values() if isinstance(reply, Done)) for epoch in self._epochs)

    @property
    def in_flight(self) -> int:
        return self._in_flight


# Re-exported for engines that build replies.
__all__ = ["Done", "Exhausted", "Failed", "Scheduler", "Waiting"]
