"""Engines: where workers run, how a task reaches one and how its reply comes back.

Every engine implements `Engine`, driven by the loader iterator and the scheduler:

    start()                    start the workers (the engine builds their configs)
    send(worker_id, message)   hand a Task / Reset to one worker (never blocks for long)
    poll(timeout)              replies that arrived, as [(worker_id, reply)]; waits at most
                               `timeout` seconds for the first one
    dead()                     workers that ended without being asked since the last call
    restart(worker_id)         replace a dead worker: same id, same seed (processes only)
    close()                    the one shutdown procedure: idempotent, bounded in time

`make_engine(plan, base_seed)` picks one: `SerialEngine` runs each task inline when polled
(num_workers=0), `ThreadEngine` runs `run_worker` on threads and passes batches by
reference, `ProcessEngine` runs it in processes: tasks go down a socket per worker, replies
come back on a socket per worker through the transport, and `poll` waits on those sockets
and on the process sentinels together, so a worker that dies is seen at once. The process
engine also decides how its workers die with the main process (`parent.ParentWatch`).

Shutdown (`ProcessEngine.close`): Stop to every worker (SIGTERM to one the loader timed out
on) → join for up to `JOIN_TIMEOUT_S` while reading and discarding whatever replies still
arrive (so no worker stays blocked on a full socket) → SIGTERM the rest → join for up to
`TERMINATE_TIMEOUT_S` → SIGKILL → reap, then close every socket. It is reached from the
iterator's `weakref.finalize`, so it runs when the iterator is exhausted, dropped,
garbage-collected, or at interpreter exit — only in the process that started the workers:
a process forked from it neither runs the finalizer nor counts the workers among its own
children (`forksafe.adopt`).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import queue
import select
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing import connection
from multiprocessing.context import BaseContext
from typing import Any, Protocol

from . import math_threads
from .arena import Arena, ArenaLink, arena_limit
from .datapipes import seed_pipe, shard_pipe
from .errors import ExceptionInfo
from .fetch import EndOfStream
from .forksafe import adopt
from .forkserver import prepare_forkserver
from .parent import ParentWatch
from .plan import LoadPlan
from .protocol import (
    Done,
    Exhausted,
    Failed,
    PickleTransport,
    Reply,
    Request,
    Reset,
    Stop,
    Task,
    Transport,
)
from .replica import Resume
from .seeding import restore_globals, seed_main_globals
from .sharing import Packed
from .stats import clock
from .worker import WorkerConfig, WorkerProcess, fetcher_for, process_main, run_worker, with_work

JOIN_TIMEOUT_S = 2.0
TERMINATE_TIMEOUT_S = 1.0
THREAD_JOIN_TIMEOUT_S = 5.0
TRANSPORT_ENV = "STOKER_TRANSPORT"

Polled = list[tuple[int, Reply]]


@dataclass(frozen=True)
class Death:
    """A worker that ended without being asked."""

    worker_id: int
    pid: int | None  # None: a thread
    exitcode: int | None  # negative: killed by that signal; None: unknown (a thread)


class Engine(Protocol):
    """Where a loader iterator's workers run."""

    num_workers: int
    can_restart: bool  # restart() can replace a dead worker

    def start(self) -> None: ...

    def send(self, worker_id: int, message: Request) -> None: ...

    def poll(self, timeout: float | None) -> Polled: ...

    def dead(self) -> list[Death]: ...

    def pid(self, worker_id: int) -> int | None: ...

    def restart(self, worker_id: int) -> int | None:
        """Replace a dead worker with a new one of the same id and seed; its pid."""
        ...

    def stuck(self, worker_id: int) -> None:
        """The loader timed out waiting on this worker: `close()` need not give it time to stop
        on its own (a process is terminated at once, unless it replies meanwhile)."""
        ...

    def close(self) -> None: ...


def make_engine(
    plan: LoadPlan,
    base_seed: int,
    pipe_seed: int | None = None,
    pipe_share: tuple[int, int] = (1, 0),
    run_seed: int | None = None,
) -> Engine:
    """The engine for a plan (inline, threads or processes) with its workers' configs; a torch
    IterDataPipe's shared seed and its (world size, rank) share: see datapipes. `run_seed`: what
    per-sample draws derive from (see RandomSource.run_seed); None: `base_seed`."""

    # a resumed iterator's replicas continue where the state says (see replica)
    replicas = [Resume.of(kept) for kept in plan.replicas] if plan.restore else []

    def configs(count: int, thread: bool) -> list[WorkerConfig]:
        return [
            WorkerConfig(
                worker_id=worker_id,
                num_workers=count,
                base_seed=base_seed,
                run_seed=run_seed,
                dataset=plan.dataset,
                dataset_kind=plan.dataset_kind,
                auto_collation=plan.auto_collation,
                collate_fn=plan.collate_fn,
                drop_last=plan.drop_last,
                worker_init_fn=plan.worker_init_fn,
                thread=thread,
                seed_each_batch=plan.seed_each_batch,
                replica_resume=replicas[worker_id] if worker_id < len(replicas) else None,
                snapshot_every=plan.snapshot_every,
                timed=plan.stats or plan.auto is not None,  # "auto" times its first batches
                rank=plan.ranks[0],
                world_size=plan.ranks[1],
                local_rank=plan.ranks[2],
                pipe_seed=pipe_seed,
                pipe_share=pipe_share,
            )
            for worker_id in range(count)
        ]

    n = plan.num_workers
    if n == 0:
        return SerialEngine(configs(1, thread=True)[0])
    if plan.threads:
        return ThreadEngine(configs(n, thread=True))
    context = plan.context if plan.context is not None else multiprocessing.get_context()
    return ProcessEngine(configs(n, thread=False), context, plan.arena)


def make_transport(arena: Arena | None, num_workers: int) -> Transport:
    """The shared-memory arena, or pickling when `STOKER_TRANSPORT=pickle`."""
    if os.environ.get(TRANSPORT_ENV, "arena") == "pickle":
        return PickleTransport()
    return ArenaLink(arena if arena is not None else Arena(arena_limit()), num_workers)


class _NoRestart:
    can_restart = False

    def restart(self, worker_id: int) -> int | None:
        raise RuntimeError(f"{type(self).__name__} cannot restart a worker")

    def stuck(self, worker_id: int) -> None:
        """Nothing to do: the caller's thread, or a thread worker, cannot be stopped early."""


class SerialEngine(_NoRestart):
    """num_workers=0: the caller's thread fetches each task when it polls."""

    num_workers = 1

    def __init__(self, config: WorkerConfig) -> None:
        if config.pipe_seed is not None:  # the caller's own pipe: its share of the training ranks'
            seed_pipe(config.dataset, config.pipe_seed)
            shard_pipe(config.dataset, *config.pipe_share)
        self._dataset = config.dataset
        self._fetcher = fetcher_for(config)
        self._fetcher.restore_now()  # the loader's own dataset: resumed at iter(), as torchdata's is
        self._rank = config.rank
        self._timed = config.timed
        self._draw_seed = config.draw_seed
        self._seed_each_batch = config.seed_each_batch
        self._queue: deque[Request] = deque()

    def go_live(self) -> Callable[[], Any]:
        """The replica's state is taken when the loader's is, not with each batch (nothing is
        fetched ahead of the consumer here); returns what takes it (see fetch's `snapshot_now`)."""
        self._fetcher.live = True
        return self._fetcher.snapshot_now

    def start(self) -> None:
        """Nothing to start: tasks run in the caller's thread."""

    def pid(self, worker_id: int) -> int | None:
        return None

    def send(self, worker_id: int, message: Request) -> None:
        self._queue.append(message)

    def poll(self, timeout: float | None) -> Polled:
        while self._queue:
            message = self._queue.popleft()
            if isinstance(message, Reset):
                if message.pipe_seed is not None:
                    seed_pipe(self._dataset, message.pipe_seed)
                self._fetcher.reset()
                continue
            assert isinstance(message, Task)
            epoch, batch = message.epoch, message.batch
            # seed_each_batch: seed the global RNGs as a worker process would, and give the
            # caller back its own states afterwards, whatever the fetch did
            saved = seed_main_globals(self._draw_seed, epoch, batch, self._rank) if self._seed_each_batch else None
            start = clock() if self._timed else 0.0
            try:
                done = Done(message.task_id, self._fetcher.fetch(message.index, epoch, batch))
                if self._timed:
                    done = with_work(done, self._fetcher, 0.0, start)
                return [(0, done)]
            except EndOfStream as end:
                return [(0, Exhausted(message.task_id, end.record))]
            except Exception as exc:  # re-raised unchanged by the iterator, as torch does
                return [(0, Failed(message.task_id, ExceptionInfo.unchanged(exc)))]
            finally:
                if saved is not None:
                    restore_globals(saved)
        return []

    def dead(self) -> list[Death]:
        return []

    def close(self) -> None:
        self._queue.clear()


class ThreadEngine(_NoRestart):
    """Workers on threads of this process; batches are passed by reference."""

    def __init__(self, configs: Sequence[WorkerConfig]) -> None:
        self.num_workers = len(configs)
        self._configs = configs
        self._inboxes: list[queue.SimpleQueue[Request]] = [queue.SimpleQueue() for _ in configs]
        self._replies: queue.SimpleQueue[tuple[int, Reply]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._reported: set[int] = set()
        self._closed = False

    def start(self) -> None:
        for config, inbox in zip(self._configs, self._inboxes):
            thread = threading.Thread(
                target=_thread_main,
                args=(config, inbox, self._replies),
                name=f"stoker-thread-worker-{config.worker_id}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

    def pid(self, worker_id: int) -> int | None:
        return None

    def send(self, worker_id: int, message: Request) -> None:
        self._inboxes[worker_id].put(message)

    def poll(self, timeout: float | None) -> Polled:
        try:
            first = self._replies.get(timeout=timeout)
        except queue.Empty:
            return []
        got = [first]
        while True:
            try:
                got.append(self._replies.get_nowait())
            except queue.Empty:
                return got

    def dead(self) -> list[Death]:
        if self._closed:
            return []
        ended = [i for i, t in enumerate(self._threads) if not t.is_alive() and i not in self._reported]
        self._reported.update(ended)
        return [Death(i, None, None) for i in ended]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for inbox in self._inboxes:
            inbox.put(Stop())
        deadline = time.monotonic() + THREAD_JOIN_TIMEOUT_S
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            warnings.warn(
                f"DataLoader thread workers {stuck} did not stop within {THREAD_JOIN_TIMEOUT_S} s "
                "(a sample or collate_fn that never returns?); threads cannot be killed, so they "
                "are left running as daemon threads",
                RuntimeWarning,
                stacklevel=2,
            )


def _thread_main(config: WorkerConfig, inbox: queue.SimpleQueue[Request], replies: Any) -> None:
    def receive(timeout: float) -> Request | None:
        try:
            return inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    run_worker(config, receive, lambda reply: replies.put((config.worker_id, reply)))


class ProcessEngine:
    """Workers in processes started from `context`; batches through the shared-memory arena.

    `STOKER_TRANSPORT=pickle` sends batches by pickling instead (for comparison and debugging).
    """

    can_restart = True

    def __init__(self, configs: Sequence[WorkerConfig], context: BaseContext, arena: Arena | None = None) -> None:
        n = self.num_workers = len(configs)
        first = configs[0]
        self._heavy: tuple[Any, Any, Any] = (first.dataset, first.collate_fn, first.worker_init_fn)
        # the heavy parts travel apart, packed with shared memory under spawn and forkserver
        self._configs = [replace(c, dataset=None, collate_fn=None, worker_init_fn=None) for c in configs]  # type: ignore[arg-type]
        self._context = context
        self._transport = make_transport(arena, n)
        self._processes: list[Any] = [None] * n
        self._tasks: list[connection.Connection | None] = [None] * n
        self._results: list[connection.Connection | None] = [None] * n
        self._deaths: dict[int, Death] = {}
        self._unreported: list[Death] = []
        self._poller = select.poll()
        self._watched: dict[int, tuple[int, bool]] = {}  # fd -> (worker id, is its sentinel)
        self._stuck: set[int] = set()  # workers the loader timed out on (see stuck())
        self._closed = False
        self._handles: list[WorkerProcess | None] = [None] * n  # see handles()

    # ---------------------------------------------------------------- starting
    def start(self) -> None:
        self._start_workers(range(self.num_workers))

    def restart(self, worker_id: int) -> int | None:
        if worker_id not in self._deaths:
            raise RuntimeError(f"worker {worker_id} is alive; only a dead worker is restarted")
        self._retire(worker_id)
        self._transport.forget_worker(worker_id)
        del self._deaths[worker_id]
        self._start_workers([worker_id])
        return self.pid(worker_id)

    def _start_workers(self, worker_ids: Sequence[int]) -> None:
        method = self._context.get_start_method()
        if method == "forkserver":
            prepare_forkserver(self._heavy[0], self._heavy[1])
        elif method == "fork":
            math_threads.prepare_fork()
        parent = ParentWatch.for_start_method(method)
        heavy: Any = self._heavy
        if method != "fork":
            heavy = Packed(heavy)  # large arrays go through shared memory, once per start
        try:
            for worker_id in worker_ids:
                self._start(worker_id, heavy, parent)
        finally:
            if isinstance(heavy, Packed):
                heavy.close()

    def _start(self, worker_id: int, heavy: Any, parent: ParentWatch) -> None:
        context = self._context
        # sockets, not pipes: both directions carry slot descriptors
        task_reader, task_writer = context.Pipe(duplex=True)
        result_reader, result_writer = context.Pipe(duplex=True)
        process = context.Process(  # type: ignore[attr-defined]
            target=process_main,
            args=(
                self._configs[worker_id],
                heavy,
                task_reader,
                result_writer,
                self._transport.worker_side(),
                parent,
            ),
            name=f"stoker-worker-{worker_id}",
            daemon=True,
        )
        try:
            try:
                process.start()
            except Exception as exc:
                task_writer.close()
                result_reader.close()
                raise _explain_start_failure(exc, heavy, context) from exc
        finally:
            task_reader.close()
            result_writer.close()
        adopt(process)
        self._processes[worker_id] = process
        self._handles[worker_id] = WorkerProcess(process)
        self._tasks[worker_id] = task_writer
        self._results[worker_id] = result_reader
        self._watch(result_reader.fileno(), worker_id, died=False)
        self._watch(process.sentinel, worker_id, died=True)

    def _retire(self, worker_id: int) -> None:
        """Release a dead worker's sockets and process object."""
        for channels in (self._tasks, self._results):
            conn = channels[worker_id]
            if conn is not None:
                self._unwatch(conn.fileno())
                conn.close()
                channels[worker_id] = None
        process = self._processes[worker_id]
        if process is not None:
            self._unwatch(process.sentinel)
            if process.exitcode is not None:
                process.close()
            self._processes[worker_id] = None

    def _watch(self, fd: int, worker_id: int, died: bool) -> None:
        self._watched[fd] = (worker_id, died)
        self._poller.register(fd, select.POLLIN)

    def _unwatch(self, fd: int) -> None:
        if self._watched.pop(fd, None) is not None:
            self._poller.unregister(fd)

    # ---------------------------------------------------------------- running
    def pid(self, worker_id: int) -> int | None:
        process = self._processes[worker_id]
        if process is None:
            death = self._deaths.get(worker_id)
            return death.pid if death is not None else None
        return process.pid

    def handles(self) -> list[WorkerProcess]:
        """Read-only handles on the worker processes, by worker id (the latest of a restarted
        one); they stay valid after close()."""
        return [h for h in self._handles if h is not None]

    def send(self, worker_id: int, message: Request) -> None:
        tasks = self._tasks[worker_id]
        if tasks is None:
            return
        try:
            self._transport.send_request(worker_id, tasks, message)
        except OSError:
            pass  # the worker is gone; its sentinel reports how

    def poll(self, timeout: float | None) -> Polled:
        if not self._watched:
            return []
        # one poll object for the engine's life: registering every pipe and sentinel anew
        # for each wait (as multiprocessing.connection.wait does) costs more than the wait
        wait_ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        got: Polled = []
        for fd, _ in self._poller.poll(wait_ms):
            watched = self._watched.get(fd)
            if watched is None:
                continue
            worker_id, died = watched
            if died:
                got.extend(self._drain(worker_id))
                self._record_death(worker_id)
            else:
                got.extend(self._read(worker_id, block=True))
        return got

    def _read(self, worker_id: int, block: bool) -> Polled:
        reader = self._results[worker_id]
        if reader is None or not (block or reader.poll()):
            return []
        try:
            got = [(worker_id, self._transport.recv_reply(worker_id, reader))]
            self._stuck.discard(worker_id)  # it answered: slow, not hung
            return got
        except (EOFError, OSError, pickle.UnpicklingError):
            self._unwatch(reader.fileno())
            reader.close()
            self._results[worker_id] = None
            self._record_death(worker_id)
            return []

    def _drain(self, worker_id: int) -> Polled:
        got: Polled = []
        while self._results[worker_id] is not None:
            more = self._read(worker_id, block=False)
            if not more:
                break
            got.extend(more)
        return got

    def _record_death(self, worker_id: int) -> None:
        if worker_id in self._deaths or self._closed:
            return
        process = self._processes[worker_id]
        self._unwatch(process.sentinel)
        process.join(TERMINATE_TIMEOUT_S)
        self._stuck.discard(worker_id)  # a replacement starts afresh
        death = Death(worker_id, process.pid, process.exitcode)
        self._deaths[worker_id] = death
        self._unreported.append(death)

    def dead(self) -> list[Death]:
        deaths, self._unreported = self._unreported, []
        return deaths

    # ---------------------------------------------------------------- shutdown
    def stuck(self, worker_id: int) -> None:
        self._stuck.add(worker_id)

    def close(self) -> None:
        """Stop every worker, escalating to SIGTERM and SIGKILL; safe to call repeatedly. A
        worker the loader timed out on is sent SIGTERM at once: it is inside the user's code
        and would not read Stop within JOIN_TIMEOUT_S."""
        if self._closed:
            return
        self._closed = True
        for tasks in self._tasks:
            if tasks is not None:
                try:
                    tasks.send(Stop())
                except OSError:
                    pass
        processes = [p for p in self._processes if p is not None]
        for worker_id in self._stuck:
            process = self._processes[worker_id]
            if process is not None and process.exitcode is None:
                process.terminate()
        self._join(processes, JOIN_TIMEOUT_S)
        for process in processes:
            if process.exitcode is None:
                process.terminate()
        self._join(processes, TERMINATE_TIMEOUT_S)
        for process in processes:
            if process.exitcode is None:
                process.kill()
        self._join(processes, None)
        self._transport.close()
        for conn in [*self._tasks, *self._results]:
            if conn is not None:
                conn.close()
        for process in processes:
            process.close()

    def _join(self, processes: Sequence[Any], timeout: float | None) -> None:
        """Reap processes as they exit, for at most `timeout` seconds, reading and
        discarding their replies meanwhile: a worker blocked writing a large reply to a
        full socket must not make the join wait out its timeout."""
        live = {p.sentinel: p for p in processes if p.exitcode is None}
        readers = {conn.fileno(): worker_id for worker_id, conn in enumerate(self._results) if conn is not None}
        deadline = None if timeout is None else time.monotonic() + timeout
        while live:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            for ready in connection.wait([*live, *readers], remaining):
                if ready in live:
                    live.pop(ready).join()
                else:
                    worker_id = readers[ready]  # type: ignore[index]
                    self._drain(worker_id)
                    if self._results[worker_id] is None:
                        del readers[ready]  # type: ignore[arg-type]


def _explain_start_failure(exc: Exception, heavy: Any, context: BaseContext) -> Exception:
    """Name the part of the loader that could not be sent to a new worker process."""
    from multiprocessing.reduction import ForkingPickler

    method = context.get_start_method()
    if isinstance(exc, (TypeError, AttributeError, pickle.PicklingError)):
        # torch's warning, word for word at its start, so that code matching it still does
        warnings.warn(
            "Got pickle error when attempting to start a worker Process. The worker's "
            f"arguments must be picklable under multiprocessing_context={method!r} (the "
            "default start method is 'forkserver' from Python 3.14 on non-Mac POSIX "
            "platforms); multiprocessing.set_start_method('fork') avoids pickling them.",
            stacklevel=7,  # the user's iter(loader)
        )
    parts = heavy.obj if isinstance(heavy, Packed) else heavy
    for name, value in zip(("dataset", "collate_fn", "worker_init_fn"), parts):
        try:
            ForkingPickler.dumps(value)
        except Exception as cause:
            return TypeError(
                f"DataLoader workers started with multiprocessing_context={method!r} receive the "
                f"{name} by pickling, and the {name} ({value!r:.80}) cannot be pickled: {cause}. "
                "Define it at module level without lambdas, open files or locks, or use "
                "multiprocessing_context='fork'."
            )
    return exc
