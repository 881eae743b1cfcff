"""The messages between the main process and its workers, and how they cross: the
`Transport` seam.

Every message is one of the frozen dataclasses below; nothing else crosses the boundary.

```
 main process                                   worker (thread or process)
 ─────────────                                  ──────────────────────────
   Task(task_id, index,  ───────────────────▶   fetch + collate (into `slot`, see arena)
        slot)
   Reset(pipe_seed)      ───────────────────▶   next epoch: a fresh iterator over the
                                                  iterable dataset replica (a DataPipe
                                                  reseeded first)
   Stop()                ───────────────────▶   exit the loop
                         ◀───────────────────   Done(task_id, payload, work)
                         ◀───────────────────   Failed(task_id, error)
                         ◀───────────────────   Exhausted(task_id, record)   iterable replica
                                                  ended; the task carried no batch, the
                                                  record its state at the end
```

`work` is the worker's timing of the batch (see stats), or None with `stats=False`.

Each Task gets exactly one reply, in the order the worker received the tasks. A worker
that fails in `worker_init_fn` keeps running and answers every task with that failure, so
the error surfaces in order, at the first batch that worker owed.

`index` is what the fetcher takes: a list of sample indices (map-style, auto-collation), a
single index (map-style, `batch_size=None`) or the number of samples to draw from the
iterable replica (`None` for one un-collated sample).

How a message crosses is a transport's business. A transport has a main side (`Transport`,
one per process engine) and a worker side (`WorkerTransport`, sent to each worker). Two
exist: the shared-memory arena (`arena.ArenaLink` / `SlotWriter`, the default: it owns which
slots each worker maps and which slot each task in flight was given) and `PickleTransport`
below (`STOKER_TRANSPORT=pickle`). Thread workers need neither: their replies are the
batches themselves, passed by reference.

The arena sends a `Task` and a `Done`'s header as plain tuples; their records (`SlotOrder`,
`SlotHeader` and the header kinds) are defined here, beside `Task`, so that the arena's
worker side and its main side import them from one place and imports point one way:
arena -> protocol, never back.

`PickleTransport` sends one reply as a few frames on the worker's result pipe:

    frame 0  header: the count and byte sizes of the out-of-band buffers
    frame 1  the reply, pickled with protocol 5 (array payloads left out of band)
    frame 2… each out-of-band buffer, received straight into a writable bytearray

so numpy arrays (and CPU torch tensors, sent as their numpy view) are copied once into the
pipe and once out of it, never pickled inline. A worker killed mid-reply leaves a
truncated message; the reader sees EOF, and the engine reports the death.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import struct
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Union

from .errors import ExceptionInfo

if TYPE_CHECKING:
    from .stats import Work


class Compact:
    """Pickles a frozen dataclass as its class and field values: several times faster to
    pickle and unpickle than the default (a state dict), which matters once per batch."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), tuple([getattr(self, name) for name in self.__dataclass_fields__])  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Task(Compact):
    """Fetch one batch."""

    task_id: int
    index: Any
    epoch: int = 0  # the loader's epoch number (counted over its life, restored by a resume)
    batch: int = 0  # the batch's position in its epoch
    slot: SlotOrder | None = None  # process workers: the shared-memory slot to collate into


@dataclass(frozen=True)
class Reset:
    """Start a new epoch on a persistent worker (iterable datasets re-iterate)."""

    pipe_seed: int | None = None  # a torch IterDataPipe's shared seed for the epoch (see datapipes)


@dataclass(frozen=True)
class Stop:
    """Leave the worker loop."""


@dataclass(frozen=True)
class Done(Compact):
    """A batch, encoded by the transport."""

    task_id: int
    payload: Any
    work: Work | None = None  # (samples, bytes, fetch_s, collate_s, busy_s); see stats


@dataclass(frozen=True)
class Failed:
    """The task raised, or its worker died (the main process makes that reply itself)."""

    task_id: int
    error: ExceptionInfo


@dataclass(frozen=True)
class ReplicaBatch(Compact):
    """A batch from an IterableDataset replica, or from a map-style dataset that keeps a
    state, with the replica's `replica.Record`: its state (pickled) or how far it got since
    the last one, what a resume restores."""

    batch: Any
    record: Any


@dataclass(frozen=True)
class Exhausted:
    """The worker's iterable replica has no more batches this epoch; `record`: its state at
    the stream's end (`replica.Record`), once per epoch."""

    task_id: int
    record: Any = None


Request = Union[Task, Reset, Stop]
Reply = Union[Done, Failed, Exhausted]


# ------------------------------------------------------------------ arena wire records
# Records cross the socket as plain tuples, which pickle at C speed, faster than even a
# `Compact` dataclass: a task as (task_id, index, epoch, batch, SlotOrder fields);
# a reply's header as one of
#   (SLOT, task_id, leaves, new, retired, work)   the batch's arrays lie in slots
#   (OUT_OF_BAND, task_id, sizes, work)           arrays follow as out-of-band frames
#   (PLAIN,)                                      Failed / Exhausted, pickled whole
# and a leaf (one array of the batch) as
#   (slot id, offset, dtype str, shape, nbytes, as_tensor: rebuilt as a torch tensor)
SLOT, OUT_OF_BAND, PLAIN = 0, 1, 2


class SlotOrder(NamedTuple):
    """Where a worker collates one task's batch (`Task.slot`)."""

    use: int | None  # a slot of the worker's pool to collate into, or None
    size: int  # that slot's size in bytes (0 when `use` is None)
    attach: bool  # the slot's descriptor follows the task: this process has not mapped it
    spare_id: int  # the id to give a slot the worker makes for this task
    size_hint: int  # bytes to make a slot of up front when `use` is None (0: unknown)
    budget: int | None  # bytes the pool may still grow by (None: unlimited)
    drop: tuple[int, ...] = ()  # slots this process maps that another worker retired: unmap them


class SlotHeader(NamedTuple):
    """A batch whose array leaves lie in slots; the pickled body follows, then new slots' fds."""

    task_id: int
    leaves: tuple[tuple[Any, ...], ...]  # (slot id, offset, dtype, shape, nbytes, as_tensor) each
    new: tuple[tuple[int, int], ...]  # (slot id, size) of slots made for this batch
    retired: tuple[int, ...]  # slots the worker dropped (outgrown)
    work: Any = None  # the Done's timing (see stats)


# ------------------------------------------------------------------ the transport seam
class WorkerTransport(Protocol):
    """The worker's side of a transport."""

    def around_fetch(self, task: Task) -> AbstractContextManager[Any]:
        """Wraps each fetch (the arena points collation into the task's slot)."""
        ...

    def recv_request(self, conn: Connection) -> Request: ...

    def send_reply(self, conn: Connection, reply: Reply) -> None: ...


class Transport(Protocol):
    """The main process's side of a transport, for one engine's workers."""

    def worker_side(self) -> WorkerTransport:
        """What each worker process is given (picklable)."""
        ...

    def send_request(self, worker_id: int, conn: Connection, message: Request) -> None: ...

    def recv_reply(self, worker_id: int, conn: Connection) -> Reply: ...

    def forget_worker(self, worker_id: int) -> None:
        """The worker died: release what its unanswered tasks held."""
        ...

    def close(self) -> None:
        """Every worker is gone: release what unanswered tasks held."""
        ...


# ------------------------------------------------------------------ the pickle transport
_COUNT = struct.Struct("<Q")


def _tensor_to_numpy(obj: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor) or type(obj) is not torch.Tensor:
        return None
    if obj.device.type != "cpu" or obj.layout is not torch.strided or obj.requires_grad:
        return None
    if obj.is_conj() or obj.is_neg() or obj.dtype not in _numpy_compatible_dtypes(torch):
        return None
    return obj.numpy()


_dtype_cache: list[frozenset[Any]] = []


def _numpy_compatible_dtypes(torch: Any) -> frozenset[Any]:
    if not _dtype_cache:
        names = ("bool uint8 int8 int16 int32 int64 float16 float32 float64 complex64 complex128").split()
        _dtype_cache.append(frozenset(getattr(torch, n) for n in names))
    return _dtype_cache[0]


def _rebuild_tensor(array: Any) -> Any:
    import torch

    return torch.from_numpy(array)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        array = _tensor_to_numpy(obj)
        if array is None:
            return NotImplemented
        return _rebuild_tensor, (array,)


class PickleTransport:
    """Replies as pickle protocol 5 with out-of-band array buffers.

    Both sides in one stateless object: the main process calls `send_request` and
    `recv_reply`, the worker `recv_request` and `send_reply`.
    """

    def around_fetch(self, task: Task) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()  # batches are collated in ordinary memory

    def worker_side(self) -> PickleTransport:
        return self

    # main side
    def send_request(self, worker_id: int, conn: Connection, message: Any) -> None:
        conn.send(message)

    def recv_reply(self, worker_id: int, conn: Connection) -> Any:
        header = conn.recv_bytes()
        (count,) = _COUNT.unpack_from(header)
        sizes = [_COUNT.unpack_from(header, 8 * (i + 1))[0] for i in range(count)]
        return recv_out_of_band(conn, sizes)

    def forget_worker(self, worker_id: int) -> None:
        """Nothing is held between replies."""

    def close(self) -> None:
        """Nothing is held between replies."""

    # worker side
    def recv_request(self, conn: Connection) -> Any:
        return conn.recv()

    def send_reply(self, conn: Connection, reply: Any) -> None:
        buffers: list[pickle.PickleBuffer] = []
        stream = io.BytesIO()
        _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(reply)
        views = [b.raw() for b in buffers]
        header = _COUNT.pack(len(views)) + b"".join(_COUNT.pack(v.nbytes) for v in views)
        conn.send_bytes(header)
        conn.send_bytes(stream.getbuffer())
        for view in views:
            conn.send_bytes(view)


def recv_out_of_band(conn: Connection, sizes: list[int], body: bytes | None = None) -> Any:
    """Read a pickle-5 body (unless given) and its out-of-band buffers of the given sizes; unpickle."""
    if body is None:
        body = conn.recv_bytes()
    buffers = []
    for size in sizes:
        buffer = bytearray(size)
        if size:
            conn.recv_bytes_into(buffer)
        else:
            conn.recv_bytes()
        buffers.append(buffer)
    return pickle.loads(body, buffers=buffers)
