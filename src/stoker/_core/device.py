"""Batches placed on an accelerator ahead of the step that uses them: the pipeline every face
shares (`stoker.torch`'s `to_device`, `stoker.jax`'s `device_prefetch`).

```
  loader ──next()──▶ host batch i+depth ──copier.start──▶ copy under way (a stream, an event)
                                                                       │
  consumer ◀── device batch i ◀──copier.ready── batch i usable by the consumer's next work
                                    (when the consumer asks for i+1: copier.release(i),
                                     which waits for i's copy, then drops the host batch)
```

Everything happens synchronously in `__next__`: no thread. When the consumer asks for batch
i, the previous batch's host memory is let go, copies are started until `depth` batches after
i are in flight, and batch i is handed over. The guarantees:

- batches come out in the loader's order; an exception the loader raises surfaces at the batch
  where it was raised, after every earlier batch (their copies already in flight) is delivered;
- a host batch (which may be a view of a shared-memory arena slot that is reused once the
  batch is garbage-collected) stays referenced until its copy has completed;
- closing the iterator (or dropping it) waits for the copies in flight and lets their host
  batches go; nothing is left referenced.

The copy itself goes through a `Copier` (start / ready / release), one per framework, so the
ordering and lifetime rules here are tested without an accelerator: torch's are in
`torch_place.py` (`CudaCopier`, `HostCopier`), JAX's in `jax_place.py` (`JaxCopier`). A copier
may keep state per pass (`for_pass(depth)`, e.g. torch's CPU output pool) and drop it when the
pass closes or delivers an error (`drop_buffers()`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import (
    Iterable,
    Iterator,
)
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from .._base.checks import check_int
from . import forksafe

H = TypeVar("H")

DEFAULT_DEPTH = 2


# --------------------------------------------------------------------------- copiers
class Copier(Protocol[H]):
    """How one batch reaches the device. The iterator calls, for every batch, `start` once,
    then `ready` at most once, then `release` exactly once (also for a batch never readied).

    `keeps_host_until_copied`: the consumer gets copies of the batch's tensors, never the host
    tensors themselves, and `release` waits for those copies; so a stoker loader may hand this
    copier batches whose tensors are born pinned in its arena (see hostpin).

    Two optional methods, looked up by name: `for_pass(depth)` returns the copier one pass over
    the loader uses (one with state of its own, such as an `OutputPool`; called by
    `DeviceLoader.__iter__`), and `drop_buffers()` lets go of every buffer such a copier keeps
    for reuse (called when the pass is closed and when a failure is delivered)."""

    keeps_host_until_copied: bool

    def start(self, batch: Any) -> H:
        """Begin copying `batch` to the device; the handle keeps `batch` referenced."""
        ...

    def ready(self, handle: H) -> Any:
        """The device batch, usable on the consumer's current stream from now on."""
        ...

    def release(self, handle: H) -> None:
        """Wait until the copy has completed, then drop the host batch (and the device batch,
        if it was never readied)."""
        ...


@dataclass
# ------------------------------------------------------------------------- the iterator
@dataclass
class _Failed:
    """The exception the loader raised in place of a batch."""

    error: BaseException


class _Pipeline(Generic[H]):
    """What `DeviceIterator` holds; nothing in it refers to the iterator, so the iterator's
    finalizer can close it."""

    def __init__(self, source: Iterator[Any], copier: Copier[H], depth: int) -> None:
        self.source: Iterator[Any] | None = source
        self.copier = copier
        self.depth = depth
        self.pending: deque[H | _Failed] = deque()  # started copies (and a failure) in order
        self.current: H | None = None  # the batch last handed over: its host batch is kept
        self.failed = False  # a failure is pending: pull nothing more until it is delivered

    def next(self) -> Any:
        self._release_current()
        self._fill(self.depth + 1)
        if not self.pending:
            self.close()
            raise StopIteration
        entry = self.pending.popleft()
        if isinstance(entry, _Failed):
            self.failed = False
            error = entry.error
            del entry
            # this frame (and the pipeline) stays reachable from the error's traceback for as
            # long as the caller keeps the error: keep no buffer for reuse past this point
            self._drop_buffers()
            try:
                raise error
            finally:
                del error  # no cycle through this frame back to the exception
        self.current = entry
        return self.copier.ready(entry)

    def _fill(self, count: int) -> None:
        while self.source is not None and not self.failed and len(self.pending) < count:
            try:
                batch = next(self.source)
            except StopIteration:
                self.source = None
                return
            except Exception as error:
                self.pending.append(_Failed(error))
                self.failed = True
                return
            try:
                handle = self.copier.start(batch)
            except Exception as error:
                self.pending.append(_Failed(error))
                self.failed = True
                return
            finally:
                del batch
            self.pending.append(handle)

    def _release_current(self) -> None:
        current, self.current = self.current, None
        if current is not None:
            self.copier.release(current)

    def _drop_buffers(self) -> None:
        drop = getattr(self.copier, "drop_buffers", None)
        if drop is not None:
            drop()

    def close(self) -> None:
        """Wait for every copy in flight, let every host batch go, drop the loader's iterator
        and any buffer the copier keeps for reuse."""
        self.source = None
        self.failed = False
        try:
            self._release_current()
        finally:
            try:
                while self.pending:
                    entry = self.pending.popleft()
                    if not isinstance(entry, _Failed):
                        self.copier.release(entry)
            finally:
                self._drop_buffers()

    @property
    def in_flight(self) -> int:
        return sum(not isinstance(entry, _Failed) for entry in self.pending)


class DeviceIterator(Generic[H]):
    """One pass over a loader's batches, each already on the device (see `to_device`)."""

    def __init__(self, source: Iterator[Any], copier: Copier[H], depth: int) -> None:
        self._pipeline = _Pipeline(source, copier, depth)
        self._close = forksafe.finalize(self, self._pipeline.close)

    def __iter__(self) -> DeviceIterator[H]:
        return self

    def __next__(self) -> Any:
        """The next batch on the device; raises what the loader raised at this batch."""
        return self._pipeline.next()

    @property
    def in_flight(self) -> int:
        """Batches whose copies have been started and that have not been handed over."""
        return self._pipeline.in_flight

    def close(self) -> None:
        """Wait for the copies in flight and let their host batches go; later `next()` calls
        end the iteration. Idempotent; also run when the iterator is garbage-collected."""
        self._close()


class DeviceLoader(Generic[H]):
    """An iterable over `loader`'s batches on a device: every `iter()` is a new pass over
    `iter(loader)`, copied ahead by `depth` batches. `len()` is the loader's, where it has one."""

    def __init__(self, loader: Iterable[Any], copier: Copier[H], depth: int = DEFAULT_DEPTH) -> None:
        self.loader = loader
        self.copier = copier
        self.depth = check_depth(depth)

    def __iter__(self) -> DeviceIterator[H]:
        source = iter(self.loader)
        copier = self.copier
        for_pass = getattr(copier, "for_pass", None)
        if for_pass is not None:  # a copier with state of its own for each pass (an OutputPool)
            copier = for_pass(self.depth)
        if getattr(copier, "keeps_host_until_copied", False):
            from .iterator import LoaderIterator

            if isinstance(source, LoaderIterator):  # a stoker loader: born pinned is safe here
                source.allow_born_pinned()
        return DeviceIterator(source, copier, self.depth)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # TypeError without one, as len() says

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.loader!r}, {self.copier!r}, depth={self.depth})"


# ------------------------------------------------------------------------ arguments
def check_depth(depth: object) -> int:
    """`depth` if it is an int >= 1; TypeError or ValueError naming it otherwise."""
    return int(check_int("depth", depth, low=1, unit="batches copied ahead of the consumer"))
