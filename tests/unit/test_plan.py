"""The loader's argument resolution (`_core/plan.py`) one step at a time: what each step
resolves, and which of two errors it raises first. The loader's own checks, message by
message against torch's, are in test_loader.py."""

from __future__ import annotations

import inspect
import multiprocessing
from typing import Any

import numpy as np
import pytest

import stoker
from stoker import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler
from stoker._core.auto import START_PREFETCH, Auto
from stoker._core.plan import (
    check_callables,
    check_flags,
    check_last_batch,
    default_sampler,
    resolve_arguments,
    resolve_batch_size,
    resolve_batchify,
    resolve_batching,
    resolve_collate,
    resolve_context,
    resolve_pin_memory,
    resolve_ranks,
    resolve_shuffle,
    resolve_workers,
)
from stoker._data.samplers import InfiniteConstantSampler


class Squares(stoker.Dataset[int]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return i * i


class Count(stoker.IterableDataset[int]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(5))


def workers(num_workers: Any = 0, prefetch_factor: Any = None, **kwargs: Any) -> Any:
    options = {"timeout": 0, "max_worker_restarts": 0, "persistent_workers": False, "auto_reload": False}
    return resolve_workers(num_workers, prefetch_factor, **{**options, **kwargs})


def batching(dataset: Any = None, flavour: Any = stoker.DataLoader, **kwargs: Any) -> Any:
    options = {
        "batch_size": 1,
        "shuffle": None,
        "sampler": None,
        "batch_sampler": None,
        "drop_last": False,
        "last_batch": None,
        "generator": None,
    }
    return resolve_batching(flavour, Squares() if dataset is None else dataset, **{**options, **kwargs})


# ------------------------------------------------------------------ workers
def test_workers_resolve_prefetch_and_auto() -> None:
    none = workers()
    assert (none.given, none.prefetch_factor, none.auto) == (0, None, None)
    two = workers(2, timeout=1.5, max_worker_restarts=3)
    assert (two.given, two.prefetch_factor, two.timeout, two.max_worker_restarts) == (2, 2, 1.5, 3)
    assert workers(2, 0).prefetch_factor == 0  # torch takes 0 (one batch in flight per worker)
    auto = workers("auto", "auto")
    assert (auto.given, auto.auto) == (1, (True, True))  # checked as one worker: "auto" may choose some
    assert isinstance(auto.prefetch_factor, Auto) and auto.prefetch_factor == START_PREFETCH
    # a count "auto" gave another loader asks for "auto" again
    assert workers(Auto(3)).auto == (True, False)
    assert workers(2, Auto(4)).auto == (False, True)


def test_persistent_workers_and_auto_reload_resolve_together() -> None:
    kept = workers(2, persistent_workers=True, auto_reload=True)
    assert kept.persistent_workers and kept.auto_reload


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # torch's order: num_workers, then timeout, then prefetch_factor, then persistent_workers
        ({"num_workers": -1, "timeout": -1}, ValueError, "num_workers option should be non-negative"),
        ({"timeout": -1, "prefetch_factor": 2}, ValueError, "timeout option should be non-negative"),
        ({"prefetch_factor": 2, "persistent_workers": True}, ValueError, "prefetch_factor option could only"),
        # stoker's own arguments: max_worker_restarts before torch's value checks, auto_reload after
        ({"num_workers": -1, "max_worker_restarts": -1}, ValueError, "max_worker_restarts should be a non-negative"),
        ({"persistent_workers": True, "auto_reload": 1}, ValueError, "persistent_workers option needs"),
        ({"num_workers": 1, "auto_reload": True}, ValueError, r"auto_reload=True .* persistent_workers=False"),
        # the types before any value
        ({"num_workers": "two", "max_worker_restarts": -1}, TypeError, "num_workers should be an int or 'auto'"),
        ({"prefetch_factor": "many", "num_workers": -1}, TypeError, "prefetch_factor should be an int, None or 'auto'"),
        ({"timeout": "1"}, TypeError, "timeout should be a number of seconds"),
        ({"timeout": True}, TypeError, "timeout should be a number of seconds"),
        ({"num_workers": 1, "prefetch_factor": 1.5}, TypeError, "prefetch_factor should be an int"),
        (
            {"num_workers": 2, "persistent_workers": True, "auto_reload": "yes"},
            TypeError,
            "auto_reload should be True or False",
        ),
    ],
)
def test_workers_raise_the_first_error_in_order(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        workers(**kwargs)


# ------------------------------------------------------------------ flags
def test_flags_accept_bools_and_name_the_bad_one() -> None:
    flags = {"in_order": True, "thread_pool": False, "seed_each_batch": False, "stats": True, "progress": False}
    check_flags(workers(), **flags)
    for name in flags:
        with pytest.raises(TypeError, match=f"{name} should be True or False, but got {name}=1"):
            check_flags(workers(), **{**flags, name: 1})
    with pytest.raises(ValueError, match="stats=False"):
        check_flags(workers(), **{**flags, "progress": True, "stats": False})
    racing = {**flags, "seed_each_batch": True, "thread_pool": True}
    check_flags(workers(0), **racing)  # no thread workers run: nothing races
    with pytest.raises(ValueError, match="seed_each_batch=True cannot be combined with thread_pool=True"):
        check_flags(workers(2), **racing)


def test_callables_are_named() -> None:
    check_callables(list, None, print)
    for position, name in enumerate(["collate_fn", "batchify_fn", "worker_init_fn"]):
        given: list[Any] = [None, None, None]
        given[position] = 3
        with pytest.raises(TypeError, match=f"{name} should be a callable or None, but got {name}=3"):
            check_callables(*given)


def test_pin_memory_resolves_to_a_bool_or_born() -> None:
    assert resolve_pin_memory(1, "") is True and resolve_pin_memory(np.bool_(False), "") is False
    assert resolve_pin_memory("born", "cuda") == "born"
    with pytest.raises(ValueError, match=r"pin_memory=.*'pinned'"):
        resolve_pin_memory("pinned", 3)  # the value of pin_memory before its device's type
    with pytest.raises(TypeError, match="pin_memory_device should be a str"):
        resolve_pin_memory(True, 0)


def test_batchify_fn_is_collate_fn_under_another_name() -> None:
    assert resolve_batchify(None, None) is None
    assert resolve_batchify(list, None) is list and resolve_batchify(None, tuple) is tuple
    with pytest.raises(ValueError, match="collate_fn and batchify_fn are two names"):
        resolve_batchify(list, tuple)


def test_last_batch_choices() -> None:
    for choice in (None, "keep", "discard", "rollover"):
        check_last_batch(choice)
    with pytest.raises(ValueError, match=r"last_batch should be one of .* but got last_batch='wrap'"):
        check_last_batch("wrap")


# ------------------------------------------------------------------ context
def test_context_names_read_as_contexts() -> None:
    assert resolve_context(None, 0, auto=False) is None  # nothing to check without one
    assert resolve_context("spawn", 1, auto=False).get_start_method() == "spawn"  # type: ignore[union-attr]
    context = multiprocessing.get_context("spawn")
    assert resolve_context(context, 1, auto=False) is context
    assert resolve_context("spawn", 0, auto=True) is not None  # "auto" may choose workers


@pytest.mark.parametrize(
    ("context", "num_workers", "error", "match"),
    [
        ("nope", 0, ValueError, "can only be used with multi-process loading"),  # workers first
        ("nope", 1, ValueError, "valid start method"),
        (3, 1, TypeError, "valid context object"),
    ],
)
def test_context_errors(context: Any, num_workers: int, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        resolve_context(context, num_workers, auto=False)


# ------------------------------------------------------------------ batching
def test_batching_defaults_and_what_each_argument_makes() -> None:
    plain = batching(batch_size=4)
    assert not plain.iterable and plain.auto_collation and plain.batch_size == 4
    assert type(plain.sampler) is SequentialSampler and type(plain.batch_sampler) is BatchSampler
    assert plain.index_sampler is plain.batch_sampler
    assert type(batching(shuffle=True, generator=3).sampler) is RandomSampler
    unbatched = batching(batch_size=None)
    assert unbatched.batch_sampler is None and not unbatched.auto_collation
    assert unbatched.index_sampler is unbatched.sampler
    given = [[0, 1], [2]]
    own = batching(batch_sampler=given)
    assert own.batch_sampler is given and (own.batch_size, own.drop_last) == (None, False)
    assert batching(batch_size=4, last_batch="discard").drop_last is True
    assert batching(batch_size=4, last_batch="keep").drop_last is False
    stream = batching(Count(), batch_size=2)
    assert stream.iterable and type(stream.sampler) is InfiniteConstantSampler


def test_batching_asks_the_flavour() -> None:
    tud = pytest.importorskip("torch.utils.data")
    import stoker.torch as st

    made = batching(flavour=st.DataLoader, batch_size=2, shuffle=True)
    assert type(made.batch_sampler) is tud.BatchSampler  # torch's own class, as torch makes it
    assert isinstance(made.sampler, tud.RandomSampler)
    assert isinstance(batching(Count(), flavour=st.DataLoader).sampler, tud.dataloader._InfiniteConstantSampler)


def test_shuffle_resolves_to_whether_the_loader_shuffles() -> None:
    flavour = stoker.DataLoader
    options: dict[str, Any] = {"sampler": None, "batch_sampler": None, "last_batch": None}
    assert resolve_shuffle(flavour, Squares(), False, shuffle=None, **options) is False
    assert resolve_shuffle(flavour, Squares(), False, shuffle=1, **options) is True
    assert resolve_shuffle(flavour, Count(), True, shuffle=False, **options) is False
    # an iterable dataset: shuffle is reported before sampler, sampler before batch_sampler
    with pytest.raises(ValueError, match="unspecified shuffle option"):
        resolve_shuffle(flavour, Count(), True, shuffle=True, sampler=[0], batch_sampler=[[0]], last_batch=None)
    with pytest.raises(ValueError, match="unspecified sampler option"):
        resolve_shuffle(flavour, Count(), True, shuffle=None, sampler=[0], batch_sampler=[[0]], last_batch=None)
    with pytest.raises(ValueError, match="rollover"):
        resolve_shuffle(flavour, Count(), True, shuffle=None, sampler=None, batch_sampler=None, last_batch="rollover")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # last_batch's rules come before batch_sampler's
        ({"batch_size": 2, "last_batch": "keep", "batch_sampler": [[0]]}, "last_batch applies"),
        ({"last_batch": "keep", "drop_last": True}, "drop_last=True contradicts last_batch='keep'"),
        ({"batch_sampler": [[0]], "shuffle": True}, "batch_sampler option is mutually exclusive"),
        ({"batch_sampler": [[0]], "sampler": [0]}, "batch_sampler option is mutually exclusive"),
        ({"batch_size": None, "drop_last": True}, "batch_size=None option disables auto-batching"),
    ],
)
def test_batch_size_errors(kwargs: dict[str, Any], match: str) -> None:
    options: dict[str, Any] = {
        "batch_size": 1,
        "drop_last": False,
        "last_batch": None,
        "batch_sampler": None,
        "shuffle": False,
        "sampler": None,
    }
    merged = {**options, **kwargs}
    with pytest.raises(ValueError, match=match):
        resolve_batch_size(merged.pop("batch_size"), merged.pop("drop_last"), merged.pop("last_batch"), **merged)


def test_default_sampler_of_each_kind() -> None:
    flavour = stoker.DataLoader
    assert type(default_sampler(flavour, Squares(), False, shuffle=False, generator=None)) is SequentialSampler
    random = default_sampler(flavour, Squares(), False, shuffle=True, generator=5)
    assert type(random) is RandomSampler and list(random) == list(RandomSampler(Squares(), generator=5))
    assert type(default_sampler(flavour, Count(), True, shuffle=False, generator=None)) is InfiniteConstantSampler


# ------------------------------------------------------------------ ranks, collate
def test_ranks_from_the_environment_else_from_a_distributed_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_ranks(SequentialSampler(Squares())) == (0, 1, None)
    shard = DistributedSampler(Squares(), num_replicas=4, rank=2)
    assert resolve_ranks(shard) == (2, 4, None)
    assert resolve_ranks(BatchSampler(shard, 2, False)) == (2, 4, None)  # found inside a batch sampler
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_ranks(SequentialSampler(Squares())) == (1, 2, 1)


def test_collate_given_or_the_flavours_default() -> None:
    assert resolve_collate(stoker.DataLoader, list, True) is list
    assert resolve_collate(stoker.DataLoader, None, True) is stoker.default_collate
    assert resolve_collate(stoker.DataLoader, None, False) is stoker.default_convert
    st = pytest.importorskip("stoker.torch", exc_type=ImportError)
    assert resolve_collate(st.DataLoader, None, True) is st.default_collate
    assert resolve_collate(st.DataLoader, None, False) is st.default_convert


# ------------------------------------------------------------------ all of them at once
def constructor_defaults() -> dict[str, Any]:
    """Every argument of `DataLoader.__init__` but the dataset, at its default."""
    parameters = inspect.signature(stoker.DataLoader.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name not in ("self", "dataset")}


def test_resolve_arguments_takes_every_constructor_argument() -> None:
    taken = set(inspect.signature(resolve_arguments).parameters) - {"flavour"}
    assert taken == set(inspect.signature(stoker.DataLoader.__init__).parameters) - {"self"}


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"batch_size": 3, "shuffle": True, "generator": 7, "last_batch": "rollover"},
        {"num_workers": 2, "prefetch_factor": 3, "persistent_workers": True, "auto_reload": True, "timeout": 2.5},
        {"num_workers": "auto", "multiprocessing_context": "spawn", "pin_memory": 1, "snapshot_every_n_steps": 4},
        {"batch_size": None, "batchify_fn": list, "in_order": False, "thread_pool": True, "num_workers": 1},
        {"batch_sampler": [[0, 1], [2]], "stats": False, "seed_each_batch": True, "max_worker_restarts": 2},
    ],
)
def test_arguments_are_what_the_loader_keeps(given: dict[str, Any]) -> None:
    """Each field of `Arguments` is the loader's attribute of that name, with the same value."""
    dataset = Squares()
    made = resolve_arguments(stoker.DataLoader, dataset, **{**constructor_defaults(), **given})
    loader = stoker.DataLoader(dataset, **given)
    kept = {
        "dataset": made.dataset,
        "num_workers": made.num_workers,
        "prefetch_factor": made.workers.prefetch_factor,
        "timeout": made.workers.timeout,
        "max_worker_restarts": made.workers.max_worker_restarts,
        "persistent_workers": made.workers.persistent_workers,
        "auto_reload": made.workers.auto_reload,
        "_auto": made.workers.auto,
        "pin_memory": made.pin_memory,
        "pin_memory_device": made.pin_memory_device,
        "worker_init_fn": made.worker_init_fn,
        "multiprocessing_context": made.multiprocessing_context,
        "in_order": made.in_order,
        "thread_pool": made.thread_pool,
        "seed_each_batch": made.seed_each_batch,
        "stats_enabled": made.stats,
        "progress": made.progress,
        "snapshot_every_n_steps": made.snapshot_every_n_steps,
        "_iterable": made.batching.iterable,
        "_dataset_kind": made.dataset_kind,
        "batch_size": made.batching.batch_size,
        "drop_last": made.batching.drop_last,
        "last_batch": made.last_batch,
        "generator": made.generator,
        "_ranks": made.ranks,
        "collate_fn": made.collate_fn,
    }
    for name, value in kept.items():
        attribute = getattr(loader, name)
        assert type(attribute) is type(value) and attribute == value, name
    # the samplers are made anew by each resolution: the same kinds, the same order
    for name in ("sampler", "batch_sampler"):
        ours, theirs = getattr(made.batching, name), getattr(loader, name)
        assert type(ours) is type(theirs), name
    if made.batching.batch_sampler is not None:
        assert list(made.batching.batch_sampler) == list(loader.batch_sampler)


# two bad arguments, each pair one step apart in the module's table: the earlier step's error wins
FIRST_OF_TWO = [
    ({"num_workers": -1, "collate_fn": 3}, ValueError, "num_workers option should be non-negative"),
    ({"collate_fn": 3, "in_order": 1}, TypeError, "collate_fn should be a callable or None"),
    ({"in_order": 1, "pin_memory": "pinned"}, TypeError, "in_order should be True or False"),
    ({"pin_memory": "pinned", "generator": "seed"}, ValueError, "pin_memory"),
    ({"generator": "seed", "collate_fn": list, "batchify_fn": list}, TypeError, "generator should be None, an int"),
    ({"collate_fn": list, "batchify_fn": list, "last_batch": "wrap"}, ValueError, "collate_fn and batchify_fn"),
    ({"last_batch": "wrap", "multiprocessing_context": "spawn"}, ValueError, "last_batch should be one of"),
    ({"multiprocessing_context": "spawn", "snapshot_every_n_steps": -1}, ValueError, "multiprocessing_context can"),
    ({"snapshot_every_n_steps": -1, "sampler": [0], "shuffle": True}, ValueError, "snapshot_every_n_steps should"),
    ({"sampler": [0], "shuffle": True}, ValueError, "sampler option is mutually exclusive with shuffle"),
]


@pytest.mark.parametrize(("given", "error", "match"), FIRST_OF_TWO)
def test_arguments_raise_the_first_error_in_the_steps_order(given: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match) as resolved:
        resolve_arguments(stoker.DataLoader, Squares(), **{**constructor_defaults(), **given})
    with pytest.raises(error) as constructed:
        stoker.DataLoader(Squares(), **given)
    assert str(constructed.value) == str(resolved.value)  # the constructor is that resolution
