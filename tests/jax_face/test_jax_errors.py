"""stoker.jax.DataLoader's bad input, on 8 CPU devices (tests/jax_face/conftest.py): each refused
with the error type the API documents and a message naming the argument; a state whose streams
were another process's refused by name, and nothing of it applied."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import stoker


class Samples(stoker.Dataset):
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": np.full(3, i, np.float32), "y": np.int64(i)}


class Stream(stoker.IterableDataset):
    """Numbers 0..n-1, the same for every process (a test reads only who is asked for what)."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(np.arange(self.n, dtype=np.int64))


def loader(dataset: Any = None, **kwargs: Any) -> Any:
    from stoker.jax import DataLoader

    return DataLoader(Samples() if dataset is None else dataset, **{"batch_size": 16, **kwargs})


@pytest.mark.parametrize("batch_size", [12, 4, 20])
def test_a_batch_the_sharding_cannot_cut_names_batch_size(batch_size: int) -> None:
    with pytest.raises(ValueError, match=rf"batch_size \({batch_size}\).*divisible.*8 pieces"):
        loader(batch_size=batch_size)


def test_a_batch_size_a_2d_mesh_can_cut_is_accepted_and_one_it_cannot_refused() -> None:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    assert len(list(loader(batch_size=4, sharding=NamedSharding(mesh, P("data"))))) == 16
    with pytest.raises(ValueError, match=r"batch_size \(6\).*4 pieces"):
        loader(batch_size=6, sharding=NamedSharding(mesh, P("data")))


def test_a_last_batch_the_sharding_cannot_cut_names_drop_last() -> None:
    with pytest.raises(ValueError, match=r"drop_last.*68 samples make a last batch of 4|68 samples.*drop_last=True"):
        loader(Samples(68))
    assert [b["x"].shape[0] for b in loader(Samples(68), drop_last=True)] == [16] * 4


def test_leaves_with_different_row_counts_are_named_at_their_batch() -> None:
    def collate(samples: list[Any]) -> dict[str, Any]:
        batch = stoker.default_collate(samples)
        return {"x": batch["x"], "extra": np.zeros(len(samples) + 8, np.float32)}

    iterator = iter(loader(collate_fn=collate, device_prefetch=0))
    with pytest.raises(ValueError, match=r"\['x'\]: 16, \['extra'\]: 24"):
        next(iterator)


@pytest.mark.parametrize("sharding", ["data", 8, object()])
def test_a_sharding_that_is_not_a_sharding_names_sharding(sharding: Any) -> None:
    with pytest.raises(TypeError, match=r"sharding.*jax\.sharding\.Sharding"):
        loader(sharding=sharding)


def test_a_sharding_from_a_mesh_is_refused_naming_sharding() -> None:
    import jax

    with pytest.raises(TypeError, match="sharding"):
        loader(sharding=jax.make_mesh((8,), ("data",)))


@pytest.mark.parametrize(("depth", "error"), [(-1, ValueError), (1.5, TypeError), ("2", TypeError), (None, TypeError)])
def test_a_bad_device_prefetch_names_it(depth: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="device_prefetch"):
        loader(device_prefetch=depth)


@pytest.mark.parametrize(
    ("given", "error", "named"),
    [
        ({"process_index": 0}, ValueError, "process_index and process_count"),
        ({"process_count": 2}, ValueError, "process_index and process_count"),
        ({"process_index": 2, "process_count": 2}, ValueError, r"process_index.*below process_count \(2\)"),
        ({"process_index": -1, "process_count": 2}, ValueError, "process_index"),
        ({"process_index": 0, "process_count": 0}, ValueError, "process_count"),
        ({"process_index": 0.0, "process_count": 2}, TypeError, "process_index"),
        ({"process_index": 0, "process_count": "2"}, TypeError, "process_count"),
        ({"process_index": 0, "process_count": 3}, ValueError, r"batch_size \(16\).*divisible by process_count \(3\)"),
        ({"process_index": 0, "process_count": 4}, ValueError, r"batch_size \(4 rows per process\).*8 pieces"),
    ],
)
def test_bad_process_placement_names_the_argument(given: dict[str, Any], error: type[Exception], named: str) -> None:
    with pytest.raises(error, match=named):
        loader(**given)


def test_pin_memory_is_refused() -> None:
    with pytest.raises(ValueError, match="pin_memory"):
        loader(pin_memory=True)


def test_batch_size_none_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_size=None"):
        loader(batch_size=None)


def test_a_per_process_state_is_refused_on_another_process_and_nothing_applied() -> None:
    first = loader(Stream(), process_index=0, process_count=2)
    iterator = iter(first)
    taken = [np.asarray(next(iterator)) for _ in range(2)]
    state = first.state_dict()
    assert state["jax"] == {"rows": "per_process", "process_count": 2, "process_index": 0}

    other = loader(Stream(), process_index=1, process_count=2)
    fresh = [np.asarray(b) for b in loader(Stream(), process_index=1, process_count=2)]
    with pytest.raises(ValueError, match=r"process_index is 0 in the state and 1 here.*not applied"):
        other.load_state_dict(state)
    got = [np.asarray(b) for b in other]  # from the beginning, as if no state had been offered
    assert len(got) == len(fresh) == 8
    for g, f in zip(got, fresh):
        np.testing.assert_array_equal(g, f)
    np.testing.assert_array_equal(got[0], taken[0])

    # on the same process it resumes where it was
    same = loader(Stream(), process_index=0, process_count=2)
    with pytest.warns(UserWarning, match="replaying the 16 item"):  # Stream keeps no state: replayed
        same.load_state_dict(state)
    np.testing.assert_array_equal(np.asarray(next(iter(same))), np.arange(16, 24))


def test_a_per_process_state_is_refused_by_a_loader_that_follows_jax() -> None:
    first = loader(Stream(), process_index=1, process_count=2)
    next(iter(first))
    with pytest.raises(ValueError, match=r"(rows|process_count|process_index) is .* in the state"):
        loader(Stream()).load_state_dict(first.state_dict())


def test_a_state_that_is_not_a_dict_names_state() -> None:
    with pytest.raises(TypeError, match="state"):
        loader().load_state_dict([("epoch", 0)])  # type: ignore[arg-type]


def test_shuffling_over_several_processes_without_a_generator_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"generator should be given"):
        loader(shuffle=True, process_index=0, process_count=2)
    first, second = (loader(shuffle=True, generator=3, process_index=i, process_count=2) for i in (0, 1))
    rows = [np.asarray(a["y"]).tolist() + np.asarray(b["y"]).tolist() for a, b in zip(first, second)]
    assert sorted(i for batch in rows for i in batch) == list(range(64))  # each sample once


def test_a_spec_over_two_mesh_axes_lays_out_every_leaf() -> None:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"))

    class Wide(Samples):  # 4 features: the "model" axis cuts them in 2
        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"x": np.full(4, i, np.float32), "y": np.int64(i)}

    batch = next(iter(loader(batch_size=8, dataset=Wide(), sharding=NamedSharding(mesh, P("data", "model")))))
    assert batch["x"].sharding.spec == P("data", "model") and batch["y"].sharding.spec == P("data")
    np.testing.assert_array_equal(np.asarray(batch["y"]), np.arange(8))
