"""The same configurations through `torch.utils.data` and `stoker.torch`: identical batches.

Identical means equal values, dtypes and shapes, the same container types (dict, list,
namedtuple, tuple of strings) and the same leaf types, and the same `len()`. Random
samplers get a fresh `torch.Generator` with the same seed on each side, so both must draw
torch's exact sequence. Map-style configurations also run through stoker with two worker
processes and two worker threads, and must still equal torch's in-process batches;
iterable ones are compared with torch at the same number of workers.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.utils.data as tud  # noqa: E402

import stoker.torch as st  # noqa: E402

Meta = namedtuple("Meta", "score name")
N = 23


class Nested(tud.Dataset):
    """Samples that exercise every collate branch: arrays, numbers, strings, containers."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "image": np.full((3, 4, 4), i, np.uint8),
            "label": i,
            "weight": i / 4,
            "flag": i % 2 == 0,
            "meta": Meta(np.float32(i) / 3, f"item{i}"),
            "pair": (np.arange(2, dtype=np.int16) + i, [i, -i]),
            "tensor": torch.full((2,), float(i)),
        }


class NestedStream(tud.IterableDataset):
    """An iterable of nested samples, sharded across workers by get_worker_info()."""

    def __init__(self, n: int, sharded: bool = True) -> None:
        self.n, self.sharded = n, sharded

    def __iter__(self):
        info = tud.get_worker_info() or st.get_worker_info()  # whichever loader runs us
        start, step = (info.id, info.num_workers) if (info and self.sharded) else (0, 1)
        for i in range(start, self.n, step):
            yield {"x": np.full(3, i, np.float32), "i": i, "tag": ("even" if i % 2 == 0 else "odd",)}

    def __len__(self) -> int:
        return self.n


def _tensor_ds(mod: Any) -> Any:
    return mod.TensorDataset(torch.arange(N, dtype=torch.float32) * 0.5, torch.arange(N))


def _concat_ds(mod: Any) -> Any:
    return mod.ConcatDataset([Nested(), Nested()])


def _subset_ds(mod: Any) -> Any:
    return mod.Subset(Nested(), [20, 3, 7, 11, 0, 19, 5, 8, 13, 2])


def _stack_ds(mod: Any) -> Any:
    return mod.StackDataset(a=_tensor_ds(mod), b=Nested())


DATASETS: dict[str, Callable[[Any], Any]] = {
    "tensor": _tensor_ds,
    "nested": lambda mod: Nested(),
    "concat": _concat_ds,
    "subset": _subset_ds,
    "stack": _stack_ds,
}


def g(seed: int) -> Any:
    return torch.Generator().manual_seed(seed)


# Each sampler factory gets (module, dataset, seed) and returns DataLoader keyword arguments.
SAMPLERS: dict[str, Callable[[Any, Any, int], dict[str, Any]]] = {
    "sequential": lambda mod, ds, s: {},
    "shuffle": lambda mod, ds, s: {"shuffle": True, "generator": g(s)},
    "random_replacement": lambda mod, ds, s: {
        "sampler": mod.RandomSampler(ds, replacement=True, num_samples=30, generator=g(s))
    },
    "random_num_samples": lambda mod, ds, s: {
        "sampler": mod.RandomSampler(ds, num_samples=len(ds) + 5, generator=g(s))
    },
    "subset_random": lambda mod, ds, s: {
        "sampler": mod.SubsetRandomSampler(list(range(0, len(ds), 2)), generator=g(s))
    },
    "weighted": lambda mod, ds, s: {
        "sampler": mod.WeightedRandomSampler([1.0 + (i % 3) for i in range(len(ds))], 17, generator=g(s))
    },
    "distributed": lambda mod, ds, s: {"sampler": mod.DistributedSampler(ds, num_replicas=3, rank=1, seed=s)},
}


def _configs() -> list[tuple[str, str, int | None, bool]]:
    configs = []
    for dataset in DATASETS:
        for sampler in SAMPLERS:
            for batch_size, drop_last in [(1, False), (4, False), (4, True), (7, True), (None, False)]:
                # the full product is large; vary batch shapes along the sampler axis
                if (
                    list(SAMPLERS).index(sampler) + [1, 4, 4, 7, None].index(batch_size)
                ) % 3 == 0 or dataset == "nested":
                    configs.append((dataset, sampler, batch_size, drop_last))
    return configs


CONFIGS = _configs()


def same(a: Any, b: Any, path: str = "batch") -> None:
    """Assert `a` (stoker) is identical to `b` (torch), naming the first difference."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs torch's {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(a, b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for key in a:
            same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{path}: arrays differ"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _run(mod: Any, dataset: str, sampler: str, batch_size: int | None, drop_last: bool, **extra: Any) -> Any:
    ds = DATASETS[dataset](mod)
    kwargs = SAMPLERS[sampler](mod, ds, 1234)
    loader = mod.DataLoader(ds, batch_size=batch_size, drop_last=drop_last, **kwargs, **extra)
    epochs = [list(loader) for _ in range(2)]
    return len(loader), epochs


def test_there_are_about_fifty_configurations() -> None:
    assert len(CONFIGS) >= 50


@pytest.mark.parametrize(("dataset", "sampler", "batch_size", "drop_last"), CONFIGS)
def test_in_process_batches_equal_torch(dataset: str, sampler: str, batch_size: int | None, drop_last: bool) -> None:
    ours_len, ours = _run(st, dataset, sampler, batch_size, drop_last)
    theirs_len, theirs = _run(tud, dataset, sampler, batch_size, drop_last)
    assert ours_len == theirs_len
    assert len(ours[0]) == theirs_len
    same(ours, theirs)


WORKER_CONFIGS = [c for i, c in enumerate(CONFIGS) if i % 4 == 0]


@pytest.mark.parametrize("engine", ["processes", "threads"])
@pytest.mark.parametrize(("dataset", "sampler", "batch_size", "drop_last"), WORKER_CONFIGS)
def test_two_workers_equal_torch_in_process(
    engine: str, dataset: str, sampler: str, batch_size: int | None, drop_last: bool
) -> None:
    extra = {"num_workers": 2, "thread_pool": engine == "threads"}
    ours_len, ours = _run(st, dataset, sampler, batch_size, drop_last, **extra)
    theirs_len, theirs = _run(tud, dataset, sampler, batch_size, drop_last)
    assert ours_len == theirs_len
    same(ours, theirs)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    ("n", "batch_size", "drop_last"), [(20, 3, False), (20, 3, True), (9, None, False), (17, 4, False)]
)
def test_iterable_batches_equal_torch_at_same_workers(
    n: int, batch_size: int | None, drop_last: bool, num_workers: int
) -> None:
    def run(mod: Any) -> Any:
        loader = mod.DataLoader(NestedStream(n), batch_size=batch_size, drop_last=drop_last, num_workers=num_workers)
        return len(loader), list(loader)

    ours_len, ours = run(st)
    theirs_len, theirs = run(tud)
    assert (
        ours_len
        == theirs_len
        == (n if batch_size is None else (n // batch_size if drop_last else math.ceil(n / batch_size)))
    )
    same(ours, theirs)


# ------------------------------------------------------- Subset subclasses
def _subset_subclass(mod: Any, overrides: str) -> type:
    """A subclass of `mod.Subset` overriding `__getitem__`, `__getitems__`, both or neither;
    "below_both": one overriding only `__getitem__` under one that overrides both. The
    overrides mark their samples so that the batches show which one the loader called."""

    def getitem(self: Any, i: int) -> Any:
        return {"from": "getitem", "i": self.indices[i]}

    def getitems(self: Any, indices: list[int]) -> Any:
        return [{"from": "getitems", "i": self.indices[i]} for i in indices]

    body: dict[str, Any] = {}
    if overrides in ("getitem", "both", "below_both"):
        body["__getitem__"] = getitem
    if overrides in ("getitems", "both", "below_both"):
        body["__getitems__"] = getitems
    cls = type(f"Custom{overrides.title()}Subset", (mod.Subset,), body)
    if overrides == "below_both":

        def getitem_below(self: Any, i: int) -> Any:
            return {"from": "getitem_below", "i": self.indices[i]}

        cls = type("CustomBelowSubset", (cls,), {"__getitem__": getitem_below})
    return cls


@pytest.mark.parametrize("overrides", ["neither", "getitem", "getitems", "both", "below_both"])
def test_subset_subclass_overriding_getitem_only_is_refused_as_torch_refuses(overrides: str) -> None:
    def outcome(mod: Any) -> Any:
        try:
            subset = _subset_subclass(mod, overrides)(mod.TensorDataset(torch.arange(10)), [9, 2, 4, 7, 0])
        except NotImplementedError as exc:
            return "refused", str(exc)
        return "made", len(subset), subset[1], list(mod.DataLoader(subset, batch_size=2))

    import stoker

    assert issubclass(st.Subset, stoker.Subset)  # so stoker.Subset refuses the same subclasses
    assert issubclass(st.Subset, tud.Subset)
    theirs = outcome(tud)
    if overrides == "getitem" and theirs[0] == "made":
        pytest.skip("this torch does not refuse Subset subclasses that override only __getitem__")
    ours = outcome(st)
    same(ours, theirs)  # the same outcome, the same message, the same batches
    assert (ours[0] == "refused") == (overrides == "getitem")


# ------------------------------------------- which worker makes which batch
def _worker_id() -> int:
    info = tud.get_worker_info() or st.get_worker_info()  # whichever loader runs us
    assert info is not None, "this dataset is meant to be read by worker processes"
    return info.id


class WorkerIdStream(tud.IterableDataset):
    """Every sample is the id of the worker that made it; worker w makes the batches
    b = w, w + num_workers, ... below `batches` (so the replicas differ in length when
    `batches` is not a multiple of the worker count)."""

    def __init__(self, batches: int, batch_size: int) -> None:
        self.batches, self.batch_size = batches, batch_size

    def __iter__(self):
        info = tud.get_worker_info() or st.get_worker_info()
        assert info is not None
        for _ in range(info.id, self.batches, info.num_workers):
            yield from [info.id] * self.batch_size

    def __len__(self) -> int:
        return self.batches * self.batch_size


class WorkerIdMap(tud.Dataset):
    """Map-style: every sample is the id of the worker that fetched it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __getitem__(self, i: int) -> int:
        return _worker_id()

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_multi_epochs_reproducibility(persistent_workers: bool) -> None:
    """torch's test of the same name (also run there with persistent workers): with an
    iterable dataset, batch b of every epoch comes from worker b % num_workers."""
    num_workers, batch_size, num_epochs = 2, 10, 3
    loader = st.DataLoader(
        WorkerIdStream(num_workers, batch_size),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        persistent_workers=persistent_workers,
    )
    for _ in range(num_epochs):
        for batch_idx, sample in enumerate(loader):
            assert sample.tolist() == [batch_idx % num_workers] * batch_size


def _round_robin_params() -> list[Any]:
    params = []
    for kind in ("iterable", "map"):
        for num_workers, batches in [(2, 5), (3, 7), (4, 6)]:
            for persistent_workers in (False, True):
                for prefetch_factor in (2, 4):
                    params.append(pytest.param(kind, num_workers, batches, persistent_workers, prefetch_factor))
    return params


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 4 workers on 2 cores
@pytest.mark.parametrize(
    ("kind", "num_workers", "batches", "persistent_workers", "prefetch_factor"), _round_robin_params()
)
def test_batch_b_comes_from_worker_b_mod_num_workers_in_every_epoch(
    kind: str, num_workers: int, batches: int, persistent_workers: bool, prefetch_factor: int
) -> None:
    """As torch assigns them: batch b of each epoch goes to worker b % num_workers, also when
    the epoch's length is not a multiple of the worker count, so the round-robin restarts at
    worker 0 each epoch rather than carrying on from where the last epoch stopped."""
    batch_size = 3
    dataset = WorkerIdStream(batches, batch_size) if kind == "iterable" else WorkerIdMap(batches * batch_size)
    loader = st.DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor,
    )
    for epoch in range(3):
        workers = [batch.tolist() for batch in loader]
        assert workers == [[b % num_workers] * batch_size for b in range(batches)], f"epoch {epoch}"
