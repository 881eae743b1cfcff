"""The messages between the main process and its workers.

Every message is one of the frozen dataclasses below; nothing else crosses the boundary.

```
 main process                                   worker (thread or process)
 ─────────────                                  ──────────────────────────
   Task(task_id, index,  ───────────────────▶   fetch + collate (into `slot`, see arena)
        slot)
   Reset()               ───────────────────▶   next epoch: a fresh iterator over the
                                                  iterable dataset replica
   Stop()                ───────────────────▶   exit the loop
                         ◀───────────────────   Done(task_id, payload, work)
                         ◀───────────────────   Failed(task_id, error)
                         ◀───────────────────   Exhausted(task_id)   iterable replica ended;
                                                  the task carried no batch
```

`work` is the worker's timing of the batch (see stats), or None with `stats=False`.

Each Task gets exactly one reply, in the order the worker received the tasks. A worker
that fails in `worker_init_fn` keeps running and answers every task with that failure, so
the error surfaces in order, at the first batch that worker owed.

`index` is what the fetcher takes: a list of sample indices (map-style, auto-collation), a
single index (map-style, `batch_size=None`) or the number of samples to draw from the
iterable replica (`None` for one un-collated sample).

The arena transport (see arena) sends a `Task` and a `Done`'s header as plain tuples; their
records (`SlotOrder`, `SlotHeader` and the header kinds) are defined here, at the end, so that
`Task`, the arena's worker side and its main side import them from one place and imports
point one way: arena -> transport -> protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Union

from .errors import ExceptionInfo

if TYPE_CHECKING:
    from .stats import Work


class Compact:
    """Pickles a frozen dataclass as its class and field values: several times faster to
    pickle and unpickle than the default (a state dict), which matters once per batch."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), tuple([getattr(self, name) for name in self.__dataclass_fields__])  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Task(Compact):
    """Fetch one batch."""

    task_id: int
    index: Any
    epoch: int = 0  # the loader's epoch number (counted over its life, restored by a resume)
    batch: int = 0  # the batch's position in its epoch
    slot: SlotOrder | None = None  # process workers: the shared-memory slot to collate into


@dataclass(frozen=True)
class Reset:
    """Start a new epoch on a persistent worker (iterable datasets re-iterate)."""


@dataclass(frozen=True)
class Stop:
    """Leave the worker loop."""


@dataclass(frozen=True)
class Done(Compact):
    """A batch, encoded by the transport."""

    task_id: int
    payload: Any
    work: Work | None = None  # (samples, bytes, fetch_s, collate_s, busy_s); see stats


@dataclass(frozen=True)
class Failed:
    """The task raised, or its worker died (the main process makes that reply itself)."""

    task_id: int
    error: ExceptionInfo


@dataclass(frozen=True)
class ReplicaBatch(Compact):
    """A batch from an IterableDataset replica that keeps a state (`state_dict()`), with
    that state and the number of items drawn right after it: what a resume restores. The
    state travels as JSON text, or as `resume.UnsavedState` when it could not be saved."""

    batch: Any
    state: Any
    drawn: int


@dataclass(frozen=True)
class Exhausted:
    """The worker's iterable replica has no more batches this epoch."""

    task_id: int


Request = Union[Task, Reset, Stop]
Reply = Union[Done, Failed, Exhausted]


# ------------------------------------------------------------------ arena wire records
# Records cross the socket as plain tuples, which pickle at C speed (a dataclass costs
# ~8 µs each way per batch): a task as (task_id, index, epoch, batch, SlotOrder fields);
# a reply's header as one of
#   (SLOT, task_id, leaves, new, retired, work)   the batch's arrays lie in slots
#   (OUT_OF_BAND, task_id, sizes, work)           arrays follow as out-of-band frames
#   (PLAIN,)                                      Failed / Exhausted, pickled whole
# and a leaf (one array of the batch) as
#   (slot id, offset, dtype str, shape, nbytes, as_tensor: rebuilt as a torch tensor)
SLOT, OUT_OF_BAND, PLAIN = 0, 1, 2


class SlotOrder(NamedTuple):
    """Where a worker collates one task's batch (`Task.slot`)."""

    use: int | None  # a slot of the worker's pool to collate into, or None
    size: int  # that slot's size in bytes (0 when `use` is None)
    attach: bool  # the slot's descriptor follows the task: this process has not mapped it
    spare_id: int  # the id to give a slot the worker makes for this task
    size_hint: int  # bytes to make a slot of up front when `use` is None (0: unknown)
    budget: int | None  # bytes the pool may still grow by (None: unlimited)
    drop: tuple[int, ...] = ()  # slots this process maps that another worker retired: unmap them


class SlotHeader(NamedTuple):
    """A batch whose array leaves lie in slots; the pickled body follows, then new slots' fds."""

    task_id: int
    leaves: tuple[tuple[Any, ...], ...]  # (slot id, offset, dtype, shape, nbytes, as_tensor) each
    new: tuple[tuple[int, int], ...]  # (slot id, size) of slots made for this batch
    retired: tuple[int, ...]  # slots the worker dropped (outgrown)
    work: Any = None  # the Done's timing (see stats)
