"""Arena slots registered with CUDA, so that batches are born pinned: opt-in.

A tensor that views a slot registered with CUDA (`cudaHostRegister`) is pinned
(`is_pinned()` is true, `non_blocking=True` copies are asynchronous) with no pin copy. But
that memory is not torch's: torch's caching host allocator records an event on the stream of
every copy that reads one of its pinned blocks and reuses the block only once all of them are
done, and nothing of the kind can follow a registered slot. So slots are registered, and
batches handed out born pinned, only where the copies that read them are known:

- `pin_memory="born"`: the user accepts the rule below (copies on the loop thread's current
  stream, or synchronised before the batch is dropped);
- stoker's own `to_device` over a loader with `pin_memory=True`: each host batch stays
  referenced until its copy on `to_device`'s stream has completed (see device).

Plain `pin_memory=True` never hands out a registered slot: the pin thread copies each batch
into torch's pinned memory, and a batch in a slot that an earlier born-pinned pass registered
is copied too (`Registry.copied`; a tensor in a registered slot is already "pinned", so its
`pin_memory()` would return the slot itself). Workers never touch CUDA: they write into the
slots as before.

```
 main process                                         CUDA
 map slot (Arena._adopt) ──register(address, size)──▶ slot pinned
 batch views the slot ──► consumer copies non_blocking ──► DMA reads the slot
 last view gone: slot released
 slot taken for a new task (SlotPool.take_free):
     a fence (an event on the current stream) is recorded when the released slot comes
     back; the slot goes to a worker only once its fence is done (if no other slot is
     free, the loader waits on the oldest fence)
 slot retired / arena dropped: wait for a fence, unregister, then unmap
```

The reuse rule covers copies queued on the loop thread's current stream (where `.to(device,
non_blocking=True)` queues them) and `to_device`'s copies. A copy queued on another stream
(or from another thread, whose current stream is its own) must be synchronised before its
host batch is dropped.

Registration that fails (a locked-memory limit, a driver refusing) is not retried: one
warning names the cause, and from then on new slots are not registered and their batches go
through the pin thread. The CUDA calls go through a `Registrar`, so that the bookkeeping is
tested with a double, without a GPU.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import numpy as np

from .pin import WALK, map_batch

BORN: Literal["born"] = "born"  # pin_memory=BORN: batches born pinned in the arena (the opt-in)
PIN_MEMORY_VALUES = "True, False or 'born'"


def check_pin_memory(value: Any) -> bool | Literal["born"]:
    """`pin_memory` as the loader keeps it: a bool, or `BORN`.

    Raises ValueError for another string and TypeError for a value that is neither a bool
    (0 and 1 count as one, as numpy's bools do) nor a string; both name the argument and the
    accepted values.
    """
    if isinstance(value, str):
        if value == BORN:
            return BORN
        raise ValueError(
            f"pin_memory should be {PIN_MEMORY_VALUES} ('born': batches born pinned in stoker's "
            f"shared-memory arena, see docs/guide/feeding-a-gpu.md), but got pin_memory={value!r}"
        )
    try:
        flag = value is not None and value in (True, False)
    except (TypeError, ValueError):  # an array's ambiguous truth
        flag = False
    if not flag:
        raise TypeError(f"pin_memory should be {PIN_MEMORY_VALUES}, but got pin_memory={value!r}")
    return bool(value)


class Fence(Protocol):
    """Marks the work queued so far on a stream."""

    def done(self) -> bool:
        """Whether that work has completed."""
        ...

    def wait(self) -> None:
        """Block until that work has completed."""
        ...


class Registrar(Protocol):
    """The CUDA side of pinning: register and unregister host memory, fence a stream."""

    def register(self, address: int, size: int) -> None:
        """Pin `size` bytes at `address` in place; raises an exception saying why it cannot."""
        ...

    def unregister(self, address: int) -> None:
        """Undo `register` for the memory at `address`."""
        ...

    def fence(self) -> Fence:
        """A fence after the work queued so far on the current stream."""
        ...

    def pinned_copy(self, tensor: Any) -> Any:
        """A copy of `tensor` (on the CPU) in torch's own pinned memory, same shape and strides."""
        ...


class _EventFence:
    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class CudaRegistrar:
    """`cudaHostRegister` / `cudaHostUnregister` through torch's CUDA runtime bindings, and
    fences that are CUDA events."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self._cudart = torch.cuda.cudart()

    def register(self, address: int, size: int) -> None:
        error = self._cudart.cudaHostRegister(address, size, 0)
        if _code(error) != 0:
            raise RuntimeError(f"cudaHostRegister of a {size}-byte arena slot failed: {_name(error)}")

    def unregister(self, address: int) -> None:
        self._cudart.cudaHostUnregister(address)

    def fence(self) -> Fence:
        event = self._torch.cuda.Event()
        event.record()
        return _EventFence(event)

    def pinned_copy(self, tensor: Any) -> Any:
        # torch's caching host allocator: it tracks the streams of the copies that read it
        copied = self._torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, pin_memory=True)
        return copied.copy_(tensor)


def _code(error: Any) -> int:
    try:
        return int(error)
    except TypeError:
        return int(getattr(error, "value", 1))


def _name(error: Any) -> str:
    return str(getattr(error, "name", error))


def cuda_registrar() -> Registrar | None:
    """A `CudaRegistrar` when torch is loaded here and CUDA is available, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    try:
        return CudaRegistrar(torch)
    except (AttributeError, RuntimeError):  # a torch without cudart bindings
        return None


class Registry:
    """What one arena has registered: address ranges, and the rule for unregistering."""

    def __init__(self, registrar: Registrar) -> None:
        self.registrar = registrar
        self._starts: list[int] = []  # sorted
        self._ends: dict[int, int] = {}
        # the pin thread asks `holds` while the main thread (or a collection anywhere) adds
        # and removes mappings
        self._lock = threading.Lock()
        self.failure: str | None = None  # why registration stopped, once it failed

    def add(self, address: int, size: int) -> bool:
        """Register one mapping; False (after one warning, the first time) if it cannot be."""
        if self.failure is not None:
            return False
        try:
            self.registrar.register(address, size)
        except Exception as exc:
            self.failure = str(exc) or type(exc).__name__
            warnings.warn(
                f"pin_memory=True: stoker could not pin its shared-memory arena in place "
                f"({self.failure}); batches in slots it could not register are pinned by "
                "copying on the pin thread instead, as torch does (slower). A locked-memory "
                "limit (ulimit -l) is the usual cause.",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        with self._lock:
            bisect.insort(self._starts, address)
            self._ends[address] = address + size
        return True

    def remove(self, address: int) -> None:
        """Unregister one mapping (about to be unmapped), once copies that may read it are done."""
        with self._lock:
            if self._ends.pop(address, None) is None:
                return
            self._starts.remove(address)
        try:
            self.registrar.fence().wait()
            self.registrar.unregister(address)
        except Exception:  # interpreter shutdown: CUDA may be gone; the unmap follows anyway
            pass

    def holds(self, pointer: int) -> bool:
        """Whether `pointer` lies in a registered mapping."""
        with self._lock:
            at = bisect.bisect_right(self._starts, pointer) - 1
            return at >= 0 and pointer < self._ends[self._starts[at]]

    def __len__(self) -> int:
        return len(self._starts)

    def born_pinned(self, batch: Any, strict: bool = False) -> bool:
        """Whether every tensor in `batch` lies in a registered slot (then it needs no pin
        step); containers as the pin step walks them (dicts, lists, tuples). `strict`: a
        numpy array (which no pin step pins, and `to_device` passes on as it is) makes it
        False too, so that no view of a registered slot reaches the consumer."""
        torch = sys.modules.get("torch")
        tensor = torch.Tensor if torch is not None else ()
        todo = [batch]
        while todo:
            item = todo.pop()
            if isinstance(item, tensor):
                if item.numel() and not self.holds(item.data_ptr()):
                    return False
            elif isinstance(item, np.ndarray):
                if strict and item.size:
                    return False
            elif isinstance(item, Mapping):
                todo.extend(item.values())
            elif isinstance(item, (list, tuple)):
                todo.extend(item)
            elif hasattr(item, "pin_memory") and not isinstance(item, type):
                return False  # a custom batch type: its own pin_memory() decides
        return True

    def copied(self, batch: Any) -> Any:
        """`batch` with every array that lies in a registered slot replaced by a copy: a tensor
        by one in torch's pinned memory, a numpy array by an ordinary one; its structure is
        kept (see `pin.map_batch`). What the pin step then returns holds no registered slot."""
        if not len(self):
            return batch
        torch = sys.modules.get("torch")
        tensor = torch.Tensor if torch is not None else ()

        def leaf(item: Any) -> Any:
            if isinstance(item, tensor):
                if item.numel() and not item.is_cuda and self.holds(item.data_ptr()):
                    return self.registrar.pinned_copy(item)
                return item
            if isinstance(item, np.ndarray):
                if item.size and self.holds(item.__array_interface__["data"][0]):
                    return item.copy(order="K")
                return item
            return WALK

        return map_batch(batch, leaf)


def copying_out(pin: Callable[[Any], Any], arena: Any) -> Callable[[Any], Any]:
    """`pin`, run on a batch whose arrays in `arena`'s registered slots (if any are
    registered) were copied out first (`Registry.copied`): the pin step of a consumer that
    must not get a registered slot. `pin` itself without an arena."""
    if arena is None:
        return pin
    return functools.partial(_pin_copied, pin, arena)


def _pin_copied(pin: Callable[[Any], Any], arena: Any, batch: Any) -> Any:
    registry = arena.registry
    if registry is not None:
        batch = registry.copied(batch)
    return pin(batch)


def address_of(buffer: Any) -> int:
    """The address of a ctypes buffer."""
    return ctypes.addressof(buffer)
