"""Page-locked ("pinned") host memory for batches, and the pin_memory thread that does it.

With `pin_memory=True`, torch.utils.data copies every batch's tensors into pinned memory on
a thread of its own, so the training loop's thread never waits on the copy. This module is
that part of stoker:

- `pin_function(pin_memory_device, stacklevel)`: the function that pins one batch, or None
  (with torch's own warning) when pinning cannot happen: torch missing or no accelerator.
- `pin_batch(batch)`: pins the tensors of one batch, through dicts, namedtuples, lists,
  tuples and any other mapping or sequence, and any object with a `pin_memory()` method
  (custom batch types, as torch allows); strings, bytes and everything else come back as is.
- `device_setup()`: what makes the pin thread use the consumer's current accelerator device.
- `PinThread`: one daemon thread that pins the batches submitted to it, in submission order;
  the consumer takes each one by its key (and can wait for it without taking it, so that
  Ctrl-C during the wait loses nothing), errors surface at that batch's `take`, and
  `close()` stops it within `PIN_JOIN_TIMEOUT_S`.
"""

from __future__ import annotations

import copy
import functools
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, NamedTuple

from . import forksafe

PIN_JOIN_TIMEOUT_S = 1.0  # longest close() waits for the thread; a daemon left pinning does no harm
PIN_WAIT_SLICE_S = 0.1  # longest single wait in take()/wait(): bounds how late Ctrl-C is seen

PIN_THREAD_NOTE = "This exception was raised in the pin_memory thread, while pinning a batch."


# ------------------------------------------------------------------------- the pin step
def pin_function(pin_memory_device: str, stacklevel: int) -> Callable[[Any], Any] | None:
    """`pin_batch`, or None with torch's warning when torch or an accelerator is missing.

    `stacklevel` is passed to `warnings.warn` as is (1 names the caller of this function's
    own line, so a caller two frames below the user's code passes 3).
    """
    if pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as "
            f"the device, ignore pin_memory_device='{pin_memory_device}'.",
            stacklevel=stacklevel,
        )
    try:
        import torch
    except ImportError:
        warnings.warn(
            "'pin_memory' argument is set as true but torch is not installed, then device pinned memory won't be used.",
            stacklevel=stacklevel,
        )
        return None
    if not _accelerator_available(torch):
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=stacklevel,
        )
        return None
    return pin_batch


def _accelerator_available(torch: Any) -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6; CUDA only before
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def local_device_index(count: int) -> int | None:
    """torchrun's LOCAL_RANK when it names one of `count` devices: the device of this rank."""
    from .._data.distributed import ranks

    local = ranks()[2]
    return local if local is not None and 0 <= local < count else None


def device_setup() -> Callable[[], None] | None:
    """A function that makes the calling thread use this rank's accelerator device: the
    device LOCAL_RANK names under torchrun, else this thread's current one.

    Give it to `PinThread(init=...)`: the current device is per thread, and a pin thread that
    never set it would pin through device 0's context, creating one there (a process that
    trains on device 3 would then hold memory on device 0 too). None without torch or an
    accelerator.
    """
    try:
        import torch
    except ImportError:
        return None
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "set_device_index"):
        if not accelerator.is_available():
            return None
        local = local_device_index(accelerator.device_count())
        index = local if local is not None else accelerator.current_device_index()
        return functools.partial(accelerator.set_device_index, index)
    if not torch.cuda.is_available():
        return None
    local = local_device_index(torch.cuda.device_count())
    index = local if local is not None else torch.cuda.current_device()
    return functools.partial(torch.cuda.set_device, index)


WALK = object()  # what a `map_batch` leaf function returns for an object it does not replace


def map_batch(batch: Any, leaf: Callable[[Any], Any]) -> Any:
    """`batch` with every object that `leaf` replaces (returns other than `WALK` for) replaced;
    its structure is kept.

    Mappings and sequences are rebuilt as their own type where it can be (a mutable one is
    shallow-copied and its items replaced, so extra attributes survive); one that cannot be
    rebuilt becomes a dict or a list; namedtuples stay namedtuples. Strings, bytes and any
    other object come back unchanged. Shared by the pin step and `to_device`.
    """
    if isinstance(batch, (str, bytes, bytearray)):
        return batch
    done = leaf(batch)
    if done is not WALK:
        return done
    if isinstance(batch, Mapping):
        mapped = {key: map_batch(value, leaf) for key, value in batch.items()}
        try:
            if isinstance(batch, MutableMapping):
                clone = copy.copy(batch)
                clone.update(mapped)
                return clone
            return type(batch)(mapped)  # type: ignore[call-arg]
        except TypeError:
            return mapped
    if isinstance(batch, tuple):
        items = [map_batch(item, leaf) for item in batch]
        if hasattr(batch, "_fields"):  # a namedtuple takes its fields as arguments
            return type(batch)(*items)
        try:
            return type(batch)(items)
        except TypeError:
            return tuple(items)
    if isinstance(batch, Sequence):
        items = [map_batch(item, leaf) for item in batch]
        try:
            if isinstance(batch, MutableSequence):
                replaced = copy.copy(batch)
                for i, item in enumerate(items):
                    replaced[i] = item
                return replaced
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    return batch


def pin_batch(batch: Any) -> Any:
    """`batch` with every tensor in it copied to pinned memory; its structure is kept
    (see `map_batch`). Anything with a `pin_memory()` method (a tensor, or a custom batch
    type) is replaced by what that method returns."""
    return map_batch(batch, _pinned)


def _pinned(obj: Any) -> Any:
    pin = getattr(obj, "pin_memory", None)
    if callable(pin) and not isinstance(obj, type):
        return pin()
    return WALK


# ------------------------------------------------------------------------ the pin thread
class _Outcome(NamedTuple):
    ok: bool
    value: Any  # the pinned batch, or the exception pinning raised


class _Shared:
    """What the consumer and the pin thread share; nothing in it refers to the PinThread."""

    def __init__(self, pin: Callable[[Any], Any], init: Callable[[], None] | None) -> None:
        self.pin = pin
        self.init = init
        self.cond = threading.Condition(threading.RLock())
        self.queued: OrderedDict[int, Any] = OrderedDict()  # key -> batch, in submission order
        self.in_flight: int | None = None  # the key being pinned now
        self.keep_in_flight = True  # False once the key being pinned is discarded
        self.ready: dict[int, _Outcome] = {}
        self.closed = False
        self.init_error: BaseException | None = None

    def has(self, key: int) -> bool:
        return key in self.queued or key in self.ready or (key == self.in_flight and self.keep_in_flight)

    def pending(self) -> int:
        return len(self.queued) + len(self.ready) + self.keeping_in_flight()

    def keeping_in_flight(self) -> bool:
        return self.in_flight is not None and self.keep_in_flight


def _serve(shared: _Shared) -> None:
    """The pin thread's body."""
    if shared.init is not None:
        try:
            shared.init()
        except BaseException as error:
            with shared.cond:
                shared.init_error = error
                shared.cond.notify_all()
            return
    while _pin_next(shared):
        pass


def _pin_next(shared: _Shared) -> bool:
    # One batch per call, so that no batch stays referenced by this thread once it is done.
    with shared.cond:
        while not shared.queued and not shared.closed:
            shared.cond.wait()
        if shared.closed:
            return False
        key, batch = shared.queued.popitem(last=False)
        shared.in_flight = key
        shared.keep_in_flight = True
    try:
        outcome = _Outcome(True, shared.pin(batch))
    except BaseException as error:
        outcome = _Outcome(False, error)
    del batch
    with shared.cond:
        shared.in_flight = None
        if shared.keep_in_flight and not shared.closed:
            shared.ready[key] = outcome
        del outcome  # an error's traceback holds this frame: no cycle back to the batch
        shared.cond.notify_all()
        return not shared.closed


def _shut_down(shared: _Shared, thread: threading.Thread) -> None:
    with shared.cond:
        shared.closed = True
        shared.queued.clear()
        shared.ready.clear()
        shared.cond.notify_all()
    # A garbage collection on the pin thread itself can run this; it cannot join itself.
    if thread is not threading.current_thread() and thread.ident is not None:
        thread.join(PIN_JOIN_TIMEOUT_S)


class PinThread:
    """Pins batches on a daemon thread of its own, in the order they are submitted.

    `submit(key, batch)` queues a batch under a key unique among those pending; `take(key)`
    waits for it and returns it pinned, or raises what pinning it raised; `wait(key)` only
    waits, leaving it pending. `discard(key)` forgets a batch that will not be taken.
    `close()` (also run when this object is garbage-collected or at interpreter exit) drops
    everything pending and stops the thread.

    The thread holds only `pin` and `init` and the queue, never this object, so keep `pin`
    free of references to whatever owns this object.
    """

    def __init__(
        self,
        pin: Callable[[Any], Any],
        name: str = "stoker-pin",
        init: Callable[[], None] | None = None,
    ) -> None:
        """Start the thread; `init`, if given, runs on it once before the first batch."""
        self._shared = _Shared(pin, init)
        self._thread = threading.Thread(target=_serve, args=(self._shared,), name=name, daemon=True)
        self._close = forksafe.finalize(self, _shut_down, self._shared, self._thread)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The pin thread."""
        return self._thread

    @property
    def alive(self) -> bool:
        """Not closed, and the thread is running."""
        return self._close.alive and self._thread.is_alive() and self._shared.init_error is None

    @property
    def pending(self) -> int:
        """Batches submitted and not yet taken or discarded (queued, being pinned, or ready)."""
        with self._shared.cond:
            return self._shared.pending()

    def submit(self, key: int, batch: Any) -> None:
        """Queue `batch` for pinning under `key`; returns at once."""
        shared = self._shared
        with shared.cond:
            if shared.closed:
                raise RuntimeError("the pin_memory thread is closed; no batch can be pinned")
            if shared.has(key):
                raise ValueError(f"a batch with key {key} is already pending in the pin_memory thread")
            shared.queued[key] = batch
            shared.cond.notify_all()

    def wait(self, key: int, timeout: float | None = None) -> None:
        """Wait at most `timeout` seconds until the batch under `key` is pinned (or pinning it
        failed); it stays pending, for `take`. An exception raised while waiting (Ctrl-C's
        KeyboardInterrupt) leaves the batch pending too.

        Raises `TimeoutError` after `timeout`, `KeyError` for a key not pending, and
        `RuntimeError` once the thread is closed or gone.
        """
        with self._shared.cond:
            self._wait_ready(key, timeout)

    def take(self, key: int, timeout: float | None = None) -> Any:
        """The batch submitted under `key`, pinned; waits for it at most `timeout` seconds.

        Raises what pinning it raised (noting that it was raised in the pin_memory thread),
        `TimeoutError` after `timeout`, `KeyError` for a key not pending, and `RuntimeError`
        once the thread is closed or gone.
        """
        shared = self._shared
        with shared.cond:
            self._wait_ready(key, timeout)
            outcome = shared.ready.pop(key)
        if outcome.ok:
            return outcome.value
        error: BaseException = outcome.value
        _mark_pin_thread(error)
        raise error

    def _wait_ready(self, key: int, timeout: float | None) -> None:
        """Return once `key` is among the ready batches; the caller holds the condition."""
        shared = self._shared
        deadline = None if timeout is None else time.monotonic() + timeout
        while key not in shared.ready:
            if shared.closed:
                raise RuntimeError("the pin_memory thread is closed; its batches were dropped")
            if shared.init_error is not None:
                raise RuntimeError("the pin_memory thread failed to start") from shared.init_error
            if not shared.has(key):
                raise KeyError(f"no batch with key {key} is pending in the pin_memory thread")
            if not self._thread.is_alive():
                raise RuntimeError("the pin_memory thread exited unexpectedly")
            wait = PIN_WAIT_SLICE_S
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the pin_memory thread did not pin batch {key} within {timeout} s")
                wait = min(wait, remaining)
            shared.cond.wait(wait)

    def discard(self, key: int) -> bool:
        """Forget the batch under `key` (it will not be taken); whether one was pending."""
        shared = self._shared
        with shared.cond:
            if key in shared.queued:
                del shared.queued[key]
            elif key in shared.ready:
                del shared.ready[key]
            elif key == shared.in_flight and shared.keep_in_flight:
                shared.keep_in_flight = False
            else:
                return False
            return True

    def clear(self) -> int:
        """Forget every pending batch; how many there were."""
        shared = self._shared
        with shared.cond:
            count = shared.pending()
            shared.queued.clear()
            shared.ready.clear()
            shared.keep_in_flight = False
            return count

    def close(self) -> None:
        """Drop every pending batch and stop the thread, waiting for it at most
        `PIN_JOIN_TIMEOUT_S`. Idempotent; `take` raises RuntimeError afterwards."""
        self._close()


def _mark_pin_thread(error: BaseException) -> None:
    if sys.version_info >= (3, 11):
        error.add_note(PIN_THREAD_NOTE)
    elif error.__cause__ is None:
        error.__cause__ = RuntimeError(PIN_THREAD_NOTE)
