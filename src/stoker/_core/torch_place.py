"""torch's face of the device pipeline (`device.py`): `to_device` and its copiers (`CudaCopier`:
a side stream and events; `HostCopier`: `.to("cpu")`, no stream), `normalize`, and the CPU
output pool.

The consumer's current stream waits for a batch's copy before any work it queues on it, and the
device memory of a batch is not reused before the work the consumer queued on it is done.

On the CPU a transform's outputs would otherwise be fresh memory every batch (154 MB of float32
for 256 ImageNet crops: faulted in page by page, then unmapped by free()); a transform that takes
`allocate` (`normalize` does) writes them into an `OutputPool` of the pass instead, whose buffers
are reused once nothing but the pool references them (see `OutputPool`).
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
from collections.abc import (
    Callable,
    Iterable,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._base.checks import check_callable, check_number, fail
from .device import DEFAULT_DEPTH, Copier, DeviceLoader, check_depth
from .pin import WALK, map_batch


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


@dataclass
class HostHandle:
    """A batch moved by `HostCopier`."""

    host: Any
    moved: Any


Transform = Callable[[Any], Any]
Allocate = Callable[[Sequence[int], Any], Any]


def _transformed(transform: Transform, batch: Any, **keywords: Any) -> Any:
    """`transform(batch, **keywords)`; its exception says where it was raised."""
    try:
        return transform(batch, **keywords)
    except Exception as error:
        if hasattr(error, "add_note"):  # Python 3.11+
            name = getattr(transform, "__qualname__", None) or repr(transform)
            error.add_note(f"raised by to_device's transform {name} on a batch it was given")
        raise


def takes_allocate(transform: object) -> bool:
    """Whether `transform` has a keyword-only parameter named `allocate` (see `to_device`)."""
    if transform is None:
        return False
    try:
        parameter = inspect.signature(transform).parameters.get("allocate")  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a callable without a signature Python can read
        return False
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


class OutputPool:
    """The output buffers of one pass of `to_device` on the CPU: called as `allocate(shape, dtype)`,
    it returns an uninitialised C-contiguous CPU tensor, in memory that is reused once nothing
    but the pool references it.

    Each buffer is a 1-D uint8 numpy array; the tensor handed out is `torch.from_numpy(buffer)`
    viewed as `dtype` and `shape`. torch keeps the array it was made from referenced for as long
    as the tensor's storage lives, so any tensor or view of it, `.numpy()` of one, a DLPack
    capsule, keeps the buffer's reference count above the pool's own; a buffer whose count is
    the pool's alone is not reachable from anything and is handed out again. (Pickling copies;
    `share_memory_()` moves the storage to new memory and lets the buffer go.)

    Bounds: the pool tracks at most `(depth + 2) * outputs` buffers, `outputs` being the most
    allocations one batch made: the consumer's previous batch (still bound to its loop variable
    while the next one is made), the `depth + 1` batches of the pipeline, and the one being made.
    Past that, a free buffer is dropped first, else the oldest one in use is forgotten (its
    holder owns it from then on). `drop()` forgets every buffer.
    """

    def __init__(self, depth: int) -> None:
        self._per_output = depth + 2
        self._outputs = 1  # most allocations seen in one batch
        self._taken = 0  # allocations in the batch being made
        self._buffers: list[np.ndarray] = []  # least recently handed out first
        # the count a buffer referenced only by `_buffers` reads in `_refs` on this interpreter
        self._buffers.append(np.empty(0, np.uint8))
        self._alone = self._refs(0)
        self._buffers.clear()

    def _refs(self, index: int) -> int:
        return sys.getrefcount(self._buffers[index])

    def _free(self, index: int) -> bool:
        return self._refs(index) == self._alone

    def begin_batch(self) -> None:
        """A new batch is being made (counts the allocations per batch)."""
        self._taken = 0

    def __call__(self, shape: Sequence[int], dtype: Any) -> Any:
        """An uninitialised contiguous CPU tensor of `shape` and `dtype` (a torch dtype)."""
        import torch

        if not isinstance(dtype, torch.dtype):
            fail(TypeError, "dtype", "a torch.dtype", dtype)
        shape = tuple(int(size) for size in shape)
        if any(size < 0 for size in shape):
            fail(ValueError, "shape", "sizes >= 0", shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:  # nothing to reuse
            return torch.empty(shape, dtype=dtype)
        self._taken += 1
        self._outputs = max(self._outputs, self._taken)
        buffer = None
        for index in range(len(self._buffers)):
            if self._buffers[index].nbytes == nbytes and self._free(index):
                buffer = self._buffers.pop(index)
                break
        if buffer is None:
            buffer = np.empty(nbytes, np.uint8)
        self._buffers.append(buffer)
        limit = self._per_output * self._outputs
        while len(self._buffers) > limit:
            free = [index for index in range(len(self._buffers)) if self._free(index)]
            del self._buffers[free[0] if free else 0]
        return torch.from_numpy(buffer).view(dtype).view(shape)

    @property
    def buffers(self) -> int:
        """How many buffers the pool tracks, free or in use."""
        return len(self._buffers)

    def drop(self) -> None:
        """Forget every buffer: a free one is freed, one in use is its holder's alone."""
        self._buffers.clear()


class HostCopier:
    """`tensor.to("cpu")` for every tensor: no stream, the copy (if any) done at `start`;
    then `transform`, if given, on the moved batch.

    A transform that takes `allocate` (see `takes_allocate`) is given `pool`, if there is one:
    `for_pass` makes a copier with a pool of its own for each pass."""

    keeps_host_until_copied = False  # `.to("cpu")` hands the host tensors themselves over

    def __init__(self, transform: Transform | None = None, *, pool: OutputPool | None = None) -> None:
        self.transform = transform
        self.pool = pool if takes_allocate(transform) else None

    def for_pass(self, depth: int) -> HostCopier:
        """The copier for one pass: with a new `OutputPool` when the transform takes `allocate`."""
        if not takes_allocate(self.transform):
            return self
        return HostCopier(self.transform, pool=OutputPool(depth))

    def start(self, batch: Any) -> HostHandle:
        """The batch with its tensors on the CPU, transformed."""
        moved = map_tensors(batch, lambda t: t.to("cpu"))
        if self.transform is not None:
            if self.pool is None:
                moved = _transformed(self.transform, moved)
            else:
                self.pool.begin_batch()
                moved = _transformed(self.transform, moved, allocate=self.pool)
        return HostHandle(batch, moved)

    def ready(self, handle: HostHandle) -> Any:
        """The moved batch."""
        moved, handle.moved = handle.moved, None
        return moved

    def release(self, handle: HostHandle) -> None:
        """Drop the batches."""
        handle.host = handle.moved = None

    def drop_buffers(self) -> None:
        """Forget the pool's buffers (see `OutputPool.drop`)."""
        if self.pool is not None:
            self.pool.drop()


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

    On the CPU, a transform with a keyword-only parameter `allocate` (`normalize`'s has one) is
    called as `transform(batch, allocate=allocate)`, where `allocate(shape, dtype)` returns an
    uninitialised C-contiguous CPU tensor for it to write an output into. Its memory is reused
    for a later batch once nothing references it any more (no tensor, view, `.numpy()` array or
    DLPack capsule of it is alive), so a batch, or any part of one, that the consumer keeps is
    never written again, and the main process does not fault in fresh pages every batch. Each
    pass keeps at most (depth + 2) buffers per output of a batch, and none once it is closed
    (or has delivered an exception). On a CUDA device the transform is called with the batch
    alone: torch's caching allocator reuses device memory already.

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
            returning the batch the consumer gets (see above; on the CPU it is also given
            `allocate=` when it takes that keyword). None: the batch as copied.
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

    The transform is `transform(batch, *, allocate=None)`. `allocate`: None, each result is a
    new tensor; or a function `allocate(shape, dtype)` returning an uninitialised C-contiguous
    CPU tensor, into which the result for a C-contiguous CPU uint8 tensor is written (the same
    values; other tensors get new ones). `to_device` on the CPU passes its output pool here,
    so that each batch's floats reuse the memory of a batch nobody holds any more.

    Args:
        mean: One mean per channel, in the scaled units (0 to 1 for `scale=255.0`).
        std: One standard deviation per channel, none of them zero, as many as `mean`.
        scale: What the uint8 values are divided by first. Defaults to 255.0.
        dtype: The torch dtype of the result; None: `torch.float32`. Defaults to None.
        key: Which item of each batch to normalize (a dict key, or an index of a tuple or
            list); None: every uint8 tensor in the batch. Defaults to None.

    Returns:
        The transform, a function of one batch (and of `allocate`, above), for
        `to_device(..., transform=...)`.

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

    def one(tensor: Any, allocate: Allocate | None) -> Any:
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
        if (
            allocate is not None
            and target is not torch.uint8
            and tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and tensor.numel() > 0
        ):
            # the conversion .to(target) would make, written into a buffer that is reused
            floats = allocate(tuple(tensor.shape), target).copy_(tensor)
            return torch.addcmul(b, floats, a, out=floats)
        floats = tensor.to(target)
        if floats is tensor:  # not a new tensor: the batch's own is never written
            return torch.addcmul(b, floats, a)
        return torch.addcmul(b, floats, a, out=floats)  # in place: no second batch-sized tensor

    def transform(batch: Any, *, allocate: Allocate | None = None) -> Any:
        if key is None:
            return map_tensors(batch, lambda tensor: one(tensor, allocate))
        if isinstance(batch, tuple):  # a tuple or a namedtuple: rebuilt with the one item changed
            items = list(batch)
            items[key] = one(items[key], allocate)
            return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
        batch = copy.copy(batch)
        batch[key] = one(batch[key], allocate)
        return batch

    transform.__qualname__ = f"normalize(mean={means}, std={stds})"
    return transform
