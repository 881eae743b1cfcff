"""Engines: how a task reaches a worker and how its reply comes back.

All three expose the same four calls, driven by the loader iterator and the scheduler:

    send(worker_id, message)   hand a Task / Reset to one worker (never blocks for long)
    poll(timeout)              replies that arrived, as [(worker_id, reply)]; waits at most
                               `timeout` seconds for the first one
    dead()                     workers that ended without being asked, as [(id, pid, exitcode)]
    close()                    the one shutdown procedure: idempotent, bounded in time

`SerialEngine` runs each task inline when polled (num_workers=0). `ThreadEngine` runs
`run_worker` on threads and passes batches by reference. `ProcessEngine` runs it in
processes: tasks go down a pipe per worker, replies come back on a pipe per worker, and
`poll` waits on those pipes and on the process sentinels together, so a worker that dies
is seen at once, not at the next timeout.

Shutdown (`ProcessEngine.close`): Stop to every worker → join for up to
`JOIN_TIMEOUT_S` → SIGTERM the rest → join for up to `TERMINATE_TIMEOUT_S` → SIGKILL →
reap, then close every pipe. It is reached from the iterator's `weakref.finalize`, so it
runs when the iterator is exhausted, dropped, garbage-collected, or at interpreter exit.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import select
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing import connection
from multiprocessing.context import BaseContext
from typing import Any

from ._arena import Arena, ArenaLink, arena_limit
from ._fetch import EndOfStream, make_fetcher
from ._parent import ParentWatch
from ._protocol import Done, Exhausted, Failed, Reply, Request, Reset, Stop, Task
from ._sharing import Packed
from ._transport import PickleTransport
from ._worker import WorkerConfig, process_main, run_worker

JOIN_TIMEOUT_S = 2.0
TERMINATE_TIMEOUT_S = 1.0
THREAD_JOIN_TIMEOUT_S = 5.0
TRANSPORT_ENV = "STOKER_TRANSPORT"

Polled = list[tuple[int, Reply]]
Death = tuple[int, int | None, int | None]


class SerialEngine:
    """num_workers=0: the caller's thread fetches each task when it polls."""

    num_workers = 1

    def __init__(self, config: WorkerConfig) -> None:
        self._fetcher = make_fetcher(
            config.dataset_kind, config.dataset, config.auto_collation, config.collate_fn, config.drop_last
        )
        self._queue: deque[Request] = deque()

    def send(self, worker_id: int, message: Request) -> None:
        self._queue.append(message)

    def poll(self, timeout: float | None) -> Polled:
        while self._queue:
            message = self._queue.popleft()
            if isinstance(message, Reset):
                self._fetcher.reset()
                continue
            assert isinstance(message, Task)
            try:
                return [(0, Done(message.task_id, self._fetcher.fetch(message.index)))]
            except EndOfStream:
                return [(0, Exhausted(message.task_id))]
            except Exception as exc:  # re-raised unchanged by the iterator, as torch does
                return [(0, Failed(message.task_id, exc))]
        return []

    def dead(self) -> list[Death]:
        return []

    def close(self) -> None:
        self._queue.clear()


class ThreadEngine:
    """Workers on threads of this process; batches are passed by reference."""

    def __init__(self, configs: Sequence[WorkerConfig]) -> None:
        self.num_workers = len(configs)
        self._inboxes: list[queue.SimpleQueue[Request]] = [queue.SimpleQueue() for _ in configs]
        self._replies: queue.SimpleQueue[tuple[int, Reply]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        for config, inbox in zip(configs, self._inboxes):
            thread = threading.Thread(
                target=_thread_main,
                args=(config, inbox, self._replies),
                name=f"stoker-thread-worker-{config.worker_id}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

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
        return [(i, None, None) for i, t in enumerate(self._threads) if not t.is_alive()]

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

    def __init__(
        self,
        configs: Sequence[WorkerConfig],
        context: BaseContext,
        arena: Arena | None = None,
    ) -> None:
        self.num_workers = len(configs)
        self._transport: ArenaLink | PickleTransport
        if os.environ.get(TRANSPORT_ENV, "arena") == "pickle":
            self._transport = PickleTransport()
        else:
            self._transport = ArenaLink(arena if arena is not None else Arena(arena_limit()), len(configs))
        self._processes: list[Any] = []
        self._tasks: list[connection.Connection] = []
        self._results: list[connection.Connection | None] = []
        self._deaths: dict[int, Death] = {}
        self._poller = select.poll()
        self._watched: dict[int, tuple[int, bool]] = {}  # fd -> (worker id, is its sentinel)
        self._closed = False
        parent = ParentWatch.for_start_method(context.get_start_method())
        first = configs[0]
        heavy: Any = (first.dataset, first.collate_fn, first.worker_init_fn)
        if context.get_start_method() != "fork":
            heavy = Packed(heavy)  # large arrays go through shared memory, once
        try:
            for config in configs:
                light = replace(config, dataset=None, collate_fn=None, worker_init_fn=None)
                self._start(light, heavy, context, parent)
        except BaseException:
            self.close()
            raise
        finally:
            if isinstance(heavy, Packed):
                heavy.close()

    def _start(self, config: WorkerConfig, heavy: Any, context: BaseContext, parent: ParentWatch) -> None:
        # sockets, not pipes: both directions carry slot descriptors
        task_reader, task_writer = context.Pipe(duplex=True)
        result_reader, result_writer = context.Pipe(duplex=True)
        process = context.Process(  # type: ignore[attr-defined]
            target=process_main,
            args=(config, heavy, task_reader, result_writer, self._transport.worker_side(), parent),
            name=f"stoker-worker-{config.worker_id}",
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
        worker_id = len(self._processes)
        self._processes.append(process)
        self._tasks.append(task_writer)
        self._results.append(result_reader)
        self._watch(result_reader.fileno(), worker_id, died=False)
        self._watch(process.sentinel, worker_id, died=True)

    def _watch(self, fd: int, worker_id: int, died: bool) -> None:
        self._watched[fd] = (worker_id, died)
        self._poller.register(fd, select.POLLIN)

    def _unwatch(self, fd: int) -> None:
        if self._watched.pop(fd, None) is not None:
            self._poller.unregister(fd)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._processes]

    def send(self, worker_id: int, message: Request) -> None:
        try:
            self._transport.send_request(worker_id, self._tasks[worker_id], message)
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
            return [(worker_id, self._transport.recv_reply(worker_id, reader))]
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
        self._deaths[worker_id] = (worker_id, process.pid, process.exitcode)

    def dead(self) -> list[Death]:
        return list(self._deaths.values())

    def close(self) -> None:
        """Stop every worker, escalating to SIGTERM and SIGKILL; safe to call repeatedly."""
        if self._closed:
            return
        self._closed = True
        for tasks in self._tasks:
            try:
                tasks.send(Stop())
            except OSError:
                pass
        _stop_processes(self._processes)
        self._transport.close()
        for conn in [*self._tasks, *self._results]:
            if conn is not None:
                conn.close()
        for process in self._processes:
            process.close()


def _stop_processes(processes: Sequence[Any]) -> None:
    """Join → terminate → join → kill, each step bounded; reaps every process."""
    _join_all(processes, JOIN_TIMEOUT_S)
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    _join_all(processes, TERMINATE_TIMEOUT_S)
    for process in processes:
        if process.exitcode is None:
            process.kill()
    _join_all(processes, None)


def _join_all(processes: Sequence[Any], timeout: float | None) -> None:
    live = {p.sentinel: p for p in processes if p.exitcode is None}
    deadline = None if timeout is None else time.monotonic() + timeout
    while live:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            break
        for sentinel in connection.wait(list(live), remaining):
            live.pop(sentinel).join()


def _explain_start_failure(exc: Exception, heavy: Any, context: BaseContext) -> Exception:
    """Name the part of the loader that could not be sent to a new worker process."""
    from multiprocessing.reduction import ForkingPickler

    method = context.get_start_method()
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
