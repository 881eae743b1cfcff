"""Errors that cross the worker boundary, and how they are rebuilt in the main process.

A worker's exception comes back as an `ExceptionInfo`: its type, its message, the
worker's formatted traceback and, when it pickles, the exception itself. The main process
re-raises it as the original type when that type can be rebuilt with a message, so
`except KeyError:` keeps working; the message names the worker, its pid and the sample
indices, and the worker's traceback is attached as `__cause__`. A worker that died is a
`WorkerDiedError`, distinct from the user's exceptions.
"""

from __future__ import annotations

import pickle
import signal
import sys
import traceback
from typing import Any

_MAX_INDICES_SHOWN = 16


class WorkerError(RuntimeError):
    """A worker raised an exception whose type cannot be rebuilt in the main process.

    Most exceptions a worker raises are re-raised as their own type; this one stands in
    for those that cannot be (their type does not pickle or take a message, or they are
    `StopIteration` or a `BaseException`). The worker's traceback is its `__cause__`.

    Args:
        message: What happened, naming the worker, its pid and the sample indices.
        type_name: The name of the original exception's type. Defaults to "".
    """

    def __init__(self, message: str, type_name: str = "") -> None:
        super().__init__(message)
        self.type_name = type_name


class WorkerDiedError(RuntimeError):
    """A DataLoader worker process exited or was killed while the loader needed it.

    The loader raises it; each argument is kept as the attribute of the same name. It can
    also be made from its message alone, `WorkerDiedError(str(error))`, as generic code
    rebuilds an exception (torch's worker-error wrapper, test harnesses); the attributes not
    given are then None. It pickles with its message and every attribute.

    Args:
        worker_id: The worker's number; or, given as a str, the whole message (then
            `worker_id` is None).
        pid: The worker's process id, None if it never started or is not known. Defaults to None.
        exitcode: How it ended: its exit code, negative when killed by signal
            `-exitcode`, None when it stopped responding or is not known. Defaults to None.
        detail: Text appended to the message (what the worker was doing). Defaults to "".
        batch: When the worker owed a batch, its number in the epoch. Defaults to None.
        index: When the worker owed a batch, what it fetched: the sample indices of
            that batch. Defaults to None.
    """

    def __init__(
        self,
        worker_id: int | str,
        pid: int | None = None,
        exitcode: int | None = None,
        detail: str = "",
        *,
        batch: int | None = None,
        index: Any = None,
    ) -> None:
        # pickle rebuilds an exception as type(e)(*e.args), then restores its attributes
        if isinstance(worker_id, str):
            message = worker_id + detail
            self.worker_id: int | None = None
        else:
            message = f"DataLoader worker {worker_id} (pid {pid}) {describe_exit(exitcode)}{detail}"
            self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode
        self.batch = batch
        self.index = index
        super().__init__(message)


class WorkerRestartWarning(RuntimeWarning):
    """A worker process died and was replaced (`max_worker_restarts`); nothing was lost.

    Warned once per restart, naming the worker, its exit and the batch it was refetching.
    """


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, attached as `__cause__`."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def describe_exit(exitcode: int | None) -> str:
    """Say how a process ended, naming the signal when it was killed."""
    if exitcode is None:
        return "stopped responding"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by signal {name} ({-exitcode})"
    return f"exited unexpectedly with exit code {exitcode}"


def describe_index(index: Any, iterable: bool) -> str:
    """A short description of what a task fetched, for error messages."""
    if iterable:
        count = "1 sample" if index is None else f"a batch of {index} samples"
        return f"while fetching {count} from its iterable dataset replica"
    if isinstance(index, list):
        shown = ", ".join(map(str, index[:_MAX_INDICES_SHOWN]))
        more = f", ... ({len(index)} in all)" if len(index) > _MAX_INDICES_SHOWN else ""
        return f"while fetching sample indices [{shown}{more}]"
    return f"while fetching sample index {index!r}"


class _KeyErrorMessage(str):
    """KeyError quotes its message through repr(); this keeps a multi-line message readable."""

    def __repr__(self) -> str:
        return str(self)


class ExceptionInfo:
    """A picklable record of an exception raised in a worker."""

    def __init__(self, exc: BaseException, where: str, keep_object: bool = False) -> None:
        self.as_is = False
        self.exc_type = type(exc)
        self.message = str(exc)
        self.where = where
        self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.local = exc if keep_object else None
        try:
            self.pickled: bytes | None = pickle.dumps(exc)
        except Exception:
            self.pickled = None

    @classmethod
    def unchanged(cls, exc: BaseException) -> ExceptionInfo:
        """A record that re-raises `exc` itself (raised in this process, in this thread's
        view: num_workers=0, or an error stoker makes about a worker)."""
        # never crosses a process boundary: no traceback text or pickled copy is made for it
        info = cls.__new__(cls)
        info.as_is = True
        info.exc_type = type(exc)
        info.message = str(exc)
        info.where = ""
        info.traceback = ""
        info.local = exc
        info.pickled = None
        return info

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["local"] = None
        try:
            pickle.dumps(self.exc_type)
        except Exception:
            state["exc_type"] = None
            state["unpicklable_type_name"] = getattr(self.exc_type, "__qualname__", "Exception")
        return state

    def type_name(self) -> str:
        if self.exc_type is None:
            return self.__dict__.get("unpicklable_type_name", "Exception")
        return self.exc_type.__name__

    def rebuild(self) -> BaseException:
        """The exception to raise in the main process: the original type when possible."""
        if self.as_is and self.local is not None:
            return self.local
        message = f"Caught {self.type_name()} {self.where}: {self.message}"
        # before 3.11 a traceback prints no notes: the cause then says where, as the note would
        said = "" if sys.version_info >= (3, 11) else f"\n\n{message}"
        cause = RemoteTraceback(f'{said}\n\nTraceback in the worker ({self.where}):\n"""\n{self.traceback}"""')
        exc = self._rebuild_typed(message)
        exc.__cause__ = cause
        return exc

    def _rebuild_typed(self, message: str) -> BaseException:
        exc_type = self.exc_type
        # StopIteration would silently end the user's loop; the others are not the user's.
        if (
            exc_type is None
            or issubclass(exc_type, (StopIteration, StopAsyncIteration))
            or not issubclass(exc_type, Exception)
        ):
            return WorkerError(message, self.type_name())
        try:
            exc = exc_type(_KeyErrorMessage(message) if issubclass(exc_type, KeyError) else message)
            if type(exc) is exc_type and str(exc) == message:
                return exc
        except Exception:
            pass
        original = self.local
        if original is None and self.pickled is not None:
            try:
                original = pickle.loads(self.pickled)
            except Exception:
                original = None
        if original is not None:
            if sys.version_info >= (3, 11):
                original.add_note(message)
            else:  # 3.10 has no add_note: the attribute 3.11 keeps notes in (its tracebacks print it)
                setattr(original, "__notes__", [*getattr(original, "__notes__", []), message])  # noqa: B010
            return original
        return WorkerError(message, self.type_name())


class UnshardedWarning(UserWarning):
    """Several training ranks run and a DataLoader's sampler does not split the dataset by
    rank, so every rank reads all of it.

    Warned at a loader's first `iter()`; give it a `DistributedSampler` (or shard an
    IterableDataset with `shard_for`) to read each sample once across ranks.
    """


class ReplicaUnsaved(Exception):
    """A replica's state could not be taken (its `state_dict()` raised, `kind="raised"`, or
    returned what pickle cannot hold, `kind="pickle"`): internal, `DataLoader.state_dict()`
    words it for the user, naming the dataset and `worker`. The message is the reason."""

    def __init__(self, reason: str, worker: int = 0, kind: str = "raised") -> None:
        super().__init__(reason)
        self.worker = worker
        self.kind = kind

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), (str(self), self.worker, self.kind)
