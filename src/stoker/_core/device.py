"""Batches copied to the accelerator ahead of the step that uses them: `to_device`.

```
  loader ──next()──▶ host batch i+depth ──copier.start──▶ copy on the side stream, event
                                                                       │
  consumer ◀── device batch i ◀──copier.ready── current stream waits on batch i's event
                                    (when the consumer asks for i+1: copier.release(i),
                                     which waits for i's copy, then drops the host batch)
```

Everything happens synchronously in `__next__`: no thread. When the consumer asks for batch
i, the previous batch's host memory is let go, copies are started until `depth` batches after
i are in flight, and batch i is handed over on the consumer's stream. The guarantees:

- batches come out in the loader's order; an exception the loader raises surfaces at the batch
  where it was raised, after every earlier batch (their copies already in flight) is delivered;
- a host batch (which may be a view of a shared-memory arena slot that is reused once the
  batch is garbage-collected) stays referenced until its copy has completed;
- the consumer's current stream waits for a batch's copy before any work it queues on it, and
  the device memory of a batch is not reused before the work the consumer queued on it is done;
- closing the iterator (or dropping it) waits for the copies in flight and lets their host
  batches go; nothing is left referenced.

The copy itself goes through a `Copier` (start / ready / release), chosen once: `CudaCopier`
(side stream, events) or `HostCopier` (`.to("cpu")`, no stream), so the ordering and lifetime
rules here are tested without an accelerator.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import (
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from .._base.checks import check_callable, check_int, check_number, fail
from . import forksafe
from .pin import WALK, map_batch

H = TypeVar("H")

DEFAULT_DEPTH = 2


# ------------------------------------------------------------------------- the tensors
def map_tensors(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """`batch` with every torch tensor `t` in it replaced by `fn(t)`; its structure is kept.

    The containers are those of `pin_batch`: mappings and sequences are rebuilt as their own
    type where it can be (a mutable one is shallow-copied and its items replaced); one that
    cannot be rebuilt becomes a dict or a list; namedtuples stay namedtuples. Strings, bytes
    and every other object come back unchanged.
    """
    import torch

    tensor = torch.Tensor
    return map_batch(batch, lambda obj: fn(obj) if isinstance(obj, tensor) else WALK)


# --------------------------------------------------------------------------- copiers
class Copier(Protocol[H]):
    """How one batch reaches the device. The iterator calls, for every batch, `start` once,
    then `ready` at most once, then `release` exactly once (also for a batch never readied).

    `keeps_host_until_copied`: the consumer gets copies of the batch's tensors, never the host
    tensors themselves, and `release` waits for those copies; so a stoker loader may hand this
    copier batches whose tensors are born pinned in its arena (see hostpin)."""

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
class HostHandle:
    """A batch moved by `HostCopier`."""

    host: Any
    moved: Any


Transform = Callable[[Any], Any]


def _transformed(transform: Transform, batch: Any) -> Any:
    """`transform(batch)`; its exception says where it was raised."""
    try:
        return transform(batch)
    except Exception as error:
        if hasattr(error, "add_note"):  # Python 3.11+
            name = getattr(transform, "__qualname__", None) or repr(transform)
            error.add_note(f"raised by to_device's transform {name} on a batch it was given")
        raise


class HostCopier:
    """`tensor.to("cpu")` for every tensor: no stream, the copy (if any) done at `start`;
    then `transform`, if given, on the moved batch."""

    keeps_host_until_copied = False  # `.to("cpu")` hands the host tensors themselves over

    def __init__(self, transform: Transform | None = None) -> None:
        self.transform = transform

    def start(self, batch: Any) -> HostHandle:
        """The batch with its tensors on the CPU, transformed."""
        moved = map_tensors(batch, lambda t: t.to("cpu"))
        if self.transform is not None:
            moved = _transformed(self.transform, moved)
        return HostHandle(batch, moved)

    def ready(self, handle: HostHandle) -> Any:
        """The moved batch."""
        moved, handle.moved = handle.moved, None
        return moved

    def release(self, handle: HostHandle) -> None:
        """Drop the batches."""
        handle.host = handle.moved = None


@dataclass
class CudaHandle:
    """A batch whose copy was queued on `CudaCopier`'s side stream, and the event after it."""

    host: Any
    moved: Any
    event: Any
    tensors: list[Any] = field(default_factory=list)


class CudaCopier:
    """Copies on a side stream of `device`, one event per batch (see the module's docstring);
    `transform`, if given, runs on each copied batch on that stream, before the event."""

    transform: Transform | None = None
    keeps_host_until_copied = True

    def __init__(self, device: Any, transform: Transform | None = None) -> None:
        """`device`: a `torch.device` of type cuda with an index."""
        import torch

        self._torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.transform = transform

    def start(self, batch: Any) -> CudaHandle:
        """Queue the copies of `batch`'s tensors (and the transform's work) on the side stream
        and record an event."""
        torch = self._torch
        tensors: list[Any] = []

        def move(tensor: Any) -> Any:
            moved = tensor.to(self.device, non_blocking=True)
            tensors.append(moved)
            return moved

        def keep(tensor: Any) -> Any:
            tensors.append(tensor)
            return tensor

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            try:
                moved = map_tensors(batch, move)
                if self.transform is not None:
                    moved = _transformed(self.transform, moved)
                    tensors = []  # the transform's output is what the consumer's stream uses
                    moved = map_tensors(moved, keep)
            except BaseException:
                # copies already queued still read the host batch: let them finish first
                self.stream.synchronize()
                raise
            event = torch.cuda.Event()
            event.record(self.stream)
        return CudaHandle(batch, moved, event, tensors)

    def ready(self, handle: CudaHandle) -> Any:
        """Make the consumer's current stream wait for the copy, and mark the device tensors
        as used by it, so that their memory is not reused before its work on them is done."""
        current = self._torch.cuda.current_stream(self.device)
        current.wait_event(handle.event)
        for tensor in handle.tensors:
            tensor.record_stream(current)
        moved, handle.moved, handle.tensors = handle.moved, None, []
        return moved

    def release(self, handle: CudaHandle) -> None:
        """Wait for the copy (at once if it is done), then drop the host batch."""
        handle.event.synchronize()
        handle.host = handle.moved = None
        handle.tensors = []


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

    def close(self) -> None:
        """Wait for every copy in flight, let every host batch go, drop the loader's iterator."""
        self.source = None
        self.failed = False
        try:
            self._release_current()
        finally:
            while self.pending:
                entry = self.pending.popleft()
                if not isinstance(entry, _Failed):
                    self.copier.release(entry)

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
        if getattr(self.copier, "keeps_host_until_copied", False):
            from .iterator import LoaderIterator

            if isinstance(source, LoaderIterator):  # a stoker loader: born pinned is safe here
                source.allow_born_pinned()
        return DeviceIterator(source, self.copier, self.depth)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # TypeError without one, as len() says

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.loader!r}, {self.copier!r}, depth={self.depth})"


# ------------------------------------------------------------------------ arguments
def check_depth(depth: object) -> int:
    """`depth` if it is an int >= 1; TypeError or ValueError naming it otherwise."""
    return int(check_int("depth", depth, low=1, unit="batches copied ahead of the consumer"))


def default_device() -> str:
    """'cuda:LOCAL_RANK' under torchrun (LOCAL_RANK set), else 'cuda' (the current device)."""
    from .._data.distributed import ranks

    local = ranks()[2]
    return "cuda" if local is None else f"cuda:{local}"


def resolve_device(device: object) -> Any:
    """`device` as a `torch.device` with an index for CUDA; raises TypeError for a value that
    is not a device, and ValueError for a device other than cpu or cuda, or a CUDA device that
    does not exist here (saying which devices do)."""
    import torch

    accepted = "a torch.device, a string such as 'cuda:0' or 'cpu', or a CUDA device index >= 0"
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        fail(TypeError, "device", accepted, device)
    if isinstance(device, int):
        if device < 0:
            fail(ValueError, "device", accepted, device)
        device = f"cuda:{device}"
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a device torch knows: {exc}") from None
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ValueError(
            f"device {str(resolved)!r} is not supported by to_device: it copies to 'cpu' or to "
            f"a CUDA device ('cuda', 'cuda:N' or N)"
        )
    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = (
            f"torch {torch.__version__} was built without CUDA"
            if built is None
            else f"torch {torch.__version__} (CUDA {built}) finds no usable GPU"
        )
        raise ValueError(
            f"device {str(resolved)!r} does not exist: CUDA is not available here ({why}); the only device is 'cpu'"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= count:
        existing = ", ".join(f"'cuda:{i}'" for i in range(count))
        raise ValueError(
            f"device {str(resolved)!r} does not exist: this machine has {count} CUDA "
            f"device{'s' if count != 1 else ''} ({existing}) and 'cpu'"
        )
    return torch.device("cuda", index)


def to_device(
    loader: Iterable[Any],
    device: Any = None,
    *,
    depth: int = DEFAULT_DEPTH,
    transform: Transform | None = None,
) -> DeviceLoader[Any]:
    """An iterable over `loader`'s batches with every tensor in them already on `device`.

    While the consumer works on batch i, the host-to-device copies of batches i+1..i+depth are
    under way on a side stream of their own. Each batch is handed over on the consumer's
    current stream: that stream waits for the batch's copy before any work queued on it later,
    and the batch's device memory is not reused before that work is done. Each host batch is
    kept referenced until its copy has completed (so a batch in a reused shared-memory slot
    stays valid), and let go when the consumer asks for the next batch.

    Tensors are found inside dicts, lists, tuples, namedtuples and other mappings and
    sequences, whose structure is kept; everything else passes through unchanged. Copies from
    pinned memory (`pin_memory=True`) are asynchronous; others are still correct, only slower.
    Over a stoker DataLoader with `pin_memory=True` and process workers, a batch whose tensors
    all lie in the loader's shared-memory arena comes born pinned there (the slots registered
    with CUDA, no pin copy), which is safe here because each host batch is kept until its copy
    has completed; the loader's next `iter()` outside `to_device` pins by copying again.

    Memory: up to depth+1 batches are on the device at once (the one handed over and the
    `depth` copied ahead), plus any earlier batch the consumer still holds; and depth+1 host
    batches stay referenced, which a loader's prefetching does not count.

    The transform runs on each batch once it is on the device, on the copy stream after the
    batch's copy (so it overlaps the consumer's step, as the copy does). Workers can then
    ship uint8 images (a quarter of float32's bytes) and leave float conversion and
    normalisation to the GPU: see `normalize`. On the CPU it runs on the CPU, so the same
    code runs everywhere. Its exception surfaces at its batch, like the loader's, with a
    note naming the transform.

    Breaking out of the loop is safe: closing or dropping the iterator waits for the copies in
    flight and lets their batches go. An exception the loader raises surfaces at the batch
    where it was raised, after the earlier batches.

    Args:
        loader: Any iterable of batches (a stoker or torch DataLoader, a list). Every
            `iter()` over the result is a new pass over `iter(loader)`, and `len()` is the
            loader's.
        device: Where the tensors go: a `torch.device`, a string ('cuda', 'cuda:1',
            'cpu') or a CUDA device index; 'cpu' moves tensors with `.to("cpu")` and no
            stream. None: this rank's device, the one torchrun's LOCAL_RANK names, else the
            current CUDA device. Defaults to None.
        depth: How many batches are copied ahead of the consumer, an int >= 1.
            Defaults to 2.
        transform: A function of one batch, run on each batch once it is on the device,
            returning the batch the consumer gets (see above). None: the batch as copied.
            Defaults to None.

    Returns:
        An iterable over the batches on `device`, with `len()` when `loader` has one.

    Raises:
        TypeError: when `depth` is not an int, `transform` is not callable, or `device` is
            not a device, a string or an int.
        ValueError: when `depth` < 1, or `device` is not a CPU or CUDA device, or is a CUDA
            device that does not exist here (the message says which do).
    """
    depth = check_depth(depth)
    check_callable("transform", transform, none_ok=True, takes="one batch")
    resolved = resolve_device(default_device() if device is None else device)
    copier: Copier[Any] = HostCopier(transform) if resolved.type == "cpu" else CudaCopier(resolved, transform)
    return DeviceLoader(loader, copier, depth)


def normalize(
    mean: Sequence[float],
    std: Sequence[float],
    *,
    scale: float = 255.0,
    dtype: Any = None,
    key: Any = None,
) -> Transform:
    """A `to_device` transform: every uint8 tensor of a batch (or only `batch[key]`) becomes
    `(x / scale - mean) / std` in `dtype`, with `mean` and `std` per channel along
    dimension 1 (N, C, ...); other tensors and objects are left as they are.

    For ImageNet statistics: `normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))`.

    Args:
        mean: One mean per channel, in the scaled units (0 to 1 for `scale=255.0`).
        std: One standard deviation per channel, none of them zero, as many as `mean`.
        scale: What the uint8 values are divided by first. Defaults to 255.0.
        dtype: The torch dtype of the result; None: `torch.float32`. Defaults to None.
        key: Which item of each batch to normalize (a dict key, or an index of a tuple or
            list); None: every uint8 tensor in the batch. Defaults to None.

    Returns:
        The transform, a function of one batch, for `to_device(..., transform=...)`.

    Raises:
        TypeError: when `scale` is not a number.
        ValueError: when `mean` and `std` differ in length or are empty, `std` holds a zero,
            or `scale` is not positive and finite; the transform raises it at a batch whose
            channel count differs from theirs, naming both.
    """
    import torch

    means, stds = [float(m) for m in mean], [float(s) for s in std]
    if len(means) != len(stds) or not means:
        raise ValueError(
            f"mean and std should give one value per channel each, but got {len(means)} and {len(stds)} values"
        )
    if any(s == 0 for s in stds):
        fail(ValueError, "std", "values without a zero", stds)
    check_number("scale", scale, above=0)
    target = torch.float32 if dtype is None else dtype
    # (x / scale - mean) / std as one multiply-add: x * a + b
    multiplier = [1.0 / (scale * s) for s in stds]
    offset = [-m / s for m, s in zip(means, stds)]
    cached: dict[Any, tuple[Any, Any]] = {}

    def one(tensor: Any) -> Any:
        if tensor.dtype != torch.uint8:
            return tensor
        if tensor.dim() < 2 or tensor.shape[1] != len(means):
            raise ValueError(
                f"normalize has {len(means)} channels of mean and std, but got a uint8 tensor of "
                f"shape {tuple(tensor.shape)} (channels along dimension 1)"
            )
        where = (tensor.device, tensor.dim())
        if where not in cached:
            shape = (1, len(means)) + (1,) * (tensor.dim() - 2)
            cached[where] = (
                torch.tensor(multiplier, dtype=target, device=tensor.device).view(shape),
                torch.tensor(offset, dtype=target, device=tensor.device).view(shape),
            )
        a, b = cached[where]
        floats = tensor.to(target)
        if floats is tensor:  # not a new tensor: the batch's own is never written
            return torch.addcmul(b, floats, a)
        return torch.addcmul(b, floats, a, out=floats)  # in place: no second batch-sized tensor

    def transform(batch: Any) -> Any:
        if key is None:
            return map_tensors(batch, one)
        if isinstance(batch, tuple):  # a tuple or a namedtuple: rebuilt with the one item changed
            items = list(batch)
            items[key] = one(items[key])
            return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
        batch = copy.copy(batch)
        batch[key] = one(batch[key])
        return batch

    transform.__qualname__ = f"normalize(mean={means}, std={stds})"
    return transform
