"""Large arrays of a dataset reach spawn and forkserver workers through shared memory.

A fork worker inherits the dataset. A spawn or forkserver worker receives it pickled, which
for a dataset holding a 200 MB array means 200 MB pickled, piped and unpickled per worker.
`Packed(obj)` pickles `obj` inside the worker's start-up pickling, with every numpy array
(or CPU torch tensor) of at least `SHARE_MIN_BYTES` replaced by a reference to an anonymous
shared-memory copy made once in the main process, whatever the number of workers. The
worker maps that copy privately (copy-on-write: writes stay in the worker, as with a
pickled copy) and closes the descriptor; the main process closes its descriptors once the
workers have started. Nothing has a name, so nothing outlives the processes.

When pickle cannot take the object and it holds a torch DataPipe, a second try pickles
each DataPipe with `dill` (see datapipes), as torch's loader sends a pipe to its workers.
"""

from __future__ import annotations

import io
import os
from multiprocessing import reduction
from typing import Any

import numpy as np

from .arena import _as_array, map_fd
from .datapipes import datapipe_classes, import_dill, reduce_by_dill

SHARE_MIN_BYTES = 1 << 20


class _SharingPickler(reduction.ForkingPickler):
    def __init__(self, stream: io.BytesIO, packed: Packed) -> None:
        super().__init__(stream, 5)
        self.packed = packed
        self.used: list[int] = []

    def persistent_id(self, obj: Any) -> Any:
        found = _as_array(obj)
        if found is None or found[0].nbytes < SHARE_MIN_BYTES:
            return None
        index = self.packed.share(*found)
        self.used.append(index)
        return index


class _PipesByDill(_SharingPickler):
    """The second try's pickler: every torch DataPipe it meets is pickled by dill."""

    def __init__(self, stream: io.BytesIO, packed: Packed, pipes: tuple[type, ...], dill: Any) -> None:
        super().__init__(stream, packed)
        self.pipes = pipes
        self.dill = dill
        self.dilled = 0

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, self.pipes):
            return NotImplemented
        self.dilled += 1
        return reduce_by_dill(obj, self.dill)


class Packed:
    """An object to send to spawn/forkserver workers with its large arrays in shared memory."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self._shared: dict[int, tuple[Any, int, int, str, tuple[int, ...], bool]] = {}
        self._order: list[int] = []

    def share(self, array: np.ndarray, is_torch: bool) -> int:
        """The index of `array`'s shared copy, making it on first use.

        `is_torch`: `array` is a torch tensor's numpy view, to come back as a tensor.
        """
        key = id(array)
        if key not in self._shared:
            nbytes = array.nbytes
            fd = os.memfd_create("stoker-dataset", os.MFD_CLOEXEC)
            try:
                size = max(nbytes, 1)
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
                with open(os.dup(fd), "r+b", buffering=0) as f:
                    f.write(np.ascontiguousarray(array).data.cast("B"))
            except BaseException:
                os.close(fd)
                raise
            # keep the array alive so its id() cannot be reused while we are packing
            self._shared[key] = (array, fd, size, array.dtype.str, array.shape, is_torch)
            self._order.append(key)
        return self._order.index(key)

    def __reduce__(self) -> Any:
        stream = io.BytesIO()
        try:
            _SharingPickler(stream, self).dump(self.obj)
        except Exception as exc:
            stream = self._pipes_by_dill(exc)
        shared = []
        for key in self._order:
            _, fd, size, dtype, shape, is_torch = self._shared[key]
            shared.append((reduction.DupFd(fd), size, dtype, shape, is_torch))
        return _unpack, (stream.getvalue(), shared)

    def _pipes_by_dill(self, failure: Exception) -> io.BytesIO:
        """The object pickled with its DataPipes through dill, after plain pickling failed with
        `failure`; `failure` is raised again when there is no DataPipe, no dill, or dill fails."""
        pipes = datapipe_classes()
        dill = import_dill() if pipes else None
        if dill is None:
            raise failure
        stream = io.BytesIO()
        pickler = _PipesByDill(stream, self, pipes, dill)
        try:
            pickler.dump(self.obj)
        except Exception:
            raise failure from None
        if not pickler.dilled:
            raise failure
        return stream

    def close(self) -> None:
        """Close the main process's descriptors (the workers hold their own)."""
        for key in self._order:
            os.close(self._shared[key][1])
        self._shared.clear()
        self._order.clear()


def _map_private(fd: int, size: int) -> Any:
    return map_fd(fd, size, private=True, what="shared dataset array")


def _unpack(body: bytes, shared: list[tuple[Any, int, str, tuple[int, ...], bool]]) -> Any:
    import pickle

    arrays: list[Any] = []
    for dupfd, size, dtype, shape, is_torch in shared:
        fd = dupfd.detach()
        try:
            buffer = _map_private(fd, size)
        finally:
            os.close(fd)
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        array = np.frombuffer(buffer, dtype=dt, count=count).reshape(shape)
        if is_torch:
            import torch

            arrays.append(torch.from_numpy(array))
        else:
            arrays.append(array)

    class Loader(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return arrays[pid]

    return Loader(io.BytesIO(body)).load()
