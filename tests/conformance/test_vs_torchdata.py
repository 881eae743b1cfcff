"""torchdata's `StatefulDataLoader` and `stoker.torch.StatefulDataLoader` side by side: the
same arguments, the same interruption points, the same remaining items after a resume.

Each case (torchdata_cases.CASES) is run uninterrupted for two epochs by each library. Then,
at each interruption point, a fresh loader is run to the point, its `state_dict()` taken
(and passed through pickle, as a checkpoint file would), and a fresh loader over a fresh
dataset loads it and runs to the end of the second epoch:
- (a) for each library, the resumed batches equal the uninterrupted run's remaining ones;
- (b) where both libraries define the order alike (no `shuffle=True`: torchdata swaps in a
  RandomSampler of its own, which draws otherwise than torch's, which stoker follows), the two
  uninterrupted runs are equal.
With `in_order=False` torchdata promises nothing about resuming, so only stoker's (a) is
asserted there, on each epoch's remaining items as multisets. A point where torchdata itself
fails is marked `xfail(strict=True)` on torchdata's side, with the reason; stoker's is asserted.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata", minversion="0.11")
import torch.utils.data as tud  # noqa: E402
from torchdata_cases import ALL, CASES, POINTS, Case, MapRange  # noqa: E402

import stoker.torch as st  # noqa: E402

# torchdata 0.11.0's loader calls torch.set_vital, deprecated in torch 2.13
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

LIBS = ("torchdata", "stoker")
EPOCHS = 2

Batches = list[Any]  # one epoch's batches, as plain Python values


def _loader_class(lib: str) -> type:
    if lib == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader
    return st.StatefulDataLoader


def _plain(value: Any) -> Any:
    """A batch as plain Python values: tensors and arrays as lists, tuples as lists."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _items(batches: Batches) -> Counter[Any]:
    out: Counter[Any] = Counter()
    for batch in batches:
        out.update(batch)
    return out


def _epoch(loader: Any, case: Case, epoch: int) -> Batches:
    case.before_epoch(loader, epoch)
    return [_plain(batch) for batch in loader]


def _run(loader: Any, case: Case, first_epoch: int) -> list[Batches]:
    return [_epoch(loader, case, e) for e in range(first_epoch, EPOCHS)]


_uninterrupted: dict[tuple[str, str], list[Batches]] = {}


def _reference(lib: str, case: Case) -> list[Batches]:
    """The uninterrupted run's batches, per epoch (made once per process)."""
    key = (lib, case.id)
    if key not in _uninterrupted:
        _uninterrupted[key] = _run(case.make(_loader_class(lib)), case, 0)
    return _uninterrupted[key]


def _checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """What a new process reads back from a checkpoint file."""
    return pickle.loads(pickle.dumps(state))


def _resumed(lib: str, case: Case, state: dict[str, Any]) -> Any:
    loader = case.make(_loader_class(lib))
    loader.load_state_dict(_checkpoint(state))
    return loader


def _state_difference(a: Any, b: Any, path: str = "state") -> str | None:
    """Where two states differ (values or types, arrays and tensors by dtype and value)."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(repr, a))} vs {sorted(map(repr, b))}"
        for key in a:
            found = _state_difference(a[key], b[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _state_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, np.ndarray):
        same = a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        same = a == b
    return None if same else f"{path}: {a!r} vs {b!r}"


def _assert_continues(
    case: Case, reference: list[Batches], epoch: int, delivered: Batches, resumed: list[Batches], what: str
) -> None:
    """`resumed` (epochs `epoch`..) is the rest of `reference` after `delivered` of `epoch`."""
    if case.ordered:
        assert resumed == [reference[epoch][len(delivered) :], *reference[epoch + 1 :]], what
        return
    assert _items(delivered) <= _items(reference[epoch]), "the interrupted run delivered items of no epoch"
    expected = [_items(reference[epoch]) - _items(delivered), *map(_items, reference[epoch + 1 :])]
    assert [_items(batches) for batches in resumed] == expected, f"{what} (items per epoch)"


def _resume_params() -> Iterator[Any]:
    for case in CASES:
        for point in case.points:
            for lib in LIBS:
                if lib == "torchdata" and not case.ordered:
                    continue  # in_order=False: torchdata gives no guarantee
                marks = []
                if lib == "torchdata" and point in case.torchdata_xfail:
                    marks.append(pytest.mark.xfail(strict=True, reason=case.torchdata_xfail[point]))
                yield pytest.param(case, point, lib, id=f"{case.id}-{point}-{lib}", marks=marks)


@pytest.mark.parametrize(("case", "point", "lib"), list(_resume_params()))
def test_resume_continues_as_uninterrupted(case: Case, point: str, lib: str) -> None:
    """(a): the batches after a resume are the uninterrupted run's remaining ones."""
    reference = _reference(lib, case)
    epoch, taken, iterate = POINTS[point]
    if taken == ALL:
        taken = len(reference[epoch])

    loader = case.make(_loader_class(lib))
    for e in range(epoch):
        _epoch(loader, case, e)
    delivered: Batches = []
    it = None
    if iterate:
        case.before_epoch(loader, epoch)
        it = iter(loader)
        delivered = [_plain(next(it)) for _ in range(taken)]
    if case.ordered:
        assert delivered == reference[epoch][:taken], "the interrupted run is not the uninterrupted one"
    states = [loader.state_dict()]
    if point == "twice":
        states.append(loader.state_dict())
        difference = _state_difference(states[0], states[1])
        assert difference is None, f"two state_dict() calls in a row differ: {difference}"
    del loader, it
    what = "resumed from the state"

    if point in ("after_resume", "after_resume_1"):
        again = _resumed(lib, case, states[0])
        case.before_epoch(again, epoch)
        it = iter(again)
        more = [_plain(next(it)) for _ in range(point == "after_resume_1")]
        states = [again.state_dict()]
        # the loader that resumed and saved again goes on as the uninterrupted run
        rest = [more + [_plain(batch) for batch in it], *_run(again, case, epoch + 1)]
        _assert_continues(case, reference, epoch, delivered, rest, "the resumed loader, saved again, going on")
        delivered += more
        del again, it
        what = "resumed from the state taken after a resume"

    for i, state in enumerate(states):
        _assert_continues(
            case, reference, epoch, delivered, _run(_resumed(lib, case, state), case, epoch), f"{what} #{i}"
        )


@pytest.mark.parametrize("case", [c for c in CASES if c.same_order and c.ordered], ids=lambda c: c.id)
def test_same_batches_as_torchdata(case: Case) -> None:
    """(b): where both libraries define the order alike, stoker's uninterrupted run is
    torchdata's."""
    assert _reference("stoker", case) == _reference("torchdata", case)


class SeedMap(MapRange):
    """Item i with the worker's seed (from the iterator's base seed), 0 in process."""

    def __getitem__(self, i: int) -> list[int]:
        info = tud.get_worker_info() or st.get_worker_info()
        return [i, info.seed % 100_000 if info is not None else 0]


@pytest.fixture
def global_rng() -> Iterator[None]:
    saved = torch.get_rng_state()
    yield
    torch.set_rng_state(saved)


BASE_SEED_KEPT = (
    "torchdata: a state taken after an epoch (2 workers) keeps that finished epoch's base seed, "
    "so the resumed epoch's workers are seeded as the finished epoch's were"
)


def _without_generator_params() -> list[Any]:
    params = []
    for point in ("before_iter", "epoch_end"):
        for workers in (0, 2):
            for lib in LIBS:
                marks = []
                if lib == "torchdata" and point == "epoch_end" and workers:
                    marks.append(pytest.mark.xfail(strict=True, reason=BASE_SEED_KEPT))
                params.append(pytest.param(point, workers, lib, id=f"{point}-w{workers}-{lib}", marks=marks))
    return params


@pytest.mark.usefixtures("global_rng")
@pytest.mark.parametrize(("point", "workers", "lib"), _without_generator_params())
def test_without_generator_the_state_fixes_the_next_epoch(point: str, workers: int, lib: str) -> None:
    """No `generator`: a state taken before the first iter() (or after an epoch) fixes the
    next epoch's order and base seed, whatever torch's global RNG is when it is loaded."""
    loader_class = _loader_class(lib)
    extra = {"num_workers": 2, "multiprocessing_context": "fork"} if workers else {}

    def make() -> Any:
        return loader_class(SeedMap(), batch_size=3, shuffle=True, **extra)

    torch.manual_seed(1234)
    loader = make()
    reference = [[_plain(batch) for batch in loader] for _ in range(EPOCHS)]
    assert reference[0] != reference[1], "the two epochs should be drawn differently"

    torch.manual_seed(1234)  # the interrupted run, from the same start
    loader = make()
    epoch = POINTS[point][0]
    for _ in range(epoch):
        list(loader)
    state = loader.state_dict()
    del loader

    torch.manual_seed(98765)  # a new process, seeded otherwise
    resumed = make()
    resumed.load_state_dict(_checkpoint(state))
    assert [_plain(batch) for batch in resumed] == reference[epoch]
