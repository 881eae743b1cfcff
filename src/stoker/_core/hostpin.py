"""Arena slots registered with CUDA, so that batches are born pinned.

With `pin_memory=True` and CUDA in the main process, the main process registers each arena
slot with CUDA (`cudaHostRegister`) once, when it first maps the slot, and unregisters it
just before the slot is unmapped. A tensor that views a registered slot is pinned
(`is_pinned()` is true, `non_blocking=True` copies are asynchronous) with no pin copy, so
such a batch skips the pin thread; a batch with a tensor outside the registered slots (one
that did not fit a slot, or a dtype numpy lacks) still goes through it. Workers never touch
CUDA: they write into the slots as before.

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

The reuse rule covers copies queued on the consumer's current stream (where `.to(device,
non_blocking=True)` queues them) and `to_device`'s copies (which keep their host batch until
the copy is done). A copy queued on another stream must be synchronised before its host
batch is dropped, as for any pinned memory torch does not own.

Registration that fails (a locked-memory limit, a driver refusing) is not retried: one
warning names the cause, and from then on new slots are not registered and their batches go
through the pin thread. The CUDA calls go through a `Registrar`, so that the bookkeeping is
tested with a double, without a GPU.
"""

from __future__ import annotations

import bisect
import ctypes
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Protocol


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
        bisect.insort(self._starts, address)
        self._ends[address] = address + size
        return True

    def remove(self, address: int) -> None:
        """Unregister one mapping (about to be unmapped), once copies that may read it are done."""
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
        at = bisect.bisect_right(self._starts, pointer) - 1
        return at >= 0 and pointer < self._ends[self._starts[at]]

    def __len__(self) -> int:
        return len(self._starts)

    def born_pinned(self, batch: Any) -> bool:
        """Whether every tensor in `batch` lies in a registered slot (then it needs no pin
        step); containers as the pin step walks them (dicts, lists, tuples)."""
        torch = sys.modules.get("torch")
        tensor = torch.Tensor if torch is not None else ()
        todo = [batch]
        while todo:
            item = todo.pop()
            if isinstance(item, tensor):
                if item.numel() and not self.holds(item.data_ptr()):
                    return False
            elif isinstance(item, Mapping):
                todo.extend(item.values())
            elif isinstance(item, (list, tuple)):
                todo.extend(item)
            elif hasattr(item, "pin_memory") and not isinstance(item, type):
                return False  # a custom batch type: its own pin_memory() decides
        return True


def address_of(buffer: Any) -> int:
    """The address of a ctypes buffer."""
    return ctypes.addressof(buffer)
