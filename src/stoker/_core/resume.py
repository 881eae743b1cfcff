"""Exact resume: what a DataLoader's state holds, how an epoch is captured and replayed.

An epoch's order is fixed by the random streams its sampler (and, for an iterator's first
epoch, the loader's base-seed draw) consumed, so the state keeps those streams' states as
they were just before the epoch drew (`capture_epoch`) plus how far the consumer got — not
the order itself. `open_epoch` puts the streams back, redraws the same order, steps over
the consumed batches without fetching anything (stoker's samplers slice their drawn order;
others are iterated) and gives the global RNGs back to the caller untouched. A loader
iterator opens its epochs with these through `epochs.py`.

```
state = {"version": 1, "config": {...}, "epoch": e, "position": k, "delivered_after": [...],
         "origin": {"rng": [...], "sampler": {...}, "draws_seed": bool},
         "base_seed": int | None, "next_origin": origin | None}
```
"""

from __future__ import annotations

import inspect
import itertools
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .._base.hooks import DescribesStream, KeepsEpoch, ResumableSampler, SetsEpoch, follows
from .._data.identity import describe_data, prefixed
from .._data.rng import RandomSource
from .._data.samplers import BatchSampler
from .errors import ReplicaUnsaved
from .replica import Kept, replica_part

END = -1  # the key of a user sampler's state recorded after its epoch's source ended
VERSION = 2  # 2: replica records (any state, pickled, iterators, replays); 1 is read (see upgrade)
_END = object()


def why_not_stateful(obj: Any) -> str | None:
    """Why `obj` does not follow the Stateful protocol stoker documents (`_base/hooks.py`'s
    `Stateful`, torchdata's: `state_dict()` callable with no argument, `load_state_dict(state)`
    with one), or None when it does. Read from the methods' signatures: a method of that name with another
    signature (litdata's and Mosaic's `state_dict(...)` take the loader's counts) is the
    object's own, and stoker never calls it."""
    for name, arguments in (("state_dict", ()), ("load_state_dict", (None,))):
        try:
            method = getattr(obj, name, None)
        except Exception:  # a __getattr__ that raises something other than AttributeError
            method = None
        if method is None:
            return f"it has no {name}() method"
        if not callable(method):
            return f"its {name} is not a method"
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):
            return f"the signature of its {name}() cannot be read"
        try:
            signature.bind(*arguments)
        except TypeError:
            required = [
                p.name
                for p in signature.parameters.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            needs = f"requires {', '.join(required)}" if required else "takes no argument"
            given = "no argument" if not arguments else "one argument (the state)"
            return f"its {name}() {needs}, and stoker calls it with {given}"
    return None


def is_stateful(obj: Any) -> bool:
    """Whether stoker may call `obj.state_dict()` and `obj.load_state_dict(state)` (see
    `why_not_stateful`)."""
    return why_not_stateful(obj) is None


@dataclass
class Progress:
    """How far one iterator got: what `DataLoader.state_dict()` reads. The loader keeps it
    after the iterator is dropped or closed (the iterator's workers stop; its position is
    not forgotten)."""

    index_sampler: Any
    seed_source: RandomSource
    persistent: bool
    base_seed: int = 0
    origins: dict[int, dict[str, Any]] = field(default_factory=dict)  # epoch -> its draws' origin
    user_states: dict[int, dict[int, Any]] = field(default_factory=dict)  # epoch -> position -> user sampler state
    scheduler: Any = None
    started: bool = True  # the delivering epoch was handed to the consumer by iter()
    num_workers: int = 0  # one replica per worker (or one in-process)
    # worker -> its replica's place as of its last delivered batch (see replica); a worker with
    # none has delivered nothing yet in the epoch and starts it afresh
    replicas: dict[int, Kept] = field(default_factory=dict)
    stateful_map: bool = False  # a map-style dataset that keeps a state: its replicas' states are saved
    carries: bool = False  # the replicas go on into the next epoch (persistent workers, or in-process)
    live: Any = None  # num_workers=0: takes the loader's own dataset's state now (a Record, or None)
    last_worker: int | None = None  # iterable: the worker whose batch was delivered last
    frozen: dict[str, Any] | None = None  # the point when the iterator stopped
    frozen_error: ReplicaUnsaved | None = None  # why that point has no state
    stopped: bool = False

    def freeze(self) -> None:
        """The iterator stopped: keep its point and let go of the scheduler (and with it the
        batches that had arrived and were never handed out). Draws nothing: a state taken
        later fixes the next epoch's draws itself (see the loader)."""
        if not self.stopped:
            if self.live is not None:  # the loader's own dataset: its state as the iterator leaves it
                now = self.live()
                if now is not None:
                    self.replicas[0] = self.replicas.get(0, Kept()).after(now)
            try:
                self.frozen = self.point(fix=False)
            except ReplicaUnsaved as unsaved:
                self.frozen_error = unsaved
            self.stopped = True
            self.scheduler = None
            self.live = None

    pending: tuple[int, dict[str, Any]] | None = None  # a resumed state's next epoch, already drawn

    def take_pending(self, epoch: int) -> dict[str, Any] | None:
        """The saved origin of `epoch`, once, if the resumed state had drawn it."""
        if self.pending is not None and self.pending[0] == epoch:
            origin, self.pending = self.pending[1], None
            return origin
        return None

    def next_epoch(self) -> None:
        """The replicas begin a new epoch: each goes on from its stream's end if it carries
        over, afresh otherwise."""
        self.replicas = {w: kept.carried() for w, kept in self.replicas.items()} if self.carries else {}
        self.last_worker = None

    def carried(self) -> list[Kept | None]:
        """The replicas' places for an epoch that starts after this iterator's last: what the
        loader's next iterator reads from, when the replicas carry over."""
        count = max(self.num_workers, 1)
        if not self.carries:
            return [None] * count
        return [kept.carried() if (kept := self.replicas.get(w)) is not None else None for w in range(count)]

    def _replica_part(self, next_epoch: bool) -> dict[str, Any] | None:
        """The state's record of each replica (None: nothing to record)."""
        if self.index_sampler is not None and not self.stateful_map:
            return None
        count = max(self.num_workers, 1)
        kept: list[Kept | None] = [self.replicas.get(w) for w in range(count)]
        now = self.live() if self.live is not None and not next_epoch else None
        if now is not None:
            kept[0] = (kept[0] or Kept()).after(now)
        if next_epoch:
            kept = [k.carried() if k is not None and self.carries else None for k in kept]
        next_worker = 0 if next_epoch or self.last_worker is None else (self.last_worker + 1) % count
        return replica_part(kept, self.num_workers, next_worker)

    def point(self, fix: bool = True) -> dict[str, Any] | None:
        """Where a resumed iterator continues, or None when no epoch is under way and the
        loader's next epoch starts afresh (a new iterator, which draws its own base seed).
        `fix`: between a persistent iterator's epochs, make the next epoch's draws now (the
        state then fixes its order, as torchdata's does); else the point says `drawn: False`.

        Raises `ReplicaUnsaved` when a replica's state could not be taken."""
        if self.stopped:
            if self.frozen_error is not None:
                raise self.frozen_error
            return self.frozen
        scheduler = self.scheduler
        if scheduler is None:
            return None
        if self.index_sampler is None:  # an iterable dataset: its replicas' states
            if not (self.started and scheduler.current_epoch is not None):
                if not self.persistent:
                    return None
                epoch = scheduler.next_epoch_number if scheduler.current_epoch is None else scheduler.current_epoch
                return {
                    "epoch": epoch,
                    "position": 0,
                    "delivered_after": [],
                    "drawn": True,
                    "origin": self.origins.get(epoch) or capture_epoch(None, self.seed_source, draws_seed=False),
                    "base_seed": self.base_seed,
                    "next_origin": None,
                    "replicas": self._replica_part(next_epoch=True),
                }
            return {
                "epoch": scheduler.current_epoch,
                "position": scheduler.delivered,
                "delivered_after": [],
                "drawn": True,
                "origin": self.origins.get(scheduler.current_epoch),
                "base_seed": self.base_seed,
                "next_origin": None,
                "replicas": self._replica_part(next_epoch=False),
            }
        if self.started and scheduler.current_epoch is not None:
            epoch = scheduler.current_epoch
            position, after = scheduler.position()
            origin = self.origins[epoch]
            recorded = self.user_states.get(epoch, {})
            if position and END in recorded and position >= _length(self.index_sampler):
                origin = dict(origin, user_at=recorded[END])
            elif position and position - 1 in recorded:
                origin = dict(origin, user_at=recorded[position - 1])
            return {
                "epoch": epoch,
                "position": position,
                "delivered_after": after,
                "drawn": True,
                "origin": origin,
                "base_seed": self.base_seed,
                "next_origin": self.origins.get(epoch + 1),
                "replicas": self._replica_part(next_epoch=False),
            }
        if self.persistent:  # between epochs: the next one keeps this iterator's base seed
            current = scheduler.current_epoch
            epoch = scheduler.next_epoch_number if current is None else current
            prefetched = self.origins.get(epoch)
            drawn = prefetched is not None  # the next epoch was prefetched: its draws are made
            if prefetched is None and fix:
                # the next epoch's draws are made now, so that the state fixes its order (as
                # torchdata's does): the iterator's next epoch replays them
                prefetched = predraw(self.index_sampler, self.seed_source, draws_seed=False)[0]
                self.pending = (epoch, prefetched)
                self.origins[epoch] = prefetched
                drawn = True
            elif prefetched is None:
                prefetched = capture_epoch(self.index_sampler, self.seed_source, draws_seed=False)
            return {
                "epoch": epoch,
                "position": 0,
                "delivered_after": [],
                "drawn": drawn,
                "origin": prefetched,
                "base_seed": self.base_seed,
                "next_origin": None,
                "replicas": self._replica_part(next_epoch=True),
            }
        return None


def predraw(index_sampler: Any, seed_source: RandomSource, draws_seed: bool) -> tuple[dict[str, Any], int | None]:
    """Make the draws of an epoch that starts next, now: its origin (what replays them) and
    the base seed drawn with it. The random streams move on as that epoch's start would move
    them; the epoch itself then replays the origin."""
    origin = capture_epoch(index_sampler, seed_source, draws_seed=draws_seed)
    if index_sampler is None or not follows(index_sampler, ResumableSampler):
        # an iterable's epoch draws only its base seed; a user's sampler may draw from a
        # generator of its own, which no state here could give back: it draws at iter(), as
        # it always does (its order is then the one the resumed run replays too)
        base_seed = seed_source.seed64() if draws_seed else None
        origin["sampler"].pop("epoch", None)
        return origin, base_seed
    indices, base_seed = open_epoch(index_sampler, seed_source, origin, 0, drawn=False)
    next(indices, None)  # a sampler that draws lazily draws at its first index
    # a sampler told its epoch (set_epoch) is told the next one between the epochs, after this
    # state is taken: that call, not the state, says which epoch comes
    origin["sampler"].pop("epoch", None)
    return origin, base_seed


def _inner(index_sampler: Any) -> Any:
    return index_sampler.sampler if isinstance(index_sampler, BatchSampler) else None


def _sources(index_sampler: Any, seed_source: RandomSource) -> list[RandomSource]:
    """The random streams an epoch draws from, each once, in a fixed order."""
    found: list[RandomSource] = []
    keys: set[tuple[Any, ...]] = set()
    for candidate in (
        seed_source,
        getattr(index_sampler, "_source", None),
        getattr(_inner(index_sampler), "_source", None),
    ):
        if isinstance(candidate, RandomSource) and candidate.key() not in keys:
            keys.add(candidate.key())
            found.append(candidate)
    return found


def stateful_user_sampler(index_sampler: Any) -> Any:
    """A user's sampler that follows the Stateful protocol (`is_stateful`): its state is
    recorded after each batch is drawn, so that a resume loads it instead of replaying the
    consumed batches. Any other sampler is replayed."""
    user = _user_sampler(index_sampler)
    return user if user is not None and is_stateful(user) else None


def recording(source: Iterator[Any], user: Any, record: dict[int, Any], start: int, keep: int) -> Iterator[Any]:
    """`source`, recording `user.state_dict()` after each batch is drawn, by position; only
    the last `keep` positions are kept (the consumer is never further behind)."""
    number = start
    for index in source:
        record[number] = user.state_dict()
        record.pop(number - keep, None)
        number += 1
        yield index
    # its state once the epoch's source ended (a sampler may update it only then, past its last
    # index): what a state taken after the last batch restores
    record[END] = user.state_dict()


def _user_sampler(index_sampler: Any) -> Any:
    """The sampler whose state stoker cannot see into: a user's sampler or batch sampler."""
    inner = _inner(index_sampler)
    target = inner if inner is not None else index_sampler
    return None if follows(target, ResumableSampler) else target


def capture_epoch(index_sampler: Any, seed_source: RandomSource, draws_seed: bool) -> dict[str, Any]:
    """What reproduces the draws of an epoch that starts now."""
    sampler: dict[str, Any] = {}
    if isinstance(index_sampler, BatchSampler):
        sampler["rollover"] = _rollover(index_sampler)
    for part in (index_sampler, _inner(index_sampler)):
        if follows(part, KeepsEpoch):
            sampler["epoch"] = int(part.epoch)
    user = stateful_user_sampler(index_sampler)
    if user is not None:
        sampler["user"] = user.state_dict()
    return {
        "rng": [source.capture() for source in _sources(index_sampler, seed_source)],
        "sampler": sampler,
        "draws_seed": draws_seed,
    }


def open_epoch(
    index_sampler: Any, seed_source: RandomSource, origin: dict[str, Any], skip: int, drawn: bool = True
) -> tuple[Iterator[Any], int | None]:
    """Replay an epoch's draws from its origin and return its index iterator from batch
    `skip` on, and the base seed drawn with it (None when the epoch draws none).

    `drawn`: the saved run had made these draws before it saved, so the global RNG state
    the caller restored with their own checkpoint already follows them and is given back
    untouched; otherwise (a state saved between epochs) the epoch draws from the global
    RNG as it is now, as a fresh epoch would, and only the loader's own generators are
    restored."""
    sources = _sources(index_sampler, seed_source)
    saved = origin["rng"]
    if [c["kind"] for c in saved] != [s.key()[0] for s in sources]:
        raise ValueError(
            "this state's random generators "
            f"({', '.join(c['kind'] for c in saved)}) are not this loader's "
            f"({', '.join(s.key()[0] for s in sources)}): give the loader the same kind of "
            "generator (or none) as the loader that saved the state"
        )
    callers = [(s, s.capture()) for s in sources if s.key()[0].endswith("-global")] if drawn else []
    try:
        for source, state in zip(sources, saved):
            if drawn or not state["kind"].endswith("-global"):
                source.restore(state)
        sampler_state = origin.get("sampler", {})
        if isinstance(index_sampler, BatchSampler):
            _roll_over(index_sampler, sampler_state.get("rollover", []))
        if "epoch" in sampler_state:
            for part in (index_sampler, _inner(index_sampler)):
                if follows(part, SetsEpoch):
                    part.set_epoch(sampler_state["epoch"])
        user = stateful_user_sampler(index_sampler)
        if "user" in sampler_state and user is not None:
            user.load_state_dict(sampler_state["user"])
            at = origin.get("user_at")  # its state right after the last consumed batch was drawn
            if at is not None and skip:
                user.load_state_dict(at)
                if isinstance(index_sampler, BatchSampler):
                    _roll_over(index_sampler, [])  # the carried indices went into batch 0
                if skip >= _length(index_sampler):
                    # the epoch was used up: the state is the one its sampler had at the end
                    # (see recording), so draw nothing now; a sampler whose loaded state still
                    # has a pass to finish (one that keeps its position until its next
                    # iteration starts) finishes it, emptily, as the saved run's did
                    _settle(user, at)
                    return iter(()), (seed_source.seed64() if origin.get("draws_seed") else None)
                skip = 0
        base_seed = seed_source.seed64() if origin.get("draws_seed") else None
        indices = iter(()) if index_sampler is None else _iter_from(index_sampler, skip)
        if user is not None and not skip and "user" in sampler_state:
            indices = _fresh_pass(index_sampler, indices)
    finally:
        for source, state in callers:  # the caller's own global RNG is left as it was
            source.restore(state)
    return indices, base_seed


def _rollover(batches: BatchSampler) -> list[int]:
    """The indices `batches` carries into its next epoch's first batch (`last_batch='rollover'`)."""
    # BatchSampler's own state methods, not the object's: a subclass's overrides are its own,
    # and stoker calls a user's methods only through the protocols it documents
    return list(BatchSampler.state_dict(batches)["rollover_indices"])


def _roll_over(batches: BatchSampler, indices: list[int]) -> None:
    """Make `batches` carry `indices` into its next epoch's first batch (see `_rollover`)."""
    BatchSampler.load_state_dict(batches, {"rollover_indices": indices})


def _settle(user: Any, state: Any) -> None:
    """Let a user's sampler loaded with its state at an epoch's end finish that pass: one
    iteration that gives nothing completes it; one that gives an index has begun the next
    epoch, and the state is loaded again (its own state said where it was)."""
    if next(iter(user), _END) is not _END:
        user.load_state_dict(state)


def _fresh_pass(index_sampler: Any, indices: Iterator[Any]) -> Iterator[Any]:
    """An epoch's indices from the start, from a user's sampler loaded with the state it had
    between epochs: one that keeps its last epoch's position until an iteration ends it
    (torchdata's `StatefulDistributedSampler`) gives nothing the first time, and its epoch
    the next."""
    first = next(indices, _END)
    if first is _END and _length(index_sampler) > 0:
        indices = _iter_from(index_sampler, 0)
        first = next(indices, _END)
    return iter(()) if first is _END else itertools.chain([first], indices)


def _iter_from(index_sampler: Any, skip: int) -> Iterator[Any]:
    """The sampler's iterator from batch `skip` on, its draw made now."""
    user = _user_sampler(index_sampler)
    if skip and user is not None:
        warnings.warn(
            f"resuming {type(user).__name__} by replaying its iterator over the {skip} batches "
            "already consumed (no samples are fetched; the time grows with the position)",
            stacklevel=5,
        )
    if follows(index_sampler, ResumableSampler):  # stoker's samplers, and BatchSampler over any sampler
        return index_sampler._iter_from(skip)
    indices = iter(index_sampler)
    first = next(itertools.islice(indices, skip, skip + 1), _END)
    return indices if first is _END else itertools.chain([first], indices)


def _length(index_sampler: Any) -> float:
    try:
        return len(index_sampler)
    except TypeError:
        return float("inf")


def describe(plan: Any) -> dict[str, Any]:
    """What a state must agree on with the loader that loads it: the loader's batching and
    sampler, and the stream its rows come from. A dataset or sampler that describes itself
    (`stoker_describe()`: stoker.mix's and stoker.shards' datasets, `ShardedSampler`) adds
    its description under `stream.` and `sampler.` (see `stoker._data.identity` for what a
    description covers)."""
    index_sampler = plan.index_sampler
    inner = _inner(index_sampler)
    config: dict[str, Any] = {
        "dataset_kind": plan.dataset_kind,
        "dataset_length": len(plan.dataset) if plan.dataset_kind == "map" else None,
        "batch_size": plan.batch_size,
        "drop_last": plan.drop_last,
        "index_sampler": type(index_sampler).__name__,
        "sampler": type(inner).__name__ if inner is not None else None,
        "last_batch": getattr(index_sampler, "last_batch", None),
    }
    sharded = distributed_sampler(index_sampler)
    if sharded is not None:
        config["num_replicas"] = sharded.num_replicas
        config["rank"] = sharded.rank
        config["total_size"] = sharded.total_size
        config["sampler_seed"] = sharded.seed
        config["sampler_shuffle"] = bool(sharded.shuffle)
        config["sampler_drop_last"] = bool(sharded.drop_last)
    if plan.dataset_kind == "map" and follows(plan.dataset, DescribesStream):
        config.update(_plain(prefixed("stream", describe_data(plan.dataset))))
    for part in (index_sampler, inner):
        if follows(part, DescribesStream) and callable(part.stoker_describe):
            config.update(_plain(prefixed("sampler", part.stoker_describe())))
    return config


def _plain(description: dict[str, Any]) -> dict[str, Any]:
    """`description` as it comes back from JSON (tuples as lists), so that a saved state
    compares equal to the description it was saved with."""
    return dict(json.loads(json.dumps(description)))


ELASTIC_KEYS = ("num_replicas", "rank", "total_size")  # may differ: an elastic resume


def distributed_sampler(index_sampler: Any) -> Any:
    """The DistributedSampler the loader's indices come from, if any."""
    from .._data.distributed import DistributedSampler

    for part in (index_sampler, _inner(index_sampler)):
        if isinstance(part, DistributedSampler):
            return part
    return None


def make_elastic(state: dict[str, Any], index_sampler: Any, auto_collation: bool) -> dict[str, Any]:
    """A state saved by a rank of another world (size or rank) made into this rank's: the
    rest of the saved epoch is what no old rank consumed, split over this world's ranks.
    `auto_collation`: each position is a batch (of the batch sampler's `batch_size`, the
    loader's own or one the user gave), else one sample."""
    sharded = distributed_sampler(index_sampler)
    config = state["config"]
    if getattr(index_sampler, "last_batch", None) == "rollover":
        raise ValueError("an elastic resume (another world size or rank) cannot carry rollover indices")
    if state.get("delivered_after"):
        raise ValueError("an elastic resume (another world size or rank) needs a state saved with in_order=True")
    size: Any = 1
    if auto_collation:
        size = getattr(index_sampler, "batch_size", None)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(
                f"an elastic resume (another world size or rank) counts the samples the old ranks "
                f"consumed from their batches, and this loader's batch sampler ({type(index_sampler).__name__}) "
                "has no batch_size: give it a batch_size attribute (every batch but the last that size)"
            )
    consumed = int(state["position"]) * size
    sharded.resume_elastic(consumed, config["num_replicas"], config["total_size"])
    elastic = dict(state, position=0, delivered_after=[], next_origin=None)
    elastic["config"] = dict(config, **{key: getattr(sharded, key) for key in ELASTIC_KEYS})
    return elastic


def upgrade(state: Any) -> Any:
    """A state of an older format as this version holds it (anything else is returned as it
    is, for `check` to judge). Version 1 kept an IterableDataset replica's state under
    `iterable` as [its state, items drawn], or None before its first batch."""
    if not isinstance(state, dict) or state.get("version") != 1:
        return state
    upgraded = {key: value for key, value in state.items() if key != "iterable"}
    upgraded["version"] = VERSION
    old = state.get("iterable")
    if isinstance(old, dict):
        records = [
            None if r is None else {"dataset": r[0], "iterator": None, "replay": 0, "drawn": int(r[1]), "ended": False}
            for r in old.get("replicas", [])
        ]
        upgraded["replicas"] = {
            "num_workers": old.get("num_workers"),
            "records": records,
            "next_worker": old.get("next_worker", 0),
        }
    else:
        upgraded["replicas"] = None
    return upgraded


def check(state: Any, config: dict[str, Any]) -> None:
    """Refuse a state that is not a stoker loader state, or one from another configuration."""
    if not isinstance(state, dict) or "version" not in state:
        raise ValueError("load_state_dict expects a dict made by DataLoader.state_dict() (with a 'version' key)")
    if state["version"] != VERSION:
        raise ValueError(
            f"this DataLoader state was written in state format version {state['version']!r} (by another "
            f"stoker); this stoker writes version {VERSION} and reads versions 1 and {VERSION}: it was not applied"
        )
    saved = state.get("config")
    if not isinstance(saved, dict):
        raise ValueError("this DataLoader state lacks its 'config' (what it was saved over); it was not applied")
    differ = [
        f"{key}: {_value(saved, key, 'saved')}, {_value(config, key, 'this loader')}"
        for key in [*config, *(k for k in saved if k not in config)]
        if key not in ELASTIC_KEYS and (key not in saved or key not in config or saved[key] != config[key])
    ]
    if differ:
        raise ValueError(
            "this DataLoader state comes from another configuration and was not applied; " + "; ".join(differ)
        )


def _value(config: dict[str, Any], key: str, whose: str) -> str:
    return f"{whose} {config[key]!r}" if key in config else f"{whose} records none"
