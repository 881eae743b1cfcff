"""How a request reaches a worker process and its reply comes back: the `Transport` seam.

A transport has a main side (`Transport`, one per process engine) and a worker side
(`WorkerTransport`, sent to each worker). Two exist: the shared-memory arena
(`arena.ArenaLink` / `SlotWriter`, the default: it owns which slots each worker maps and
which slot each task in flight was given) and `PickleTransport` below
(`STOKER_TRANSPORT=pickle`).

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
from multiprocessing.connection import Connection
from typing import Any, Protocol

from .protocol import Reply, Request, Task

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
        names = (
            "bool uint8 int8 int16 int32 int64 float16 float32 float64 complex64 complex128"
        ).split()
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
