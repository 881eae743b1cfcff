"""The shared-memory arena: batches cross from worker to main process without pickling arrays.

```
 main process (owns the free lists)                 worker w
 ──────────────────────────────────                 ────────
 Task(id, index, slot=s) ──────────────────────────▶ collate; array leaves are allocated
   s: a free slot of w's pool, or None                 inside slot s when they fit
                         ◀────────────────────────── header: leaf table [(slot, offset,
                                                       dtype, shape, kind)], new/retired slots
                         ◀────────────────────────── body: the batch pickled, each array leaf
                                                       replaced by its number in the table
                         ◀────────────────────────── fds of new slots (SCM_RIGHTS), if any
 map new slots (then close their fds); build numpy views onto the slots (zero copy);
 the slot returns to w's free list when the last view of that batch is garbage-collected.
```

Slots are anonymous memory (`memfd_create`), reserved up front with `posix_fallocate`
so a full machine gives an error, never a SIGBUS, and mapped by exactly two processes:
nothing has a name, so nothing survives a crash, and neither side keeps a file
descriptor once a slot is mapped. A worker sizes a new slot from the batch it must hold
(+25 %); a batch that outgrows its slot moves to a bigger one and the small slot is retired.
Leaves that are not arrays travel in the pickle; when no slot can be had (the arena is at
its byte limit or the system is out of memory) the arrays travel as pickle protocol 5
out-of-band buffers instead, with a warning, once.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import mmap
import os
import pickle
import socket
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._protocol import Done, Reply
from ._transport import recv_out_of_band

ALIGN = 64
GROWTH = 1.25
MIN_SLOT_BYTES = 1 << 16
ARENA_LIMIT_ENV = "STOKER_ARENA_MAX_BYTES"


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def arena_limit() -> int | None:
    """The most bytes of slots one worker may create (`STOKER_ARENA_MAX_BYTES`), or None."""
    raw = os.environ.get(ARENA_LIMIT_ENV)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ARENA_LIMIT_ENV} must be a number of bytes, got {raw!r}") from None
    return value if value > 0 else None


# ------------------------------------------------------------------ worker side
class _Slot:
    __slots__ = ("array", "base", "mm", "size", "slot_id", "used")

    def __init__(self, slot_id: int, mm: Any, size: int) -> None:
        self.slot_id = slot_id
        self.mm = mm
        self.size = size
        self.array = np.frombuffer(mm, dtype=np.uint8, count=size)
        self.base = self.array.ctypes.data
        self.used = 0

    def take(self, nbytes: int) -> int | None:
        """Reserve `nbytes` at an aligned offset; None when the slot is full."""
        offset = _aligned(self.used)
        if offset + nbytes > self.size:
            return None
        self.used = offset + nbytes
        return offset

    def view(self, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.array[offset : offset + nbytes].view(dtype).reshape(shape)

    def holds(self, array: np.ndarray) -> int | None:
        """The offset of a C-contiguous array lying inside this slot, else None."""
        address = array.__array_interface__["data"][0]
        if self.base <= address and address + array.nbytes <= self.base + self.size:
            return address - self.base if array.flags.c_contiguous else None
        return None


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Unmap:
    """Unmaps a slot when the buffer that owns the mapping is garbage-collected."""

    __slots__ = ("address", "size")

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size

    def __del__(self) -> None:
        _libc.munmap(self.address, self.size)


def map_fd(fd: int, size: int, private: bool = False, what: str = "shared-memory slot") -> Any:
    """Map a shared-memory fd; the fd may be closed at once (Python's mmap would keep a dup).

    `private` maps copy-on-write: writes stay in this process. Returns a ctypes byte array
    over the mapping, unmapped when it is garbage-collected — which numpy views of it
    prevent while they live.
    """
    flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a {size}-byte {what} failed: {os.strerror(err)}")
    buffer = (ctypes.c_ubyte * size).from_address(address)
    buffer._unmap = _Unmap(address, size)  # type: ignore[attr-defined]
    return buffer


def _create_slot_memory(size: int) -> tuple[int, Any]:
    fd = os.memfd_create("stoker-slot", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # reserve now: an ENOSPC here beats a SIGBUS later
        return fd, map_fd(fd, size)
    except BaseException:
        os.close(fd)
        raise


def _as_array(obj: Any) -> tuple[np.ndarray, str] | None:
    """An array leaf that can live in a slot, and its kind ('n' numpy, 't' torch)."""
    if type(obj) is np.ndarray:
        if obj.dtype.hasobject:
            return None
        return obj, "n"
    torch = sys.modules.get("torch")
    if torch is not None and type(obj) is torch.Tensor:
        if obj.device.type != "cpu" or obj.layout is not torch.strided or obj.requires_grad:
            return None
        if obj.is_conj() or obj.is_neg():
            return None
        try:
            return obj.numpy(), "t"
        except (TypeError, RuntimeError):  # e.g. bfloat16 has no numpy dtype
            return None
    return None


class _LeafPickler(pickle.Pickler):
    """Pickles a batch with each array leaf replaced by its number in `leaves`."""

    def __init__(self, stream: io.BytesIO, leaves: list[tuple[np.ndarray, str]]) -> None:
        super().__init__(stream, protocol=5)
        self.leaves = leaves

    def persistent_id(self, obj: Any) -> Any:
        found = _as_array(obj)
        if found is None:
            return None
        self.leaves.append(found)
        return len(self.leaves) - 1


class SlotWriter:
    """A worker's side of the arena: its mapped slots and the encoding of replies."""

    def __init__(self, limit: int | None = None) -> None:
        self.slots: dict[int, _Slot] = {}
        self.current: _Slot | None = None
        self.limit = limit
        self._next_id = 0
        self._bytes = 0

    @contextlib.contextmanager
    def collating_into(self, slot_id: int | None) -> Iterator[None]:
        """Let collation allocate array outputs inside the given slot while fetching."""
        from ._collate import allocator

        slot = self.slots.get(slot_id) if slot_id is not None else None
        self.current = slot
        if slot is None:
            yield
            return
        slot.used = 0

        def alloc(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            dt = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            offset = slot.take(nbytes)
            if offset is None:
                return np.empty(shape, dt)
            return slot.view(offset, dt, tuple(shape))

        with allocator(alloc):
            yield

    def _new_slot(self, nbytes: int) -> tuple[_Slot, int] | None:
        size = _aligned(max(MIN_SLOT_BYTES, int(nbytes * GROWTH)))
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        if self.limit is not None and self._bytes + size > self.limit:
            return None
        try:
            fd, mm = _create_slot_memory(size)
        except OSError:
            return None
        slot = _Slot(self._next_id, mm, size)
        self._next_id += 1
        self._bytes += size
        self.slots[slot.slot_id] = slot
        return slot, fd

    def _retire(self, slot: _Slot) -> None:
        del self.slots[slot.slot_id]
        self._bytes -= slot.size
        slot.array = None  # type: ignore[assignment]
        slot.mm = None  # unmapped once nothing refers to it

    def encode(self, reply: Reply) -> tuple[Any, list[Any], list[int]]:
        """(header, frames, fds) for one reply; a Done's arrays go into slots."""
        if not isinstance(reply, Done):
            return ("plain", None), [pickle.dumps(reply, protocol=5)], []
        leaves: list[tuple[np.ndarray, str]] = []
        stream = io.BytesIO()
        _LeafPickler(stream, leaves).dump(reply.payload)
        body = stream.getbuffer()
        slot = self.current
        self.current = None
        if not leaves:
            return ("slots", reply.task_id, [], [], [], None), [body], []
        table = self._place(leaves, slot)
        if table is None:  # no slot to be had: arrays go out of band
            return self._out_of_band(reply)
        placed, new, retired, fds = table
        return ("slots", reply.task_id, placed, new, retired, None), [body], fds

    def _place(
        self, leaves: list[tuple[np.ndarray, str]], slot: _Slot | None
    ) -> tuple[list[Any], list[tuple[int, int]], list[int], list[int]] | None:
        placed: list[Any] = []
        if slot is not None:
            offsets = [slot.holds(a) for a, _ in leaves]
            if all(o is not None for o in offsets):
                for (array, kind), offset in zip(leaves, offsets):
                    placed.append((slot.slot_id, offset, array.dtype.str, array.shape, kind))
                return placed, [], [], []
        need = sum(_aligned(a.nbytes) for a, _ in leaves)
        new: list[tuple[int, int]] = []
        retired: list[int] = []
        fds: list[int] = []
        target = slot
        if target is None or need > target.size:
            made = self._new_slot(need)
            if made is None:
                return None
            target, fd = made
            new.append((target.slot_id, target.size))
            fds.append(fd)
            if slot is not None:
                retired.append(slot.slot_id)
        staged = [np.array(a, copy=True) if target is slot else a for a, _ in leaves]
        target.used = 0
        for (array, kind), source in zip(leaves, staged):
            offset = target.take(array.nbytes)
            assert offset is not None
            np.copyto(target.view(offset, array.dtype, array.shape), source, casting="no")
            placed.append((target.slot_id, offset, array.dtype.str, array.shape, kind))
        if slot is not None and target is not slot:
            self._retire(slot)
        return placed, new, retired, fds

    def _out_of_band(self, reply: Done) -> tuple[Any, list[Any], list[int]]:
        buffers: list[pickle.PickleBuffer] = []
        body = pickle.dumps(reply.payload, protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
        return ("oob", reply.task_id, [v.nbytes for v in views]), [body, *views], []


class ArenaTransport:
    """Sends replies through the arena (worker side) and receives them (main side)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._writer: SlotWriter | None = None

    # worker side -------------------------------------------------------------
    def writer(self) -> SlotWriter:
        if self._writer is None:
            self._writer = SlotWriter(self.limit)
        return self._writer

    def send(self, conn: Any, reply: Reply) -> None:
        header, frames, fds = self.writer().encode(reply)
        conn.send(header)
        for frame in frames:
            conn.send_bytes(frame)
        if fds:
            sock = socket.socket(fileno=conn.fileno())
            try:
                socket.send_fds(sock, [b"F"], fds)
            finally:
                sock.detach()
                for fd in fds:
                    os.close(fd)


class WorkerPool:
    """The main process's view of one worker's slots: mappings, free list, in-use count."""

    def __init__(self) -> None:
        self.maps: dict[int, Any] = {}  # slot id -> ctypes buffer over the mapping
        self.sizes: dict[int, int] = {}
        self.free: list[int] = []
        self.released: deque[int] = deque()  # filled by finalizers, from any thread

    def take_free(self) -> int | None:
        while self.released:
            slot_id = self.released.popleft()
            if slot_id in self.maps:
                self.free.append(slot_id)
        if not self.free:
            return None
        best = max(range(len(self.free)), key=lambda i: self.sizes[self.free[i]])
        return self.free.pop(best)


class Arena:
    """The main process's side of the arena for one loader iterator."""

    HELD_WARNING_SLOTS = 64

    def __init__(self, num_workers: int) -> None:
        self.pools = [WorkerPool() for _ in range(num_workers)]
        self._warned_fallback = False
        self._warned_held = False
        self._lock = threading.Lock()

    def assign(self, worker_id: int) -> int | None:
        """A free slot of this worker for its next task, or None (the worker makes one)."""
        return self.pools[worker_id].take_free()

    def receive(self, worker_id: int, conn: Any, assigned: dict[int, int | None]) -> Reply:
        """Read one reply; `assigned` maps task ids to the slot each was given."""
        reply = self._receive(worker_id, conn)
        slot_id = assigned.pop(reply.task_id, None)
        if slot_id is not None and slot_id not in self._used:
            self.release_unused(worker_id, slot_id)
        self._used = ()
        return reply

    _used: Any = ()

    def _receive(self, worker_id: int, conn: Any) -> Reply:
        header = conn.recv()
        kind = header[0]
        if kind == "plain":
            return pickle.loads(conn.recv_bytes())
        if kind == "oob":
            _, task_id, sizes = header
            self._warn_fallback()
            return Done(task_id, recv_out_of_band(conn, sizes))
        _, task_id, placed, new, retired, _ = header
        body = conn.recv_bytes()
        pool = self.pools[worker_id]
        if new:
            sock = socket.socket(fileno=conn.fileno())
            try:
                _, fds, _, _ = socket.recv_fds(sock, 1, len(new))
            finally:
                sock.detach()
            for (slot_id, size), fd in zip(new, fds):
                try:
                    pool.maps[slot_id] = map_fd(fd, size)
                    pool.sizes[slot_id] = size
                finally:
                    os.close(fd)
        for slot_id in retired:
            pool.maps.pop(slot_id, None)
            pool.sizes.pop(slot_id, None)
        used = self._used = {slot_id for slot_id, *_ in placed} | set(retired)
        owners = {slot_id: self._lease(worker_id, slot_id) for slot_id in used if slot_id in pool.maps}
        views = [
            self._view(owners[slot_id], offset, dtype, shape, kind)
            for slot_id, offset, dtype, shape, kind in placed
        ]
        payload = _LeafUnpickler(io.BytesIO(body), views).load()
        self._check_held(pool)
        return Done(task_id, payload)

    def release_unused(self, worker_id: int, slot_id: int) -> None:
        """A slot that was assigned but carried nothing goes back to the free list."""
        pool = self.pools[worker_id]
        if slot_id in pool.maps:
            pool.released.append(slot_id)

    def _lease(self, worker_id: int, slot_id: int) -> np.ndarray:
        pool = self.pools[worker_id]
        owner = np.frombuffer(pool.maps[slot_id], dtype=np.uint8)
        weakref.finalize(owner, pool.released.append, slot_id)
        return owner

    @staticmethod
    def _view(owner: np.ndarray, offset: int, dtype: str, shape: tuple[int, ...], kind: str) -> Any:
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        array = owner[offset : offset + nbytes].view(dt).reshape(shape)
        if kind == "t":
            import torch

            return torch.from_numpy(array)
        return array

    def _warn_fallback(self) -> None:
        if not self._warned_fallback:
            self._warned_fallback = True
            warnings.warn(
                "stoker could not get shared memory for a batch (arena limit "
                f"{ARENA_LIMIT_ENV}={os.environ.get(ARENA_LIMIT_ENV, 'unset')} reached or the system "
                "is out of memory); batches are sent by pickling instead, which is slower",
                RuntimeWarning,
                stacklevel=5,
            )

    def _check_held(self, pool: WorkerPool) -> None:
        if not self._warned_held and len(pool.maps) > self.HELD_WARNING_SLOTS:
            self._warned_held = True
            total = sum(pool.sizes.values()) / 2**20
            warnings.warn(
                f"a DataLoader worker's shared-memory arena has grown to {len(pool.maps)} slots "
                f"({total:.0f} MiB): the batches you keep hold their slots, so the arena grows to "
                "keep serving new ones. Copy batches you keep (np.array(x) / tensor.clone()) to "
                "let their slots be reused.",
                RuntimeWarning,
                stacklevel=5,
            )


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, views: list[Any]) -> None:
        super().__init__(stream)
        self.views = views

    def persistent_load(self, pid: Any) -> Any:
        return self.views[pid]
