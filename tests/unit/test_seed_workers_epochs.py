"""Per-sample randomness in every epoch, for any number and kind of workers (issue 45, item 5).

`stoker.sample_rng()` / `sample_seed()` and `seed_each_batch=True` derive from the base seed of
the loader's run, the epoch and the sample: a persistent iterator (one base seed for its life)
and a fresh iterator per epoch (one base seed each, as torch draws them) must give the same
draws in every epoch, not only the first, while torch's observables stay torch's: the order a
shared `torch.Generator` gives, `WorkerInfo.seed`, and the consumption of torch's global RNG.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import stoker
from stoker.testing import assert_resumes_identically

torch = pytest.importorskip("torch")
import torch.utils.data as tud  # noqa: E402

import stoker.torch as st  # noqa: E402

N = 12
BATCH = 4
EPOCHS = 3

# name -> DataLoader keyword arguments; num_workers=0 is the reference
CONFIGS: dict[str, dict[str, Any]] = {
    "inline": {"num_workers": 0},
    "fork": {"num_workers": 2, "multiprocessing_context": "fork"},
    "fork-persistent": {"num_workers": 2, "multiprocessing_context": "fork", "persistent_workers": True},
    "threads": {"num_workers": 2, "thread_pool": True},
    "threads-persistent": {"num_workers": 2, "thread_pool": True, "persistent_workers": True},
    "three-persistent": {"num_workers": 3, "multiprocessing_context": "fork", "persistent_workers": True},
}
PERSISTENT = [name for name, kwargs in CONFIGS.items() if kwargs.get("persistent_workers")]

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Draws(stoker.Dataset):
    """Each sample: its index, a draw from `sample_rng()` and the low bits of `sample_seed()`."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, stoker.sample_rng().random(), stoker.sample_seed() % 2**40], dtype=np.float64)


class GlobalDraws(stoker.Dataset):
    """Draws from numpy's global RNG (what `seed_each_batch=True` seeds before each batch)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, np.random.rand()])


class Stream(stoker.IterableDataset):
    """Each worker's replica yields its share of 0..N-1 with a draw from `sample_rng()`."""

    def __iter__(self):
        info = stoker.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, N, workers):
            yield np.array([i, stoker.sample_rng().random()])


class Plain(tud.Dataset):
    """torch's own Dataset for torch's loader and stoker.torch's side by side: the index and the
    seed of the worker that fetched it (torch's `get_worker_info().seed`, -1 inline)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, int]:
        info = tud.get_worker_info()
        return i, -1 if info is None else info.seed


def run(loader: Any, epochs: int = EPOCHS) -> list[list[list[float]]]:
    """The batches of `epochs` epochs, as lists."""
    return [[np.asarray(batch).tolist() for batch in loader] for _ in range(epochs)]


def by_sample(epochs: list[list[list[Any]]]) -> dict[tuple[int, int], list[Any]]:
    """Each sample's draws, by (epoch, index): what must not depend on the workers."""
    return {(e, int(row[0])): row[1:] for e, batches in enumerate(epochs) for batch in batches for row in batch}


def assert_epochs_draw_anew(epochs: list[list[list[Any]]]) -> None:
    draws = by_sample(epochs)
    for e in range(1, len(epochs)):
        assert all(draws[(e, i)] != draws[(0, i)] for i in range(N)), f"epoch {e} repeats epoch 0's draws"


@pytest.mark.parametrize("module", [stoker, st], ids=["stoker", "stoker.torch"])
def test_an_int_seed_gives_the_same_batches_in_every_epoch_for_every_worker_kind(module: Any) -> None:
    def epochs(name: str) -> list:
        return run(module.DataLoader(Draws(), batch_size=BATCH, shuffle=True, generator=7, **CONFIGS[name]))

    inline = epochs("inline")
    assert_epochs_draw_anew(inline)
    for name in CONFIGS:
        if name != "inline":
            got = epochs(name)
            assert [e for e in range(EPOCHS) if got[e] != inline[e]] == [], name


def test_a_torch_generator_keeps_torchs_order_and_gives_each_sample_the_same_draws() -> None:
    def generator() -> torch.Generator:
        return torch.Generator().manual_seed(11)

    inline = run(st.DataLoader(Draws(), batch_size=BATCH, shuffle=True, generator=generator()))
    assert_epochs_draw_anew(inline)
    reference = by_sample(inline)
    for name, kwargs in CONFIGS.items():
        got = run(st.DataLoader(Draws(), batch_size=BATCH, shuffle=True, generator=generator(), **kwargs))
        # a persistent iterator draws one base seed from the shared generator, a fresh one per
        # epoch one each: the order of later epochs is torch's for each (so it differs between
        # them), and each sample's draws in each epoch are the same whoever fetches it
        assert by_sample(got) == reference, name
        torch_kwargs = {k: v for k, v in kwargs.items() if k != "thread_pool"}
        theirs = tud.DataLoader(Plain(), batch_size=BATCH, shuffle=True, generator=generator(), **torch_kwargs)
        order = [[[int(i) for i in batch[0]] for batch in theirs] for _ in range(EPOCHS)]
        assert [[[int(row[0]) for row in batch] for batch in epoch] for epoch in got] == order, name


@pytest.mark.parametrize("generator", [None, "torch.Generator"])
@pytest.mark.parametrize("persistent", [False, True])
def test_worker_seeds_and_torchs_global_rng_stay_torchs(generator: Any, persistent: bool) -> None:
    def epochs(module: Any) -> tuple[list, Any]:
        torch.manual_seed(5)
        kwargs: dict[str, Any] = {"num_workers": 2, "persistent_workers": persistent, "multiprocessing_context": "fork"}
        if generator is not None:
            kwargs["generator"] = torch.Generator().manual_seed(3)
        loader = module.DataLoader(Plain(), batch_size=BATCH, shuffle=True, **kwargs)
        seen = [[(batch[0].tolist(), batch[1].tolist()) for batch in loader] for _ in range(EPOCHS)]
        return seen, torch.get_rng_state()

    ours, our_state = epochs(st)
    theirs, their_state = epochs(tud)
    assert ours == theirs  # the order, and which worker seed fetched each batch
    assert torch.equal(our_state, their_state)


def test_seed_each_batch_gives_the_same_batches_in_every_epoch_for_every_worker_kind() -> None:
    def epochs(name: str) -> list:
        kwargs = CONFIGS[name]
        if kwargs.get("thread_pool"):  # refused: thread workers share the global RNGs
            return inline
        loader = stoker.DataLoader(
            GlobalDraws(), batch_size=BATCH, shuffle=True, generator=4, seed_each_batch=True, **kwargs
        )
        return run(loader)

    inline: list = []
    inline = epochs("inline")
    assert_epochs_draw_anew(inline)
    for name in CONFIGS:
        assert epochs(name) == inline, name


@pytest.mark.parametrize("engine", ["fork", "threads"])
def test_an_iterable_gives_each_item_the_same_draws_persistent_or_not(engine: str) -> None:
    def epochs(persistent: bool) -> list:
        kwargs = {"thread_pool": True} if engine == "threads" else {"multiprocessing_context": engine}
        loader = stoker.DataLoader(
            Stream(), batch_size=BATCH, generator=9, num_workers=2, persistent_workers=persistent, **kwargs
        )
        return run(loader)

    fresh = epochs(False)
    assert_epochs_draw_anew(fresh)
    assert epochs(True) == fresh


@pytest.mark.parametrize("resumed_with", ["inline", "fork-persistent"])
def test_a_state_saved_between_epochs_keeps_the_runs_draws(resumed_with: str) -> None:
    def make(name: str = "inline") -> Any:
        return stoker.DataLoader(Draws(), batch_size=BATCH, shuffle=True, generator=2, **CONFIGS[name])

    whole = run(make())
    first = make()
    head = run(first, 1)
    state = json.loads(json.dumps(first.state_dict()))
    assert isinstance(state["sample_seed"], int)
    again = make(resumed_with)
    again.load_state_dict(state)
    assert head + run(again, EPOCHS - 1) == whole


@pytest.mark.parametrize(
    ("saved_with", "resumed_with"),
    [("fork-persistent", "fork-persistent"), ("fork-persistent", "inline"), ("inline", "threads-persistent")],
)
@pytest.mark.parametrize("step", [4, 7])  # in the second epoch, in the third
def test_a_resume_in_a_later_epoch_gives_the_uninterrupted_runs_draws(
    saved_with: str, resumed_with: str, step: int
) -> None:
    def make(num_workers: int | None = None) -> Any:
        kwargs = CONFIGS[saved_with if num_workers is None else resumed_with]
        return stoker.DataLoader(Draws(), batch_size=BATCH, shuffle=True, generator=5, **kwargs)

    assert_resumes_identically(make, steps=[step], worker_counts=[CONFIGS[resumed_with]["num_workers"]], epochs=4)
    # the resumed draws are the inline run's too (assert_resumes_identically compares with the
    # saving configuration's own run)
    assert run(make()) == run(stoker.DataLoader(Draws(), batch_size=BATCH, shuffle=True, generator=5))
