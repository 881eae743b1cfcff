"""The loop every worker runs, `WorkerInfo`, `get_worker_info` and worker seeding
(per-batch and per-sample seeding: see seeding).

`run_worker(config, receive, send)` is a plain function of one frozen `WorkerConfig` and
two channel callables, so it runs the same in a thread, in a process, or in a test with
lists standing in for channels. `process_main` wraps it for worker processes: it ignores
SIGINT (the main process handles Ctrl-C and stops its workers), arranges to die with its
parent, and reads tasks on a small inbox thread so that the main process never blocks
writing a task while the worker is busy writing a large reply.
"""

from __future__ import annotations

import copy
import os
import queue
import random
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

import numpy as np

from .._data.torch_collate import defer_tensors
from .datapipes import prepare_worker_copy, seed_pipe
from .errors import ExceptionInfo, describe_index
from .fetch import EndOfStream, IterableFetcher, MapFetcher, make_fetcher
from .math_threads import limit_worker_pools
from .parent import ParentWatch
from .protocol import Done, Exhausted, Failed, ReplicaBatch, Reply, Request, Reset, Stop, Task
from .replica import Resume
from .seeding import seed_batch_globals
from .stats import array_bytes, clock

T_co = TypeVar("T_co", covariant=True)

PARENT_POLL_S = 0.5  # how often an idle worker checks that its parent is alive


class WorkerRNG:
    """A thread worker's own random generators (`WorkerInfo.rng`), as torch gives its thread
    workers: thread workers share the process's global RNGs, so a transform that must not
    race with the other workers draws from these instead.

    Attributes:
        random_generator (random.Random): seeded with the worker's `seed`.
        numpy_generator (numpy.random.Generator): seeded as a process worker seeds numpy's
            global RNG (from the base seed and the worker's number).
        torch_generator (torch.Generator): seeded with the worker's `seed`; made (importing
            torch) on first use, so that a loader without torch never imports it.

    Args:
        seed (int): the worker's seed (`WorkerInfo.seed`).
        numpy_seed (array of uint32): the entropy numpy's generator is made from.
    """

    __slots__ = ("_seed", "_torch", "numpy_generator", "random_generator")

    def __init__(self, seed: int, numpy_seed: Any) -> None:
        self.random_generator = random.Random(seed)
        self.numpy_generator = np.random.default_rng(numpy_seed)
        self._seed = seed
        self._torch: Any = None

    @property
    def torch_generator(self) -> Any:
        """A `torch.Generator` seeded with the worker's seed, made on first use."""
        if self._torch is None:
            import torch

            self._torch = torch.Generator().manual_seed(self._seed)
        return self._torch

    def __repr__(self) -> str:
        return f"WorkerRNG(seed={self._seed})"


@dataclass(frozen=True)
class WorkerInfo(Generic[T_co]):
    """What a worker knows about itself; `get_worker_info()` returns it inside a worker.

    The first six fields are torch's, in torch's order. `rng` is None in a worker process
    (whose global RNGs are its own, seeded) and a `WorkerRNG` in a thread worker;
    `worker_method` is "multiprocessing" or "thread". `rank` and `world_size` are the
    training rank's (torch.distributed's when initialised, else the loader's
    DistributedSampler's, else torchrun's RANK / WORLD_SIZE, else 0 and 1), so that an
    IterableDataset can shard over ranks x workers (see `shard_for`); `local_rank` is
    torchrun's LOCAL_RANK, None without it. `seed` differs for every (rank, worker).

    The loader makes it; user code reads it (in `worker_init_fn`, a dataset's `__iter__`
    or `__getitem__`) through `get_worker_info()`.

    Args:
        id: This worker's number, 0 <= id < num_workers.
        num_workers: The number of workers of the loader.
        seed: This worker's seed: the iterator's base seed + worker id on rank 0 (as in
            torch), the next numbers on the other ranks.
        dataset: The dataset this worker reads: its own replica in a process worker,
            the loader's dataset (shared by the threads) in a thread worker.
        rng: A thread worker's own generators (`random_generator`,
            `numpy_generator`, `torch_generator`), since thread workers share the
            process's global RNGs; None in a process worker. Defaults to None.
        worker_method: "multiprocessing" or "thread". Defaults to "multiprocessing".
        rank: The training rank of this process. Defaults to 0.
        world_size: The number of training ranks. Defaults to 1.
        local_rank: The rank on this node (torchrun's LOCAL_RANK), None without it.
            Defaults to None.
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any
    rng: WorkerRNG | None = None
    worker_method: str | None = "multiprocessing"
    rank: int = 0
    world_size: int = 1
    local_rank: int | None = None


class WorkerProcess:
    """A read-only handle on one worker process, as torch's iterator lists them in `_workers`.

    It answers what a `multiprocessing.Process` answers (`pid`, `name`, `daemon`,
    `is_alive()`, `exitcode`, `join(timeout)`), also after the loader has stopped the worker
    and released its process object: then the worker is dead and its exit code is the one
    it ended with. `terminate()` and `kill()` signal a worker still running, as on a
    Process; the loader notices that death as any other.

    Args:
        process (multiprocessing.Process): a started worker process.
    """

    __slots__ = ("_popen", "_process", "name", "pid")

    def __init__(self, process: Any) -> None:
        self._process = process
        # a Process refuses every question once closed (the engine closes it at shutdown to
        # release its sentinel); its Popen keeps the pid and the reaped exit code
        self._popen = getattr(process, "_popen", None)
        self.pid: int | None = process.pid
        self.name: str = process.name

    @property
    def daemon(self) -> bool:
        return True

    @property
    def exitcode(self) -> int | None:
        """The exit code (negative: killed by that signal), None while it runs."""
        try:
            return self._process.exitcode
        except ValueError:  # closed: reaped before it was
            return None if self._popen is None else self._popen.returncode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds (None: for ever) for the worker to end."""
        try:
            self._process.join(timeout)
        except ValueError:  # closed: it has ended and was reaped
            pass

    def terminate(self) -> None:
        """SIGTERM the worker if it still runs."""
        if self.is_alive():
            self._process.terminate()

    def kill(self) -> None:
        """SIGKILL the worker if it still runs."""
        if self.is_alive():
            self._process.kill()

    def __repr__(self) -> str:
        state = "alive" if self.is_alive() else f"exitcode={self.exitcode}"
        return f"<WorkerProcess name={self.name!r} pid={self.pid} {state}>"


_process_info: WorkerInfo[Any] | None = None
_thread_info = threading.local()


def get_worker_info() -> WorkerInfo[Any] | None:
    """The current worker's `WorkerInfo`, or None in the main process (and with num_workers=0).

    In a thread worker it answers for the calling thread's worker.

    Returns:
        The `WorkerInfo` of the worker this runs in, or None outside a worker.
    """
    info = getattr(_thread_info, "info", None)
    return info if info is not None else _process_info


def tell_torch(info: WorkerInfo[Any] | None, thread: bool) -> bool:
    """Make `torch.utils.data.get_worker_info()` answer with `info` (None: clear it) in this
    worker, as it does in torch's own workers, if torch's data package is loaded here (stoker
    never imports it into a worker). Returns whether it was loaded.

    A process worker sets torch's process-wide record, as torch's workers do. Thread workers
    share the process, so torch's function is replaced (once, in torch's modules) by one that
    reads a thread-local record first and falls back to torch's own."""
    torch_worker: Any = sys.modules.get("torch.utils.data._utils.worker")
    if torch_worker is None:
        return False
    record = None
    if info is not None:
        # older torch's WorkerInfo has no rng and worker_method
        known = getattr(torch_worker.WorkerInfo, "__dataclass_fields__", {})
        extra = {name: getattr(info, name) for name in ("rng", "worker_method") if name in known}
        record = torch_worker.WorkerInfo(
            id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset, **extra
        )
    if thread:
        _thread_aware(torch_worker)
        _thread_info.torch = record
    else:
        torch_worker._worker_info = record
    return True


def _thread_aware(torch_worker: Any) -> None:
    if getattr(torch_worker.get_worker_info, "_stoker_threads", False):
        return
    torch_own = torch_worker.get_worker_info

    def get_worker_info() -> Any:
        record = getattr(_thread_info, "torch", None)
        return record if record is not None else torch_own()

    get_worker_info.__doc__ = torch_own.__doc__
    get_worker_info._stoker_threads = True  # type: ignore[attr-defined]
    torch_worker.get_worker_info = get_worker_info
    torch_data: Any = sys.modules.get("torch.utils.data")
    if torch_data is not None and getattr(torch_data, "get_worker_info", None) is torch_own:
        torch_data.get_worker_info = get_worker_info


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, fixed when the worker starts."""

    worker_id: int
    num_workers: int
    base_seed: int
    dataset: Any
    dataset_kind: str  # "map" | "iterable"
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    worker_init_fn: Callable[[int], None] | None
    thread: bool  # a thread worker shares the process: no global seeding, thread-local info
    seed_each_batch: bool = False  # seed the global RNGs from (base seed, epoch, batch) per batch
    replica_resume: Resume | None = None  # where a resumed replica continues (see replica)
    snapshot_every: int = 1  # an iterable replica's state is taken every n batches (0: at its end)
    timed: bool = False  # each Done carries the batch's timing (`DataLoader(stats=True)`)
    rank: int = 0  # the training rank's, with world_size and local_rank (see WorkerInfo)
    world_size: int = 1
    local_rank: int | None = None
    # a torch IterDataPipe: its first epoch's shared seed, and the (world size, rank) it is
    # sharded by (see datapipes)
    pipe_seed: int | None = None
    pipe_share: tuple[int, int] = (1, 0)
    # the loader's run seed, which sample_rng()/sample_seed() and seed_each_batch derive from in
    # every epoch (see RandomSource.run_seed); None: base_seed
    run_seed: int | None = None

    @property
    def seed(self) -> int:
        # torch's base seed + worker id on rank 0; ranks share the base seed (see
        # DistributedSampler(seed=None)), so each rank's workers take the next numbers
        return self.base_seed + self.rank * self.num_workers + self.worker_id

    @property
    def draw_seed(self) -> int:
        """The seed per-sample and per-batch draws derive from (with the epoch and the key)."""
        return self.base_seed if self.run_seed is None else self.run_seed


def seed_globals(base_seed: int, worker_id: int, rank: int = 0, num_workers: int = 1) -> None:
    """Seed Python's, numpy's and (if loaded) torch's global RNGs for one worker process
    (worker `worker_id` of `num_workers` on training rank `rank`)."""
    worker = rank * num_workers + worker_id
    seed = base_seed + worker
    random.seed(seed)
    np.random.seed(numpy_seed(base_seed, worker))
    torch = sys.modules.get("torch")
    if torch is not None:
        seed_torch(torch, seed)


def numpy_seed(base_seed: int, worker: int) -> Any:
    """numpy's seed for a worker (torch's `_generate_state`: the same four words)."""
    return np.random.SeedSequence([worker, base_seed]).generate_state(4)


def seed_torch(torch: Any, seed: int) -> None:
    """`torch.manual_seed(seed)`, as torch's workers call it. A torch built without any
    accelerator has only the CPU generator to seed: seeded alone, without the calls
    torch.manual_seed queues for devices that cannot exist (each records a stack trace: ~6 ms
    of a worker's start-up). Asked of the build, not the driver: a forked worker must not
    touch CUDA."""
    try:
        xpu = getattr(torch, "xpu", None)
        custom = getattr(torch._C, "_get_privateuse1_backend_name", None)
        accelerator = (
            torch.backends.cuda.is_built()
            or torch.backends.mps.is_built()
            or (xpu is not None and xpu._is_compiled())
            or (custom is not None and hasattr(torch, custom()))  # as torch.manual_seed looks
        )
    except Exception:
        accelerator = True
    if accelerator or not hasattr(torch, "default_generator"):
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def fetcher_for(config: WorkerConfig) -> MapFetcher | IterableFetcher:
    """The fetcher a worker (or the main process, with num_workers=0) runs for a config."""
    return make_fetcher(
        config.dataset_kind,
        config.dataset,
        config.auto_collation,
        config.collate_fn,
        config.drop_last,
        base_seed=config.draw_seed,
        worker_id=config.worker_id,
        resume=config.replica_resume,
        timed=config.timed,
        rank=config.rank,
        snapshot_every=config.snapshot_every,
    )


def run_worker(
    config: WorkerConfig,
    receive: Callable[[float], Request | None],
    send: Callable[[Reply], None],
    parent_alive: Callable[[], bool] = lambda: True,
    around_fetch: Callable[[Task], AbstractContextManager[Any]] | None = None,
) -> None:
    """Serve tasks until `Stop` arrives or the parent is gone.

    `receive(timeout)` returns the next request or None after `timeout` seconds;
    `send(reply)` delivers one reply. Every task gets exactly one reply.
    `around_fetch(task)` wraps each fetch (the transport uses it to collate into shared memory).
    With `config.timed`, each Done carries the batch's timing (see stats).
    """
    global _process_info
    copy_error: Exception | None = None
    if config.pipe_seed is not None and config.thread:
        # thread workers share the process: each seeds and shards a copy of its own, as each
        # process worker does
        try:
            config = replace(config, dataset=copy.deepcopy(config.dataset))
        except Exception as exc:  # reported at the first batch this worker owes
            copy_error = exc
    info: WorkerInfo[Any] = WorkerInfo(
        id=config.worker_id,
        num_workers=config.num_workers,
        seed=config.seed,
        dataset=config.dataset,
        rng=_thread_rng(config) if config.thread else None,
        worker_method="thread" if config.thread else "multiprocessing",
        rank=config.rank,
        world_size=config.world_size,
        local_rank=config.local_rank,
    )
    if config.thread:
        _thread_info.info = info
    else:
        _process_info = info
    told_torch = tell_torch(info, config.thread)
    kind = "thread worker" if config.thread else "worker"
    label = f"in DataLoader {kind} {config.worker_id} (pid {os.getpid()})"
    iterable = config.dataset_kind == "iterable"
    init_error: ExceptionInfo | None = None
    fetcher = fetcher_for(config)
    # seed_each_batch: a process worker seeds its global RNGs before each batch (thread
    # workers share the process's: the loader refuses that combination)
    batch_seed = config.draw_seed if config.seed_each_batch and not config.thread else None
    timed = config.timed
    unreported = 0.0  # busy time no Done has carried yet: the last send, failed tasks
    stage = "in worker_init_fn"
    try:
        if not config.thread:
            seed_globals(config.base_seed, config.worker_id, config.rank, config.num_workers)
        if copy_error is not None:
            stage = "copying its DataPipe (each thread worker reads a copy of its own)"
            raise copy_error
        if config.pipe_seed is not None:
            stage = "seeding and sharding its DataPipe"
            prepare_worker_copy(
                config.dataset, config.pipe_seed, config.worker_id, config.num_workers, config.pipe_share
            )
            stage = "in worker_init_fn"
        if config.worker_init_fn is not None:
            config.worker_init_fn(config.worker_id)
    except Exception as exc:
        init_error = ExceptionInfo(exc, f"{label} {stage}", keep_object=config.thread)
    try:
        while True:
            message = receive(PARENT_POLL_S)
            if message is None:
                if not parent_alive():
                    return
                continue
            if isinstance(message, Stop):
                return
            if isinstance(message, Reset):
                if message.pipe_seed is not None and init_error is None:
                    try:
                        seed_pipe(config.dataset, message.pipe_seed)
                    except Exception as exc:  # every task of the epoch answers with it
                        where = f"{label} seeding its DataPipe"
                        init_error = ExceptionInfo(exc, where, keep_object=config.thread)
                fetcher.reset()
                continue
            assert isinstance(message, Task)
            if not told_torch:  # a dataset may import torch after the worker started
                told_torch = tell_torch(info, config.thread)
            start = clock() if timed else 0.0
            if around_fetch is None:
                reply = _serve(fetcher, message, init_error, label, iterable, config.thread, batch_seed, config.rank)
            else:
                with around_fetch(message):
                    reply = _serve(
                        fetcher, message, init_error, label, iterable, config.thread, batch_seed, config.rank
                    )
            if timed and isinstance(reply, Done):
                reply, start, unreported = with_work(reply, fetcher, unreported, start), clock(), 0.0
            send(reply)
            del reply
            if timed:
                unreported += clock() - start
    finally:
        if config.thread:
            _thread_info.info = None
            tell_torch(None, thread=True)


def _thread_rng(config: WorkerConfig) -> WorkerRNG:
    worker = config.rank * config.num_workers + config.worker_id
    return WorkerRNG(config.seed, numpy_seed(config.base_seed, worker))


def with_work(reply: Done, fetcher: MapFetcher | IterableFetcher, unreported: float, start: float) -> Done:
    """The reply with its batch's timing: samples, array bytes, fetch, collate, busy."""
    samples, fetch_s, collate_s = fetcher.timing
    payload = reply.payload
    batch = payload.batch if isinstance(payload, ReplicaBatch) else payload
    nbytes = array_bytes(batch)
    return Done(reply.task_id, payload, (samples, nbytes, fetch_s, collate_s, unreported + clock() - start))


def _serve(
    fetcher: Any,
    task: Task,
    init_error: ExceptionInfo | None,
    label: str,
    iterable: bool,
    thread: bool,
    batch_seed: int | None = None,
    rank: int = 0,
) -> Reply:
    """Fetch one task; `batch_seed` (the base seed, or None) seeds the global RNGs first
    (with the training `rank` mixed in)."""
    if init_error is not None:
        return Failed(task.task_id, init_error)
    try:
        if batch_seed is not None:
            seed_batch_globals(batch_seed, task.epoch, task.batch, rank)
        return Done(task.task_id, fetcher.fetch(task.index, task.epoch, task.batch))
    except EndOfStream as end:
        return Exhausted(task.task_id, end.record)
    except Exception as exc:
        where = f"{label} {describe_index(task.index, iterable)}"
        return Failed(task.task_id, ExceptionInfo(exc, where, keep_object=thread))


def process_main(
    config: WorkerConfig,
    heavy: tuple[Any, Any, Any],
    tasks: Connection,
    results: Connection,
    transport: Any,
    parent: ParentWatch,
) -> None:
    """Entry point of a worker process.

    `heavy` is (dataset, collate_fn, worker_init_fn), sent apart from `config` so that spawn
    workers can receive it packed with shared memory (see sharing).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    limit_worker_pools()
    defer_tensors()  # stoker.torch's collate: no torch import here unless the dataset needs it
    dataset, collate_fn, worker_init_fn = heavy
    config = replace(config, dataset=dataset, collate_fn=collate_fn, worker_init_fn=worker_init_fn)
    del heavy
    parent_alive = parent.arm()
    if parent_alive is None:  # the main process died before we got here
        return
    inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()

    def read_tasks() -> None:
        while True:
            try:
                message = transport.recv_request(tasks)
            except (EOFError, OSError):
                inbox.put(Stop())
                return
            inbox.put(message)
            if isinstance(message, Stop):
                return

    threading.Thread(target=read_tasks, name="stoker-inbox", daemon=True).start()

    def receive(timeout: float) -> Request | None:
        try:
            return inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def send(reply: Reply) -> None:
        try:
            transport.send_reply(results, reply)
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:
            if not isinstance(reply, Done):
                raise
            where = f"in DataLoader worker {config.worker_id} (pid {os.getpid()}) while sending its batch"
            transport.send_reply(results, Failed(reply.task_id, ExceptionInfo(exc, where)))

    try:
        run_worker(
            config,
            receive,
            send,
            parent_alive=parent_alive,
            around_fetch=transport.around_fetch,
        )
    except (BrokenPipeError, ConnectionResetError):
        pass  # the main process is gone or has closed our pipe: nothing left to serve
    finally:
        results.close()
