"""num_workers="auto" / prefetch_factor="auto": the model, the probe, and the loader's choice."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import stoker
from stoker._core import auto
from stoker._core.auto import (
    choose,
    choose_prefetch,
    choose_workers,
    predicted_rate,
    probe,
    probe_indices,
)
from stoker._core.loader import usable_cpus

MAIN_S = 250e-6
CPUS = usable_cpus() or 1


def test_cheap_batches_stay_inline() -> None:
    workers, rate, inline = choose_workers(batch_s=300e-6, main_s=MAIN_S, cpus=2, cap=2)
    assert workers == 0 and rate == inline


def test_expensive_batches_get_workers_up_to_the_cpus() -> None:
    assert choose_workers(batch_s=30e-3, main_s=MAIN_S, cpus=2, cap=2)[0] == 2
    workers, rate, inline = choose_workers(batch_s=30e-3, main_s=MAIN_S, cpus=64, cap=64)
    # the fewest workers within 5 % of the best prediction: the main process's limit
    # (1 / c_m = 4000 batches/s) is far; 64 CPUs less one each batch's share
    assert 40 <= workers <= 64 and rate > 30 * inline


def test_the_main_process_limits_how_many_workers_help() -> None:
    # a 2 ms batch: 1 / c_m = 4000 batches/s is reached with ~10 workers; more add nothing
    workers, rate, _ = choose_workers(batch_s=2e-3, main_s=MAIN_S, cpus=64, cap=64)
    assert rate == pytest.approx(1 / MAIN_S, rel=0.06)
    assert 8 <= workers <= 11


def test_large_batches_that_are_only_copies_stay_inline_on_two_cpus() -> None:
    # 10 MB of images collated in 1.3 ms: workers writing into shared memory do not pay off
    assert choose_workers(batch_s=1.3e-3, main_s=MAIN_S, cpus=2, cap=2, nbytes=10_000_000)[0] == 0
    assert choose_workers(batch_s=1.3e-3, main_s=MAIN_S, cpus=16, cap=16, nbytes=10_000_000)[0] > 0


def test_cap_bounds_the_choice() -> None:
    assert choose_workers(batch_s=30e-3, main_s=MAIN_S, cpus=64, cap=3)[0] == 3
    assert choose_workers(batch_s=30e-3, main_s=MAIN_S, cpus=64, cap=0)[0] == 0


def test_predicted_rate_shapes() -> None:
    assert predicted_rate(0, 1e-3, MAIN_S, 8) == pytest.approx(1000)
    assert predicted_rate(2, 1e-3, MAIN_S, 8) == pytest.approx(2 / 1.25e-3)
    assert predicted_rate(100, 1e-3, MAIN_S, 1000) == pytest.approx(1 / MAIN_S)


def test_prefetch_covers_the_spread_and_memory() -> None:
    assert choose_prefetch([1.0] * 8, 10, 2, None) == 2
    # the first (cold) probe and one outlier do not count; a steady spread does
    assert choose_prefetch([9.0, 1, 1, 1, 1, 1, 1, 1], 10, 2, None) == 2
    assert choose_prefetch([1, 1, 1, 1, 1, 3, 3, 3], 10, 2, None) == 6
    assert choose_prefetch([1, 1, 1, 1, 1, 9, 9, 9], 10, 2, None) == auto.MAX_PREFETCH
    # 5 % of 1000 bytes of memory holds 2 batches of 25 bytes for 1 worker
    assert choose_prefetch([1, 1, 1, 1, 1, 9, 9, 9], 25, 1, 1000) == 2


def test_probe_indices_spread_and_wrap() -> None:
    assert probe_indices(100, 4, 3) == [[0, 1, 2, 3], [33, 34, 35, 36], [66, 67, 68, 69]]
    assert probe_indices(3, 4, 2) == [[0, 1, 2], [1, 2, 0]]
    assert probe_indices(0, 4, 2) == []


class Lazy(stoker.Dataset):
    """Opens its 'file' on first access, as datasets holding file handles do, and draws
    from the global RNGs."""

    def __init__(self, n: int = 64) -> None:
        self.n = n
        self.handle: object | None = None
        self.fetches = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self.handle is None:
            self.handle = object()
        self.fetches += 1
        return np.full(3, i + np.random.rand() + random.random(), np.float64)


def test_probe_leaves_the_dataset_and_the_global_rngs_as_they_were() -> None:
    dataset = Lazy()
    np.random.seed(5)
    random.seed(5)
    before = (np.random.rand(), random.random())
    np.random.seed(5)
    random.seed(5)
    times, nbytes = probe(dataset, stoker.default_collate, 4, True)
    assert len(times) == auto.PROBE_BATCHES and nbytes == 4 * 3 * 8
    assert dataset.handle is None and dataset.fetches == 0  # the probe fetched from a copy
    assert (np.random.rand(), random.random()) == before


def test_probe_sample_rng_works_as_in_a_fetch() -> None:
    class Augments(stoker.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> float:
            return float(stoker.sample_rng().random())

    times, _ = probe(Augments(), stoker.default_collate, 4, True)
    assert times


def test_choose_for_an_iterable_does_not_probe() -> None:
    class Stream(stoker.IterableDataset):
        def __iter__(self):
            raise AssertionError("an IterableDataset is not iterated by the choice")

    choice = choose(
        Stream(),
        iterable=True,
        collate_fn=stoker.default_collate,
        auto_collation=True,
        batch_size=4,
        cpus=16,
        workers=None,
        prefetch_factor=None,
        auto_prefetch=True,
    )
    assert (choice.num_workers, choice.prefetch_factor) == (8, 2)
    assert "not probed" in choice.reason


def test_choose_when_the_probe_raises_falls_back_and_says_why() -> None:
    class Broken(stoker.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            raise OSError("disk gone")

    choice = choose(
        Broken(),
        iterable=False,
        collate_fn=stoker.default_collate,
        auto_collation=True,
        batch_size=4,
        cpus=4,
        workers=None,
        prefetch_factor=None,
        auto_prefetch=False,
    )
    assert choice.num_workers == 3 and "OSError" in choice.reason


class Heavy(stoker.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> np.ndarray:
        end = time.perf_counter() + 0.01  # 10 ms of CPU per sample
        while time.perf_counter() < end:
            pass
        return np.zeros(2)


def test_loader_chooses_once_states_it_and_keeps_it(caplog: pytest.LogCaptureFixture) -> None:
    dataset = Lazy(64)
    loader = stoker.DataLoader(dataset, batch_size=8, num_workers="auto", prefetch_factor="auto")
    # chosen in the first epoch: until then the counts "auto" starts from
    assert (loader.num_workers, loader.prefetch_factor) == (auto.start_workers(CPUS), auto.START_PREFETCH)
    with caplog.at_level(logging.INFO, logger="stoker"):
        first = [b for b in loader]
        chosen = (loader.num_workers, loader.prefetch_factor)
        second = [b for b in loader]
    assert isinstance(loader.num_workers, int) and (loader.num_workers, loader.prefetch_factor) == chosen
    assert len(first) == len(second) == 8
    records = [r for r in caplog.records if "DataLoader chose" in r.getMessage()]
    assert len(records) == 1
    assert loader.stats().choice is not None and loader.stats().choice.startswith(f"num_workers={chosen[0]}")
    assert loader.stats().num_workers == chosen[0]


def test_loader_auto_gives_workers_to_cpu_heavy_samples() -> None:
    loader = stoker.DataLoader(Heavy(), batch_size=4, num_workers="auto")
    assert len(list(loader)) == 6
    cpus = stoker._core.loader.usable_cpus() or 1
    assert loader.num_workers == cpus  # 40 ms batches: every CPU helps
    assert loader.prefetch_factor == 2  # not auto: the default


def test_auto_prefetch_with_a_given_worker_count() -> None:
    loader = stoker.DataLoader(Heavy(), batch_size=4, num_workers=1, prefetch_factor="auto")
    next(iter(loader))
    assert loader.num_workers == 1 and loader.prefetch_factor >= 2
    assert "num_workers=1" in loader.stats().choice


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_workers": "many"}, TypeError, "num_workers should be an int or 'auto'"),
        ({"num_workers": 2, "prefetch_factor": "lots"}, TypeError, "prefetch_factor should be an int, None or 'auto'"),
        ({"num_workers": 0, "prefetch_factor": "auto"}, ValueError, "prefetch_factor option could only be specified"),
    ],
)
def test_bad_auto_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        stoker.DataLoader(Lazy(8), **kwargs)


def test_auto_accepts_a_start_method_and_persistent_workers() -> None:
    loader = stoker.DataLoader(
        Heavy(), batch_size=4, num_workers="auto", multiprocessing_context="fork", persistent_workers=True
    )
    for _ in range(2):
        assert len(list(loader)) == 6
    assert loader.num_workers >= 1


def test_head_chooses_after_enough_batches_or_enough_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # the main process's cost per batch is scaled by this machine's measured speed, which a busy
    # machine lowers: here the machine runs at the reference speed, so the choice rests on the
    # batch times given below alone
    monkeypatch.setattr(auto, "speed_loop", lambda: auto.REFERENCE_LOOP_S)
    start = auto.AutoStart(
        cpus=2,
        auto_prefetch=True,
        prefetch_factor=None,
        persistent=False,
        arena=None,
        on_choice=lambda choice, iterator: None,
    )
    head = auto.Head(start)
    head.add(None)  # a batch that raised tells nothing
    assert not head.done() and head.decide().num_workers == 0
    for _ in range(auto.PROBE_BATCHES - 1):
        head.add((4, 64, 0.010, 0.001, 0.011))
    assert not head.done()
    head.add((4, 64, 0.010, 0.001, 0.011))
    assert head.done()
    choice = head.decide()  # 11 ms batches on 2 CPUs: workers pay off
    assert choice.num_workers == 2 and "first batches, fetched in the main process" in choice.reason
    slow = auto.Head(start)
    slow.add((4, 64, auto.PROBE_BUDGET_S, 0.0, auto.PROBE_BUDGET_S))
    assert slow.done()  # one batch as long as the budget is enough
    cheap = auto.Head(start)
    for count in range(1, auto.PROBE_MAX_BATCHES + 1):
        cheap.add((4, 64, 0.0001, 0.0, 0.0001))  # 0.1 ms batches: timed until the cap
        assert cheap.done() == (count == auto.PROBE_MAX_BATCHES)
    assert cheap.decide().num_workers == 0
    medium = auto.Head(start)
    for count in range(1, 11):
        medium.add((4, 64, 0.002, 0.0, 0.002))  # 2 ms batches: timed until they add up to 20 ms
        assert medium.done() == (count * 0.002 >= auto.PROBE_MIN_S - 1e-9)


def _auto_loaders(flavour: Any, dataset: Callable[[], Any]) -> dict[str, Any]:
    """One loader per way of asking for "auto", none iterated yet."""

    class Stream(flavour.IterableDataset):  # type: ignore[misc,name-defined]
        def __iter__(self) -> Any:
            return iter(range(8))

    return {
        "map": flavour.DataLoader(dataset(), batch_size=4, num_workers="auto", prefetch_factor="auto"),
        "map, persistent": flavour.DataLoader(
            dataset(), batch_size=4, num_workers="auto", persistent_workers=True, multiprocessing_context="fork"
        ),
        "stream": flavour.DataLoader(Stream(), batch_size=4, num_workers="auto", prefetch_factor="auto"),
        "prefetch only": flavour.DataLoader(dataset(), batch_size=4, num_workers=1, prefetch_factor="auto"),
    }


def _assert_torch_takes(loader: Any) -> None:
    """torch's own checks accept the loader's counts: its DataLoader is made from them (as
    accelerate makes one from a loader's attributes), and its worker-count check runs."""
    tud = pytest.importorskip("torch.utils.data")
    for value in (loader.num_workers, loader.prefetch_factor):
        assert value is None or (isinstance(value, int) and value >= 0), value
    tud.DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        multiprocessing_context=loader.multiprocessing_context,
    )
    tud.DataLoader.check_worker_number_rationality(loader)


def test_auto_counts_are_ints_that_torchs_checks_take_before_and_after_the_choice() -> None:
    torch_flavour = pytest.importorskip("stoker.torch", exc_type=ImportError)
    for name, loader in _auto_loaders(torch_flavour, Heavy).items():
        given = 1 if name == "prefetch only" else auto.start_workers(CPUS)
        assert (loader.num_workers, loader.prefetch_factor) == (given, auto.START_PREFETCH), name
        assert repr(loader.num_workers) == str(given)
        _assert_torch_takes(loader)
        list(loader)
        chosen = loader.stats()
        assert chosen.choice is not None, name
        assert (loader.num_workers, loader.prefetch_factor) == (chosen.num_workers, chosen.prefetch_factor), name
        if loader.num_workers:  # torch refuses prefetch_factor and persistence without workers
            _assert_torch_takes(loader)


def test_a_loader_made_from_an_auto_loaders_attributes_asks_for_auto_again() -> None:
    """What Lightning and accelerate do: re-create a loader from the attributes of the one the
    user made. The counts read "auto"'s provisional (or chosen) ints, and the new loader still
    makes its own choice with them, not a fixed worker count."""
    for name, loader in _auto_loaders(stoker, lambda: Lazy(16)).items():
        for when in ("before", "after"):
            if when == "after":
                list(loader)
            again = stoker.DataLoader(
                loader.dataset, batch_size=4, num_workers=loader.num_workers, prefetch_factor=loader.prefetch_factor
            )
            assert isinstance(again.num_workers, int) and isinstance(again.prefetch_factor, int)
            list(again)
            assert again.stats().choice is not None, (name, when)
            given = name == "prefetch only"
            assert (again.num_workers == 1) if given else again.stats().choice.startswith("num_workers="), name
    # a plain int made from the count is a given count, as any int is
    fixed = stoker.DataLoader(Lazy(16), batch_size=4, num_workers=int(again.num_workers))
    list(fixed)
    assert fixed.stats().choice is None and type(fixed.num_workers) is int


def test_the_doctor_sees_an_auto_loader_as_auto() -> None:
    """`stoker doctor` measures a loader's fixed setting as its "current" row; an "auto" one
    (whose counts read ints) has none, and the doctor says what it asked for."""
    from stoker._doctor.target import describe_target

    for kwargs in ({"num_workers": "auto"}, {"num_workers": 1, "prefetch_factor": "auto"}):
        target = describe_target("m:f", stoker.DataLoader(Lazy(8), batch_size=4, **kwargs), 4)
        assert target.current is None and target.auto is not None and "'auto'" in target.auto, kwargs
    fixed = describe_target("m:f", stoker.DataLoader(Lazy(8), batch_size=4, num_workers=1), 4)
    assert fixed.current is not None and fixed.auto is None
