"""A worker's dataset replica in a loader's state: what a worker reports with each batch,
what the loader keeps, and what a resumed worker puts back before its first fetch.

A replica is the dataset object one worker reads (with `num_workers=0`, the loader's own
dataset). What of it a state holds, by kind:

- an IterableDataset: the dataset's own state and its iterator's (each only if it follows
  the Stateful protocol, `resume.is_stateful`), taken every `snapshot_every` batches of the
  replica and when its stream ends, and how many items the replica drew by then and by the
  last delivered batch. A resume loads the dataset's state, calls `iter()`, loads the
  iterator's state, then draws and drops the items drawn since that snapshot (a replay,
  uncollated, in the worker). A stream that keeps no state is replayed from the epoch's
  start, as torchdata does: exact, at the cost of drawing those items again.
- a map-style dataset that is Stateful: its state (e.g. the RNG its `__getitem__` draws
  from), taken after every `snapshot_every`-th batch the worker fetched; a resume loads it
  into that worker's replica before it fetches.

States are pickled where they are taken: a snapshot that no later change to the dataset's
objects can alter, equal to what `state_dict()` returned and of the same types (int keys,
tuples, numpy arrays, torch tensors), never converted. The loader unpickles them afresh for
each `state_dict()` and pickles a loaded state at once, so neither the caller nor a replica
ever shares an object with the loader's copy.

```
record in a loader state = {"dataset": state | None, "iterator": state | None,
                            "replay": items to draw again after the states are loaded,
                            "drawn": items drawn this epoch by the last delivered batch,
                            "ended": the stream ended this epoch}
```
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from .errors import ReplicaUnsaved
from .protocol import Compact


@dataclass(frozen=True)
class Unsaved:
    """Why a replica's state could not be taken: its `state_dict()` raised (`kind="raised"`)
    or returned what pickle cannot hold (`kind="pickle"`). The stream goes on; the loader's
    `state_dict()` raises, naming the dataset, the worker and this reason."""

    reason: str
    kind: str = "raised"


@dataclass(frozen=True)
class Record(Compact):
    """What a worker sends with a batch (and with the end of its stream): a new snapshot
    (`taken`), or only how far the replica got since the last one."""

    taken: bool
    dataset: bytes | None = None  # pickled dataset state (taken only)
    iterator: bytes | None = None  # pickled iterator state (taken only)
    drawn_at: int = 0  # items drawn when the snapshot was taken
    drawn: int = 0  # items drawn by the end of this batch
    ended: bool = False
    unsaved: Unsaved | None = None


@dataclass(frozen=True)
class Kept:
    """The loader's copy of one replica's place: its last snapshot and how far it got."""

    dataset: bytes | None = None
    iterator: bytes | None = None
    drawn_at: int = 0
    drawn: int = 0
    ended: bool = False
    unsaved: Unsaved | None = None

    def after(self, record: Record) -> Kept:
        """This place moved on by a record the same worker sent later."""
        if record.taken:
            return Kept(record.dataset, record.iterator, record.drawn_at, record.drawn, record.ended, record.unsaved)
        return Kept(self.dataset, self.iterator, self.drawn_at, record.drawn, record.ended, self.unsaved)

    def carried(self) -> Kept:
        """The place a replica starts its next epoch from (persistent workers, or the loader's
        own dataset): the dataset's state at its stream's end, a fresh iterator, nothing drawn."""
        return Kept(self.dataset, None, 0, 0, False, self.unsaved)

    def saved(self) -> dict[str, Any]:
        """As a loader state holds it (the user's states unpickled afresh)."""
        return {
            "dataset": _loads(self.dataset),
            "iterator": _loads(self.iterator),
            "replay": self.drawn - self.drawn_at,
            "drawn": self.drawn,
            "ended": self.ended,
        }

    @classmethod
    def loaded(cls, saved: Any, where: str) -> Kept | None:
        """A record of a loader state, checked, with its states pickled now. Raises
        ValueError naming `where` for a record of another shape."""
        if saved is None:
            return None
        keys = {"dataset", "iterator", "replay", "drawn", "ended"}
        if not isinstance(saved, dict) or set(saved) != keys:
            raise ValueError(
                f"this DataLoader state's {where} is not a replica record (a dict with keys "
                f"{', '.join(sorted(keys))}); it was not applied"
            )
        replay, drawn = saved["replay"], saved["drawn"]
        if not (_count(replay) and _count(drawn) and replay <= drawn):
            raise ValueError(
                f"this DataLoader state's {where} has replay={replay!r} and drawn={drawn!r}: both "
                "must be counts, replay at most drawn; it was not applied"
            )
        return cls(
            _dumps(saved["dataset"], where),
            _dumps(saved["iterator"], where),
            drawn - replay,
            drawn,
            bool(saved["ended"]),
        )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _loads(blob: bytes | None) -> Any:
    return None if blob is None else pickle.loads(blob)


def _dumps(state: Any, where: str) -> bytes | None:
    if state is None:
        return None
    try:
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ValueError(f"this DataLoader state's {where} cannot be pickled ({exc}); it was not applied") from exc


def snapshot(obj: Any) -> bytes | Unsaved:
    """`obj.state_dict()` now, pickled, or why it cannot be."""
    try:
        state = obj.state_dict()
    except Exception as exc:
        return Unsaved(f"its state_dict() raised {type(exc).__name__}: {exc}")
    try:
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        return Unsaved(
            f"its state_dict() returned a value that cannot be pickled ({type(exc).__name__}: {exc})", "pickle"
        )


def take(dataset: Any, iterator: Any, drawn: int, ended: bool = False) -> Record:
    """A snapshot of a replica: `dataset` and `iterator` are the objects to ask (None: not
    Stateful)."""
    blobs: list[bytes | None] = []
    for obj in (dataset, iterator):
        if obj is None:
            blobs.append(None)
            continue
        blob = snapshot(obj)
        if isinstance(blob, Unsaved):
            return Record(True, None, None, drawn, drawn, ended, blob)
        blobs.append(blob)
    return Record(True, blobs[0], blobs[1], drawn, drawn, ended)


@dataclass(frozen=True)
class Resume:
    """What a resumed worker puts back before its first fetch (a `Kept`, as the worker
    receives it)."""

    dataset: bytes | None
    iterator: bytes | None
    replay: int
    drawn: int
    ended: bool

    @classmethod
    def of(cls, kept: Kept | None) -> Resume | None:
        if kept is None:
            return None
        return cls(kept.dataset, kept.iterator, kept.drawn - kept.drawn_at, kept.drawn, kept.ended)

    def dataset_state(self) -> Any:
        return _loads(self.dataset)

    def iterator_state(self) -> Any:
        return _loads(self.iterator)


def records(kept: list[Kept | None]) -> list[dict[str, Any] | None]:
    """Each replica's record as a loader state holds it (its states unpickled afresh)."""
    return [None if k is None else k.saved() for k in kept]


def replica_part(kept: list[Kept | None], num_workers: int, next_worker: int) -> dict[str, Any]:
    """A loader state's `replicas` part. Raises `ReplicaUnsaved` (the loader's `state_dict()`
    words it) for a replica whose state could not be taken."""
    for worker, k in enumerate(kept):
        if k is not None and k.unsaved is not None:
            raise ReplicaUnsaved(k.unsaved.reason, worker, k.unsaved.kind)
    return {"num_workers": num_workers, "records": records(kept), "next_worker": next_worker}
