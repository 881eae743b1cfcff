"""The shared-memory arena: batches cross from worker to main process without pickling arrays.

```
 main process: the loader's Arena (free lists, one fd per slot)      worker w
 ──────────────────────────────────────────────────────────────      ────────
 Task(id, index, slot=SlotOrder) ─────────────────────────────────▶ collate; array leaves are
   use: a free slot of the pool (its fd follows, SCM_RIGHTS,           allocated inside the
        the first time this process is given it), or None             slot when they fit
   drop: slots another worker retired, to unmap
   spare_id / size_hint: make a new slot of about this size
                         ◀──────────────────────────────────────── header: SlotHeader (leaf
                                                                      table, new/retired slots)
                         ◀──────────────────────────────────────── body: the batch pickled, each
                                                                      array leaf replaced by its
                                                                      number in the table
                         ◀──────────────────────────────────────── fds of new slots, if any
 map new slots once; build numpy views onto the slots (zero copy); the slot returns to the
 free list when the last view of that batch is garbage-collected.
```

All workers draw from one pool of slots: a slot freed by one worker's batch serves any
worker's next task (a process is handed a slot's descriptor the first time it is given
that slot), so at steady state the loader holds about prefetch window + 2 slots, however
many workers it has. The `Arena` belongs to the DataLoader and outlives its iterators: the slots an epoch's
workers made are handed to the next epoch's workers (non-persistent workers are new
processes each epoch), so in steady state no batch costs a slot's creation, its zeroing,
its page faults or its unmapping, whatever its size. Each process maps a slot once and
keeps it mapped; a worker maps a slot it is given with MAP_POPULATE when it serves the task
the slot came with (not when the task arrives: a worker reads its next tasks ahead, and
their slots must not delay the task at hand), so it writes into memory whose page tables are
already filled.

Slots are anonymous memory (`memfd_create`), reserved up front with `posix_fallocate`
so a full machine gives an error, never a SIGBUS. Nothing has a name, so nothing survives
a crash. The main process keeps one descriptor per slot (up to `fd_budget()`, so that a
low `ulimit -n` is respected; a slot beyond it serves only the processes that already
map it) to hand the slot to later workers. A worker sizes a new slot from the batch it
must hold (+25 %): up front from the size hint, or, before any batch has told the size
(the loader's first tasks), at the batch's first array, so that the batch is collated
straight into it; a batch that outgrows its slot moves to a bigger one and the small slot
is retired. Leaves that are not arrays travel in the
pickle; when no slot can be had (the arena is at its byte limit or the system is out of
memory) the arrays travel as pickle protocol 5 out-of-band buffers instead, with a
warning, once.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import itertools
import math
import mmap
import os
import pickle
import resource
import socket
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._base.checks import fail
from .._data.torch_collate import TensorLeaf
from .forksafe import only_here
from .hostpin import Fence, Registrar, Registry, address_of
from .protocol import (
    OUT_OF_BAND,
    PLAIN,
    SLOT,
    Done,
    Reply,
    Request,
    SlotHeader,
    SlotOrder,
    Task,
    recv_out_of_band,
)

ALIGN = 64
GROWTH = 1.25
MIN_SLOT_BYTES = 1 << 16
ARENA_LIMIT_ENV = "STOKER_ARENA_MAX_BYTES"
MAX_KEPT_FDS = 256  # descriptors the main process keeps to share slots with later workers
# Array leaves up to this size are copied out of their slot when the batch arrives, so that
# keeping one (a batch's labels) holds only its own bytes, never its batch's slot.
COPY_OUT_BYTES = 1 << 14
# A slot some of whose arrays are gone while others are kept gives the pages of the gone ones
# back to the system after this many further slot orders (a loop that drops a batch's fields
# one after another within a step never pays for it).
PUNCH_AFTER_ORDERS = 4


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _page_rounded(n: int) -> int:
    return (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


def arena_limit() -> int | None:
    """The most bytes of slots the loader's arena may hold (`STOKER_ARENA_MAX_BYTES`), or None."""
    raw = os.environ.get(ARENA_LIMIT_ENV)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        fail(ValueError, ARENA_LIMIT_ENV, "an int (bytes; 0 or less for no limit)", raw)
    return value if value > 0 else None


def fd_budget() -> int:
    """How many slot descriptors the main process may keep: a quarter of its fd limit, at most 256."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_KEPT_FDS
    return max(0, min(MAX_KEPT_FDS, soft // 4))


# ------------------------------------------------------------------ memory
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
        nbytes = math.prod(shape) * dtype.itemsize
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
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class _Unmap:
    """Unmaps a slot when the buffer that owns the mapping is garbage-collected; `before`
    (if set) runs first (the main process unregisters a pinned slot there)."""

    __slots__ = ("address", "before", "size")

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size
        self.before: Any = None

    # bound at definition: at interpreter exit the module's globals may be gone before this runs
    def __del__(self, _munmap: Any = _libc.munmap) -> None:
        if self.before is not None:
            self.before(self.address)
        _munmap(self.address, self.size)


def map_fd(fd: int, size: int, private: bool = False, what: str = "shared-memory slot", populate: bool = False) -> Any:
    """Map a shared-memory fd; the fd may be closed at once (Python's mmap would keep a dup).

    `private` maps copy-on-write: writes stay in this process. `populate` fills the page
    tables now (one call instead of a page fault per page on first touch). Returns a ctypes
    byte array over the mapping, unmapped when it is garbage-collected — which numpy views
    of it prevent while they live.
    """
    flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
    if populate:
        flags |= _MAP_POPULATE
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
        return fd, map_fd(fd, size, populate=True)
    except BaseException:
        os.close(fd)
        raise


def _as_array(obj: Any) -> tuple[np.ndarray, bool] | None:
    """An array leaf that can live in a slot, and whether it is (to be) a torch tensor."""
    kind = type(obj)
    if kind is np.ndarray:
        if obj.dtype.hasobject:
            return None
        return obj, False
    if kind is TensorLeaf:  # made by a worker that defers tensors: always a plain dtype
        return obj, True
    torch = sys.modules.get("torch")
    if torch is not None and type(obj) is torch.Tensor:
        if obj.device.type != "cpu" or obj.layout is not torch.strided or obj.requires_grad:
            return None
        if obj.is_conj() or obj.is_neg():
            return None
        try:
            return obj.numpy(), True
        except (TypeError, RuntimeError):  # e.g. bfloat16 has no numpy dtype
            return None
    return None


class _LeafPickler(pickle.Pickler):
    """Pickles a batch with each array leaf replaced by its number in `leaves`."""

    def __init__(self, stream: io.BytesIO, leaves: list[tuple[np.ndarray, bool]]) -> None:
        super().__init__(stream, protocol=5)
        self.leaves = leaves

    def persistent_id(self, obj: Any) -> Any:
        found = _as_array(obj)
        if found is None:
            return None
        self.leaves.append(found)
        return len(self.leaves) - 1


def _send_fds(conn: Any, fds: list[int]) -> None:
    sock = socket.socket(fileno=conn.fileno())
    try:
        socket.send_fds(sock, [b"F"], fds)
    finally:
        sock.detach()


def _recv_fds(conn: Any, count: int) -> list[int]:
    sock = socket.socket(fileno=conn.fileno())
    try:
        _, fds, _, _ = socket.recv_fds(sock, 1, count)
    finally:
        sock.detach()
    if len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise EOFError(f"expected {count} slot descriptor(s), got {len(fds)}")
    return list(fds)


# ------------------------------------------------------------------ worker side
class SlotWriter:
    """A worker's side of the arena: the slots it maps, and the encoding of replies.

    `recv_request(conn)` reads the next request (mapping a slot whose descriptor comes with
    it), `around_fetch(task)` points collation into the ordered slot, `send_reply(conn,
    reply)` writes the reply. Picklable before first use, so it travels to spawn workers.
    """

    def __init__(self) -> None:
        self.slots: dict[int, _Slot] = {}
        self.pending: dict[int, tuple[int, int]] = {}  # slot id -> (fd, size) received, not mapped yet
        self.current: _Slot | None = None
        self._order: SlotOrder | None = None
        self._made: tuple[_Slot, int] | None = None  # made up front for the current task, with its fd

    # requests ------------------------------------------------------------------
    def recv_request(self, conn: Any) -> Request:
        message = pickle.loads(conn.recv_bytes())
        if type(message) is not tuple:  # Reset, Stop
            return message
        task_id, index, epoch, batch, fields = message
        order = SlotOrder(*fields)
        for slot_id in order.drop:
            self._close_pending(slot_id)
            dropped = self.slots.get(slot_id)
            if dropped is not None:
                self._retire(dropped)
        if order.attach:
            assert order.use is not None, "a slot to attach is a slot to use"
            (fd,) = _recv_fds(conn, 1)
            # mapped (and its page tables filled) when its task is served, not now: a worker
            # reads its next tasks ahead, and their slots must not delay the task at hand
            self._close_pending(order.use)
            self.pending[order.use] = (fd, order.size)
        return Task(task_id, index, epoch, batch, order)

    def _close_pending(self, slot_id: int) -> None:
        waiting = self.pending.pop(slot_id, None)
        if waiting is not None:
            os.close(waiting[0])

    def _map_pending(self, slot_id: int) -> None:
        waiting = self.pending.pop(slot_id, None)
        if waiting is not None:
            fd, size = waiting
            try:
                self.slots[slot_id] = _Slot(slot_id, map_fd(fd, size, populate=True), size)
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def collating_into(self, order: SlotOrder | None) -> Iterator[None]:
        """Let collation allocate array outputs inside the ordered slot while fetching."""
        from .._data.collate import allocator

        self._order = order
        slot = None
        if order is not None:
            if order.use is not None:
                self._map_pending(order.use)
            slot = self.slots.get(order.use) if order.use is not None else None
            if slot is None and order.size_hint > 0:
                self._made = self._make(order.spare_id, order.size_hint, order.budget)
                slot = self._made[0] if self._made is not None else None
        self.current = slot
        if slot is None and (order is None or order.use is not None):
            yield
            return
        if slot is not None:
            slot.used = 0

        def alloc(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            nonlocal slot
            dt = np.dtype(dtype)
            nbytes = math.prod(shape) * dt.itemsize  # np.prod costs 10 µs
            if slot is None:
                # no slot and no size to make one from (the loader's first batches): made
                # now for the first array collated, with headroom for the rest, so that the
                # batch is written once, where it crosses, rather than copied there after
                assert order is not None
                self._made = self._make(order.spare_id, int(nbytes * GROWTH), order.budget)
                if self._made is None:
                    return np.empty(shape, dt)
                slot = self.current = self._made[0]
            offset = slot.take(nbytes)
            if offset is None:
                return np.empty(shape, dt)
            return slot.view(offset, dt, tuple(shape))

        with allocator(alloc):
            yield

    # replies -------------------------------------------------------------------
    def send_reply(self, conn: Any, reply: Reply) -> None:
        header, frames, fds = self.encode(reply)
        # the header and the pickled batch travel as one message: one read in the main process
        conn.send_bytes(pickle.dumps((header, frames[0]), protocol=5))
        for frame in frames[1:]:
            conn.send_bytes(frame)
        if fds:
            try:
                _send_fds(conn, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def encode(self, reply: Reply) -> tuple[Any, list[Any], list[int]]:
        """(header, frames, fds) for one reply; a Done's arrays go into slots."""
        slot, order, made = self.current, self._order, self._made
        self.current, self._order, self._made = None, None, None
        if not isinstance(reply, Done):
            self._discard(made)
            return (PLAIN,), [pickle.dumps(reply, protocol=5)], []
        leaves: list[tuple[np.ndarray, bool]] = []
        stream = io.BytesIO()
        try:
            _LeafPickler(stream, leaves).dump(reply.payload)
        except BaseException:  # the batch cannot be sent: a slot made for it goes too
            self._discard(made)
            raise
        body = stream.getvalue()
        if not leaves:
            self._discard(made)
            return (SLOT, reply.task_id, (), (), (), reply.work), [body], []
        placed = self._place(leaves, slot, order, made)
        if placed is None:  # no slot to be had: arrays go out of band
            return self._out_of_band(reply)
        table, new, retired, fds = placed
        return (SLOT, reply.task_id, table, new, retired, reply.work), [body], fds

    def _place(
        self,
        leaves: list[tuple[np.ndarray, bool]],
        slot: _Slot | None,
        order: SlotOrder | None,
        made: tuple[_Slot, int] | None,
    ) -> tuple[tuple[tuple[Any, ...], ...], tuple[tuple[int, int], ...], tuple[int, ...], list[int]] | None:
        if slot is not None:
            offsets = [slot.holds(a) for a, _ in leaves]
            if all(o is not None for o in offsets):
                table = tuple(
                    (slot.slot_id, offset, a.dtype.str, a.shape, a.nbytes, torch)
                    for (a, torch), offset in zip(leaves, offsets)
                )
                if made is not None:
                    return table, ((slot.slot_id, slot.size),), (), [made[1]]
                return table, (), (), []
        need = sum(_aligned(a.nbytes) for a, _ in leaves)
        given = slot if made is None else None  # the pool's slot this task was given, if any
        target, fds, new = slot, [], []
        if target is None or need > target.size:
            self._discard(made)
            if order is None:  # not ordered by an ArenaLink: no id to give a new slot
                return None
            spare_id, budget = order.spare_id, order.budget
            if given is not None and budget is not None:
                budget += given.size  # the outgrown slot is retired
            fresh = self._make(spare_id, int(need * GROWTH), budget)
            if fresh is None:
                return None
            target, fd = fresh
            new.append((target.slot_id, target.size))
            fds.append(fd)
        elif made is not None:
            new.append((target.slot_id, target.size))
            fds.append(made[1])
        staged = [np.array(a, copy=True) if target is slot else a for a, _ in leaves]
        target.used = 0
        placed: list[tuple[Any, ...]] = []
        for (array, torch), source in zip(leaves, staged):
            offset = target.take(array.nbytes)
            assert offset is not None
            np.copyto(target.view(offset, array.dtype, array.shape), source, casting="no")
            placed.append((target.slot_id, offset, array.dtype.str, array.shape, array.nbytes, torch))
        retired: tuple[int, ...] = ()
        if given is not None and target is not given:
            self._retire(given)
            retired = (given.slot_id,)
        return tuple(placed), tuple(new), retired, fds

    def _make(self, slot_id: int, nbytes: int, budget: int | None) -> tuple[_Slot, int] | None:
        size = _page_rounded(_aligned(max(MIN_SLOT_BYTES, nbytes)))
        if budget is not None and size > budget:
            return None
        try:
            fd, mm = _create_slot_memory(size)
        except OSError:
            return None
        slot = _Slot(slot_id, mm, size)
        self.slots[slot_id] = slot
        return slot, fd

    def _discard(self, made: tuple[_Slot, int] | None) -> None:
        """Drop a slot made up front that the batch did not use (the main process never saw it)."""
        if made is not None:
            slot, fd = made
            os.close(fd)
            self._retire(slot)

    def _retire(self, slot: _Slot) -> None:
        self.slots.pop(slot.slot_id, None)
        slot.array = None  # type: ignore[assignment]
        slot.mm = None  # unmapped once nothing refers to it

    def _out_of_band(self, reply: Done) -> tuple[Any, list[Any], list[int]]:
        buffers: list[pickle.PickleBuffer] = []
        body = pickle.dumps(reply.payload, protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
        return (OUT_OF_BAND, reply.task_id, tuple(v.nbytes for v in views), reply.work), [body, *views], []

    def around_fetch(self, task: Task) -> contextlib.AbstractContextManager[None]:
        return self.collating_into(task.slot)


# ------------------------------------------------------------------ main side
class SlotPool:
    """The arena's slots: mappings, descriptors, free list.

    Shared by every worker process of the loader, over its life.
    """

    def __init__(self) -> None:
        self.maps: dict[int, Any] = {}  # slot id -> ctypes buffer over the mapping
        self.sizes: dict[int, int] = {}
        self.fds: dict[int, int] = {}  # slots that can be handed to a process that lacks them
        self.free: list[int] = []
        self.released: deque[int] = deque()  # filled by `_Return`, from any thread
        self.leases: dict[int, weakref.ref[np.ndarray]] = {}  # slot id -> its batch's owner array
        self._returns: dict[int, _Return] = {}
        # per-array leases (`lease_leaves`): each array leaf of a batch owns its own range of
        # the slot; the slot is released when the last of them is gone
        self.returned: deque[tuple[int, int, int]] = deque()  # (slot, start, end), any thread
        self.live: dict[int, int] = {}  # slot id -> its batch's array leaves still alive
        self.leaf_refs: dict[int, list[weakref.ref[np.ndarray]]] = {}
        self.partial: dict[int, tuple[int, list[tuple[int, int]]]] = {}  # slot -> (since, gone ranges)
        self.punched: dict[int, int] = {}  # slot id -> bytes given back while it is leased
        self.orders = 0  # slot orders so far: the clock of `partial`
        self.whole: dict[int, np.ndarray] = {}  # slot id -> a uint8 array over it, for copies
        self.pid = os.getpid()  # the process that made the pool: it alone gives pages back
        self.peak_need = 0  # bytes the largest batch so far occupied
        # pinned slots (see hostpin): a released slot is fenced, and handed out once its
        # fence is done, so that no worker writes into it while a copy may still read it
        self.fence: Callable[[], Fence] | None = None
        self.fences: dict[int, Fence] = {}

    def take_free(self, mapped: set[int]) -> int | None:
        """A free slot, preferring one the asking process maps already; the largest of those.
        A fenced slot is taken only once its fence is done, or (when no other slot is free)
        after waiting for it."""
        self.orders += 1
        if self.returned:
            self._settle_leaves()
        if self.partial:
            self._punch_stale()
        self._collect_released()
        best, best_key = -1, (False, -1)
        fenced = -1
        for i, slot_id in enumerate(self.free):
            held = slot_id in mapped
            if held or slot_id in self.fds:
                fence = self.fences.get(slot_id)
                if fence is not None and not fence.done():
                    fenced = i if fenced < 0 else fenced
                    continue
                key = (held, self.sizes[slot_id])
                if key > best_key:
                    best, best_key = i, key
        if best < 0 and fenced >= 0:  # the oldest copy in flight finishes soon: wait for it
            self.fences[self.free[fenced]].wait()
            best = fenced
        if best < 0:
            return None
        slot_id = self.free.pop(best)
        self.fences.pop(slot_id, None)
        return slot_id

    def _collect_released(self) -> None:
        """Move the released slots to the free list (fencing each, when slots are pinned)."""
        while self.released:
            slot_id = self.released.popleft()
            if slot_id in self.maps:
                self.free.append(slot_id)
                if self.fence is not None:
                    self.fences[slot_id] = self.fence()

    def _give_back(self, address: int, length: int) -> bool:
        """Return a range of a slot's pages to the system (they read as zeros after); only in
        the process that made the pool: a forked child's copy of it must never take pages from
        slots its parent's workers write."""
        return os.getpid() == self.pid and _libc.madvise(address, length, _MADV_REMOVE) == 0

    def lease(self, slot_id: int) -> np.ndarray:
        """The array every view of the slot's batch derives from; when the last of them is
        garbage-collected, the slot goes back to the free list."""
        owner = np.frombuffer(self.maps[slot_id], dtype=np.uint8)
        self.punched.pop(slot_id, None)
        back = self._returns.get(slot_id)
        if back is None:
            back = self._returns[slot_id] = _Return(slot_id, self.released)
        # a weakref with a callback costs half a weakref.finalize; it lives until the
        # slot's next lease replaces it, which cannot happen before the callback ran
        self.leases[slot_id] = weakref.ref(owner, back)
        return owner

    def lease_leaves(self, leaves: tuple[tuple[Any, ...], ...]) -> list[Any]:
        """A batch's array leaves, each (slot id, offset, dtype, shape, nbytes, as_tensor),
        as arrays (or tensors) of their own. A small leaf is copied out of its slot; a large
        one is a view on a range of the slot owned by its own base array, and when the last
        view of that base is garbage-collected its range is returned (`_settle_leaves`). So
        what stays held is what the user keeps, array by array, as with torch's tensors."""
        views: list[Any] = []
        counts: dict[int, int] = {}
        for slot_id, offset, dtype, shape, nbytes, as_tensor in leaves:
            if nbytes <= COPY_OUT_BYTES:
                whole = self.whole.get(slot_id)
                if whole is None:
                    whole = self.whole[slot_id] = np.frombuffer(self.maps[slot_id], dtype=np.uint8)
                array = whole[offset : offset + nbytes].view(dtype).reshape(shape).copy()
            else:
                owner = np.frombuffer(self.maps[slot_id], dtype=np.uint8, count=nbytes, offset=offset)
                back = weakref.ref(owner, _LeafReturn(slot_id, offset, offset + nbytes, self.returned))
                if slot_id in counts:
                    counts[slot_id] += 1
                    self.leaf_refs[slot_id].append(back)
                else:
                    counts[slot_id] = 1
                    self.leaf_refs[slot_id] = [back]
                array = owner.view(dtype).reshape(shape)
            views.append(_as_tensor(array) if as_tensor else array)
        for slot_id in {leaf[0] for leaf in leaves}:
            if self.punched:
                self.punched.pop(slot_id, None)  # written again
            if slot_id in counts:
                self.live[slot_id] = counts[slot_id]
            else:  # every leaf was copied out: the slot is free again at once
                self.released.append(slot_id)
        return views

    def _settle_leaves(self) -> None:
        """Count the array leaves that were garbage-collected: a slot whose last leaf went is
        released; one with leaves still kept remembers the ranges of those that went."""
        while self.returned:
            slot_id, start, end = self.returned.popleft()
            left = self.live.get(slot_id)
            if left is None:  # the slot was retired meanwhile
                continue
            if left > 1:
                self.live[slot_id] = left - 1
                self.partial.setdefault(slot_id, (self.orders, []))[1].append((start, end))
                continue
            del self.live[slot_id]
            self.partial.pop(slot_id, None)
            self.punched.pop(slot_id, None)
            self.leaf_refs.pop(slot_id, None)
            self.released.append(slot_id)

    def settle(self) -> None:
        """Count the leaves gone so far, and give back the pages of every gone array whose
        batch is partly kept, however recent (at the end of an epoch, and when the arena goes)."""
        self._settle_leaves()
        self._punch_stale(after=0)

    def trim(self) -> None:
        """Give back the pages of every free slot (the workers are gone): between epochs the
        loader holds no batch memory of its own, as torch's does not. The slots stay mapped;
        the next workers that write them get zeroed pages."""
        if self.fence is not None:  # registered with CUDA: the pages stay where it maps them
            return
        self.settle()
        self._collect_released()
        for slot_id in self.free:
            size = self.sizes[slot_id]
            if self.punched.get(slot_id) != size and self._give_back(ctypes.addressof(self.maps[slot_id]), size):
                self.punched[slot_id] = size

    def _punch_stale(self, after: int = PUNCH_AFTER_ORDERS) -> None:
        """Give back the pages of arrays that went while others of their batch are kept (for
        `after` orders): the slot stays leased, but holds only what is kept. The pages come
        back zeroed when the slot is written again."""
        for slot_id, (since, ranges) in list(self.partial.items()):
            if self.orders - since < after:
                continue
            del self.partial[slot_id]
            buffer = self.maps.get(slot_id)
            if buffer is None:
                continue
            address = ctypes.addressof(buffer)
            for start, end in ranges:
                first = _page_rounded(start)
                last = end // mmap.PAGESIZE * mmap.PAGESIZE
                if last > first and self._give_back(address + first, last - first):
                    self.punched[slot_id] = self.punched.get(slot_id, 0) + last - first

    def forget(self, slot_id: int) -> int | None:
        """Drop a retired slot (unmapped once its last view is gone); its fd, if kept."""
        self.maps.pop(slot_id, None)
        self.sizes.pop(slot_id, 0)
        self.leases.pop(slot_id, None)
        self.whole.pop(slot_id, None)
        self.live.pop(slot_id, None)
        self.leaf_refs.pop(slot_id, None)
        self.partial.pop(slot_id, None)
        self.punched.pop(slot_id, None)
        self.fences.pop(slot_id, None)
        self._returns.pop(slot_id, None)
        return self.fds.pop(slot_id, None)

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())

    @property
    def resident_bytes(self) -> int:
        """Bytes of slots less the pages given back from kept batches' gone arrays."""
        return self.bytes - sum(self.punched.values())


class _Return:
    """A lease's callback: puts its slot on the released queue."""

    __slots__ = ("released", "slot_id")

    def __init__(self, slot_id: int, released: deque[int]) -> None:
        self.slot_id = slot_id
        self.released = released

    def __call__(self, _: object) -> None:
        self.released.append(self.slot_id)


class _LeafReturn:
    """A leaf's lease callback: puts its slot and byte range on the returned queue."""

    __slots__ = ("end", "returned", "slot_id", "start")

    def __init__(self, slot_id: int, start: int, end: int, returned: deque[tuple[int, int, int]]) -> None:
        self.slot_id = slot_id
        self.start = start
        self.end = end
        self.returned = returned

    def __call__(self, _: object) -> None:
        self.returned.append((self.slot_id, self.start, self.end))


class Arena:
    """The main process's side of the arena; one per DataLoader, shared by its iterators."""

    HELD_WARNING_SLOTS = 64

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.slots = SlotPool()  # one pool for every worker
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._fd_budget = fd_budget()
        self._warned_fallback = False
        self._warned_held = False
        self._workers: set[int] = set()  # worker ids served (the held-slots warning scales with them)
        self.registry: Registry | None = None  # set by `pin`: slots registered with CUDA
        weakref.finalize(self, _close_fds, self.slots)

    def pin(self, registrar: Registrar) -> Registry:
        """Register every slot this process maps with `registrar` (now and from now on), and
        fence released slots; kept for the arena's life. Returns the registry."""
        with self._lock:
            if self.registry is None:
                self.registry = Registry(registrar)
                self.slots.fence = registrar.fence
                for buffer in self.slots.maps.values():
                    self._register(buffer)
            return self.registry

    def _register(self, buffer: Any) -> None:
        registry = self.registry
        assert registry is not None
        address = address_of(buffer)
        if registry.add(address, len(buffer)):
            buffer._unmap.before = only_here(registry.remove)  # CUDA: not in a forked child

    def order(self, worker_id: int, mapped: set[int], drop: tuple[int, ...] = ()) -> SlotOrder:
        """Where the next task of worker `worker_id` collates; `mapped`: slots its process
        maps; `drop`: slots it maps that another worker retired."""
        with self._lock:
            self._workers.add(worker_id)
            pool = self.slots
            slot_id = pool.take_free(mapped)
            budget = None if self.limit is None else max(0, self.limit - pool.resident_bytes)
            # the largest batch so far, no headroom: batches of one size (images) then take
            # exactly window + 2 of their sizes at steady state; a larger batch outgrows its
            # slot and gets a new one with GROWTH headroom (`SlotWriter`)
            hint = pool.peak_need  # the worker rounds it when it makes the slot
            spare = next(self._ids)
            if slot_id is None:
                return SlotOrder(None, 0, False, spare, hint, budget, drop)
            return SlotOrder(slot_id, pool.sizes[slot_id], slot_id not in mapped, spare, 0, budget, drop)

    def fd_of(self, worker_id: int, slot_id: int) -> int:
        return self.slots.fds[slot_id]

    def release(self, worker_id: int, slot_id: int) -> None:
        """A slot that was given out but carried nothing goes back to the free list."""
        pool = self.slots
        if slot_id in pool.maps:
            pool.released.append(slot_id)

    def receive(self, worker_id: int, conn: Any) -> tuple[Reply, SlotHeader | None]:
        """Read one reply of worker `worker_id`; the slot header when it carried one."""
        fields, body = pickle.loads(conn.recv_bytes())
        kind = fields[0] if type(fields) is tuple and fields else None
        if kind == PLAIN:
            return pickle.loads(body), None
        if kind == OUT_OF_BAND:
            _, task_id, sizes, work = fields
            self._warn_fallback()
            return Done(task_id, recv_out_of_band(conn, list(sizes), body), work), None
        if kind != SLOT:
            raise pickle.UnpicklingError(f"unexpected reply header {fields!r:.80}")
        header = SlotHeader(*fields[1:])
        pool = self.slots
        if header.new:
            fds = _recv_fds(conn, len(header.new))
            with self._lock:
                for (slot_id, size), fd in zip(header.new, fds):
                    self._adopt(pool, slot_id, size, fd)
            self._check_held(pool)  # the arena grows only here
        if header.retired:
            with self._lock:
                for slot_id in header.retired:
                    retired_fd = pool.forget(slot_id)
                    if retired_fd is not None:
                        os.close(retired_fd)
        views = []
        if header.leaves:  # each (slot id, offset, dtype, shape, nbytes, as_tensor)
            pool.peak_need = max(pool.peak_need, max(leaf[1] + leaf[4] for leaf in header.leaves))
            if self.registry is None:
                views = pool.lease_leaves(header.leaves)
            else:
                # a slot registered with CUDA is leased whole: its pages stay where the
                # registration maps them, and the batch stays in registered memory
                owners = {slot_id: pool.lease(slot_id) for slot_id in {leaf[0] for leaf in header.leaves}}
                views = [_view(owners[leaf[0]], *leaf[1:]) for leaf in header.leaves]
        payload = _LeafUnpickler(io.BytesIO(body), views).load()
        return Done(header.task_id, payload, header.work), header

    def _adopt(self, pool: SlotPool, slot_id: int, size: int, fd: int) -> None:
        try:
            pool.maps[slot_id] = map_fd(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if self.registry is not None:
            self._register(pool.maps[slot_id])
        pool.sizes[slot_id] = size
        if len(pool.fds) < self._fd_budget:
            pool.fds[slot_id] = fd
        else:
            os.close(fd)

    def _warn_fallback(self) -> None:
        if not self._warned_fallback:
            self._warned_fallback = True
            warnings.warn(
                "stoker could not get shared memory for a batch (arena limit "
                f"{ARENA_LIMIT_ENV}={os.environ.get(ARENA_LIMIT_ENV, 'unset')} reached or the system "
                "is out of memory); batches are sent by pickling instead, which is slower",
                RuntimeWarning,
                stacklevel=6,
            )

    def _check_held(self, pool: SlotPool) -> None:
        if not self._warned_held and len(pool.maps) > self.HELD_WARNING_SLOTS * max(1, len(self._workers)):
            self._warned_held = True
            total = pool.resident_bytes / 2**20
            warnings.warn(
                f"a DataLoader worker's shared-memory arena has grown to {len(pool.maps)} slots "
                f"({total:.0f} MiB in use): the large arrays of batches you keep hold their "
                "memory, as they would with torch's loader. Copy what you keep "
                "(np.array(x) / tensor.clone()) if you meant to keep only a part of it.",
                RuntimeWarning,
                stacklevel=6,
            )

    def settle(self) -> None:
        """Give back now the pages of arrays gone from batches that are partly kept."""
        with self._lock:
            self.slots.settle()

    def trim(self) -> None:
        """Give back the pages of every free slot; called when an engine's workers are gone."""
        with self._lock:
            self.slots.trim()

    def reserved_bytes(self) -> int:
        """Bytes of all the slots this arena knows of, whether they hold a batch or are
        free: the shared memory the loader keeps reserved."""
        with self._lock:
            return self.slots.bytes


def _close_fds(pool: SlotPool) -> None:
    pool.settle()  # slots still leased by kept arrays outlive the arena: only those stay held
    fds, pool.fds = pool.fds, {}
    for fd in fds.values():
        os.close(fd)


def _view(owner: np.ndarray, offset: int, dtype: str, shape: tuple[int, ...], nbytes: int, as_tensor: bool) -> Any:
    array = owner[offset : offset + nbytes].view(dtype).reshape(shape)
    return _as_tensor(array) if as_tensor else array


def _as_tensor(array: np.ndarray) -> Any:
    import torch  # a worker made a tensor; this process may not have imported torch yet

    return torch.from_numpy(array)


class ArenaLink:
    """One engine's use of the loader's arena: which slots each worker process maps, and
    which slot each task in flight was given. Main side of the arena transport."""

    def __init__(self, arena: Arena, num_workers: int) -> None:
        self.arena = arena
        self._mapped: list[set[int]] = [set() for _ in range(num_workers)]
        self._drop: list[list[int]] = [[] for _ in range(num_workers)]  # retired by another worker
        self._assigned: dict[int, tuple[int, int]] = {}  # task id -> (worker id, slot id)

    def worker_side(self) -> SlotWriter:
        return SlotWriter()

    def send_request(self, worker_id: int, conn: Any, message: Request) -> None:
        if not isinstance(message, Task):
            conn.send_bytes(pickle.dumps(message, protocol=5))
            return
        drop = self._drop[worker_id]
        order = self.arena.order(worker_id, self._mapped[worker_id], tuple(drop) if drop else ())
        drop.clear()
        if order.use is not None:
            self._assigned[message.task_id] = (worker_id, order.use)
        wire = (message.task_id, message.index, message.epoch, message.batch, tuple(order))
        conn.send_bytes(pickle.dumps(wire, protocol=5))
        if order.attach:
            assert order.use is not None
            _send_fds(conn, [self.arena.fd_of(worker_id, order.use)])
            self._mapped[worker_id].add(order.use)

    def recv_reply(self, worker_id: int, conn: Any) -> Reply:
        reply, header = self.arena.receive(worker_id, conn)
        given = self._assigned.pop(reply.task_id, (worker_id, None))[1]
        mapped = self._mapped[worker_id]
        used: set[int] = set()
        if header is not None:
            mapped.update(slot_id for slot_id, _ in header.new)
            mapped.difference_update(header.retired)
            for other, theirs in enumerate(self._mapped):  # they unmap it with their next task
                for slot_id in theirs.intersection(header.retired):
                    theirs.discard(slot_id)
                    self._drop[other].append(slot_id)
            used = {leaf[0] for leaf in header.leaves} | set(header.retired)
        if given is not None and given not in used:
            self.arena.release(worker_id, given)
        return reply

    def forget_worker(self, worker_id: int) -> None:
        """The worker process died: its tasks' slots are free, and its replacement has
        mapped nothing yet."""
        for task_id, (owner, slot_id) in list(self._assigned.items()):
            if owner == worker_id:
                del self._assigned[task_id]
                self.arena.release(owner, slot_id)
        self._mapped[worker_id] = set()
        self._drop[worker_id] = []

    def close(self) -> None:
        """The workers are gone: slots given to tasks that never answered are free again."""
        assigned, self._assigned = self._assigned, {}
        for worker_id, slot_id in assigned.values():
            self.arena.release(worker_id, slot_id)
        self.arena.trim()


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, views: list[Any]) -> None:
        super().__init__(stream)
        self.views = views

    def persistent_load(self, pid: Any) -> Any:
        return self.views[pid]
