"""stoker.jax.DataLoader in one process with 8 CPU devices (tests/jax_face/conftest.py): a whole
epoch's batches equal stoker.DataLoader's, leaf for leaf, as jax.Arrays with the requested
sharding, for 0 and 2 workers, every start method, persistent workers or not; rank-0 leaves
replicated, strings passed through, tuple types kept; the same batches for any
device_prefetch, and a state that is the one after the batches handed over (whatever was placed
ahead), resuming exactly on another configuration and across stoker.DataLoader; a dataset's
error at its batch, after every earlier one; nothing left behind by a dropped iterator; workers
that never fork a process running JAX; processes placed by process_index/process_count.

JAX is imported inside the tests: worker processes unpickle this module's datasets (importing
this module), and need no JAX.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import stoker

N = 200  # 12 batches of 16 and a last one of 8: every batch divisible by the 8 devices
BATCH = 16
FORK_WARNING = "ignore:os.fork:RuntimeWarning"  # JAX's warning when a process running it forks


class Samples(stoker.Dataset):
    """Sample i: a float leaf of rank 2 and an int label, both functions of i."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": np.arange(6, dtype=np.float32).reshape(2, 3) + i, "y": np.int64(i)}


class Broken(Exception):
    """The dataset's own error."""


class FailsAt(Samples):
    """Raises Broken at sample `bad`."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.bad:
            raise Broken(f"sample {i} is broken")
        return super().__getitem__(i)


Pair = collections.namedtuple("Pair", ["x", "name"])


class Named(Samples):
    """Sample i: a Pair of a number and a string."""

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        return Pair(np.float32(i), f"s{i}")


# ----------------------------------------------------------------------------- helpers
def sharding_for(kind: str) -> Any:
    """The sharding argument for `kind`: None (the default), P('data') on a 4x2 mesh, or the
    batch axis over both axes of that mesh (all 8 devices)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if kind == "default":
        return None
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    return NamedSharding(mesh, P("data") if kind == "data4x2" else P(("data", "model")))


def host(batch: Any) -> Any:
    """A batch with every jax.Array made numpy (the values the devices hold, as one array)."""
    import jax

    if isinstance(batch, jax.Array):
        return np.asarray(batch)
    if isinstance(batch, dict):
        return {k: host(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(host(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(host(v) for v in batch)
    return batch


def assert_same(got: Any, want: Any, where: str = "batch", placed: bool = True) -> None:
    """`got` equals `want` (stoker.DataLoader's), leaf for leaf, types too. `placed`: `got`
    is a stoker.jax batch made numpy by host(), whose numpy scalars came back as 0-d arrays and
    whose 64-bit numbers JAX holds as 32-bit ones (unless jax_enable_x64 is set)."""
    import jax

    if placed and isinstance(want, np.generic):
        want = np.asarray(want)
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]", placed)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]", placed)
    elif isinstance(want, np.ndarray):
        dtype = jax.dtypes.canonicalize_dtype(want.dtype) if placed else want.dtype
        assert got.dtype == dtype and got.shape == want.shape, f"{where}: {got.dtype}{got.shape}"
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert got == want, where


def assert_batches(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want), f"{len(got)} batches, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(host(g), w, f"batch {i}")


def numpy_epochs(epochs: int, **kwargs: Any) -> list[list[Any]]:
    """stoker.DataLoader's batches for `epochs` epochs (no workers: the same for any number)."""
    loader = stoker.DataLoader(kwargs.pop("dataset", Samples()), **{"batch_size": BATCH, **kwargs})
    return [list(loader) for _ in range(epochs)]


def jax_loader(**kwargs: Any) -> Any:
    from stoker.jax import DataLoader

    return DataLoader(kwargs.pop("dataset", Samples()), **{"batch_size": BATCH, **kwargs})


def without_jax(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "jax"}


# ---------------------------------------------------------------------- a whole epoch
EPOCH_CASES = [
    pytest.param("default", 0, None, False, id="default-inline"),
    pytest.param("data4x2", 2, None, True, id="mesh4x2-forkserver-persistent"),
    pytest.param("all8", 2, "spawn", False, id="all8-spawn"),
    pytest.param(
        "default", 2, "fork", True, id="default-fork-persistent", marks=pytest.mark.filterwarnings(FORK_WARNING)
    ),
    pytest.param("all8", 2, "fork", False, id="all8-fork", marks=pytest.mark.filterwarnings(FORK_WARNING)),
]


@pytest.mark.parametrize(("sharding", "workers", "context", "persistent"), EPOCH_CASES)
def test_two_epochs_equal_stoker_batches_as_sharded_jax_arrays(
    sharding: str, workers: int, context: str | None, persistent: bool
) -> None:
    import jax

    args: dict[str, Any] = {"shuffle": True, "generator": 0}
    want = numpy_epochs(2, **args)
    loader = jax_loader(
        **args,
        sharding=sharding_for(sharding),
        num_workers=workers,
        multiprocessing_context=context,
        persistent_workers=persistent,
    )
    if sharding == "default":
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        requested = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    else:
        requested = sharding_for(sharding)
    for epoch in range(2):
        got = list(loader)
        assert_batches(got, want[epoch])
        for batch in got:
            for key in ("x", "y"):
                leaf = batch[key]
                assert isinstance(leaf, jax.Array), key
                assert leaf.sharding.is_equivalent_to(requested, leaf.ndim), (key, leaf.sharding)
                assert len(leaf.sharding.device_set) == 8
                # every device holds the rows the sharding gives it
                for shard in leaf.addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(leaf)[shard.index])
    assert len(want[0]) == 13 and want[0][-1]["y"].shape == (8,)


def test_rank0_leaves_are_replicated_and_strings_pass_through() -> None:
    import jax

    def collate(samples: list[Any]) -> dict[str, Any]:
        batch = stoker.default_collate(samples)
        return {"batch": batch, "count": np.int64(len(samples)), "scale": np.array(0.5, np.float32)}

    def named(samples: list[Any]) -> dict[str, Any]:
        return dict(collate(samples), names=[f"n{int(y)}" for y in stoker.default_collate(samples)["y"]])

    want = numpy_epochs(1, collate_fn=named)[0]
    got = list(jax_loader(collate_fn=named, sharding=sharding_for("data4x2")))
    assert_batches(got, want)
    for batch in got:
        for key in ("count", "scale"):
            leaf = batch[key]
            assert isinstance(leaf, jax.Array) and leaf.shape == (), key
            assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8, key
        assert int(batch["count"]) == batch["batch"]["x"].shape[0]
        assert batch["names"] == [f"n{int(y)}" for y in np.asarray(batch["batch"]["y"])]
        assert all(type(name) is str for name in batch["names"])


def test_a_namedtuple_and_a_tuple_batch_keep_their_types() -> None:
    import jax

    got = list(jax_loader(dataset=Named()))
    assert_batches(got, numpy_epochs(1, dataset=Named())[0])
    assert all(type(b) is Pair and isinstance(b.x, jax.Array) and type(b.name) is list for b in got)

    def as_tuple(samples: list[Any]) -> tuple[Any, ...]:
        batch = stoker.default_collate(samples)
        return (batch["x"], batch["y"])

    got = list(jax_loader(collate_fn=as_tuple))
    assert_batches(got, numpy_epochs(1, collate_fn=as_tuple)[0])
    assert all(type(b) is tuple and all(isinstance(leaf, jax.Array) for leaf in b) for b in got)


def test_device_prefetch_0_1_3_give_the_same_batches() -> None:
    want = numpy_epochs(1, shuffle=True, generator=3)[0]
    for depth in (0, 1, 3):
        assert_batches(list(jax_loader(shuffle=True, generator=3, device_prefetch=depth)), want)


# -------------------------------------------------------------------------- resume
STEPS = 13  # batches in an epoch


def numpy_states(points: list[int]) -> tuple[list[Any], dict[int, dict[str, Any]]]:
    """The uninterrupted run's batches over 2 epochs, and stoker.DataLoader's state after each
    of `points` batches handed over (a point of STEPS: the first epoch exhausted)."""
    loader = stoker.DataLoader(Samples(), batch_size=BATCH, shuffle=True, generator=0)
    batches: list[Any] = []
    states = {}
    iterator = iter(loader)
    if 0 in points:
        states[0] = loader.state_dict()
    for batch in iterator:
        batches.append(batch)
        if len(batches) in points and len(batches) < STEPS:
            states[len(batches)] = loader.state_dict()
    if STEPS in points:
        states[STEPS] = loader.state_dict()
    batches += list(loader)
    return batches, states


def resumed(state: dict[str, Any], **kwargs: Any) -> list[Any]:
    """The batches a fresh stoker.jax loader gives from `state` to the end of the second epoch."""
    loader = jax_loader(shuffle=True, generator=0, **kwargs)
    loader.load_state_dict(state)
    got = list(loader)
    if loader.state_dict()["epoch"] < 2:
        got += list(loader)
    return got


# (batches handed over before the state is taken; the resuming loader's configuration)
RESUME_CASES = [
    pytest.param(0, {}, id="right-after-iter"),
    pytest.param(1, {"device_prefetch": 0}, id="after-1-prefetch0"),
    pytest.param(
        5,
        {"num_workers": 2, "persistent_workers": True, "device_prefetch": 1, "sharding": "all8"},
        id="mid-2workers-all8",
    ),
    pytest.param(STEPS - 1, {"sharding": "data4x2"}, id="at-the-last-batch"),
    pytest.param(STEPS, {"device_prefetch": 3}, id="after-the-epoch"),
]


@pytest.mark.parametrize(("taken", "resume_with"), RESUME_CASES)
def test_a_state_is_the_one_after_the_batches_handed_over(taken: int, resume_with: dict[str, Any]) -> None:
    want, numpy_state = numpy_states([taken])
    loader = jax_loader(shuffle=True, generator=0, device_prefetch=3)
    iterator = iter(loader)
    got = [next(iterator) for _ in range(min(taken, STEPS))]
    if taken == STEPS:
        with pytest.raises(StopIteration):
            next(iterator)
    state = loader.state_dict()
    assert state["jax"] == {"rows": "global", "process_count": 1, "process_index": 0}
    assert without_jax(state) == numpy_state[taken]
    assert_batches(got, want[:taken])
    if "sharding" in resume_with:
        resume_with = dict(resume_with, sharding=sharding_for(resume_with["sharding"]))
    assert_batches(resumed(state, **resume_with), want[taken:])
    # the iterator goes on from where it was, and the state with it
    rest = list(iterator)
    assert_batches(rest, want[taken:STEPS])


def test_a_state_after_break_is_the_one_after_the_batches_handed_over() -> None:
    # the loop's iterator is dropped at the break, with device_prefetch batches placed ahead
    want, numpy_state = numpy_states([2])
    loader = jax_loader(shuffle=True, generator=0, device_prefetch=3)
    got = []
    for batch in loader:
        got.append(batch)
        if len(got) == 2:
            break
    assert_batches(got, want[:2])
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 2), "the batches placed ahead were counted as handed over"
    assert without_jax(state) == numpy_state[2]
    assert_batches(resumed(state), want[2:])


def test_states_cross_between_stoker_and_stoker_jax() -> None:
    want, numpy_state = numpy_states([4])
    # stoker.DataLoader's state into stoker.jax's
    assert_batches(resumed(numpy_state[4], num_workers=0), want[4:])
    # stoker.jax's (without its "jax" key) into stoker.DataLoader's
    loader = jax_loader(shuffle=True, generator=0, device_prefetch=2)
    iterator = iter(loader)
    for _ in range(7):
        next(iterator)
    back = stoker.DataLoader(Samples(), batch_size=BATCH, shuffle=True, generator=0)
    back.load_state_dict(without_jax(loader.state_dict()))
    rest = list(back) + list(back)
    assert len(rest) == len(want) - 7
    for i, (g, w) in enumerate(zip(rest, want[7:])):
        assert_same(g, w, f"batch {i}", placed=False)


# ------------------------------------------------------------------ failures, leftovers
def test_a_dataset_error_surfaces_at_its_batch_after_every_earlier_one() -> None:
    bad = 100  # in batch 6 of 16
    want = numpy_epochs(1)[0]
    loader = jax_loader(dataset=FailsAt(bad), num_workers=2, device_prefetch=2)
    iterator = iter(loader)
    got = []
    with pytest.raises(Broken, match="sample 100 is broken"):
        while True:
            got.append(next(iterator))
    assert_batches(got, want[: bad // BATCH])


def test_a_dropped_iterator_and_a_break_leave_nothing_behind() -> None:
    # the leak check (tests/conftest.py) fails the test on any process, thread, fd or shm left
    want = numpy_epochs(1)[0]
    loader = jax_loader(num_workers=2, device_prefetch=2)
    iterator = iter(loader)
    assert_batches([next(iterator) for _ in range(3)], want[:3])
    del iterator
    for got in loader:
        assert_batches([got], want[:1])
        break


# ------------------------------------------------------------ workers and a running JAX
SCRIPT = textwrap.dedent(
    """
    import sys

    import numpy as np

    import jax
    import jax.numpy as jnp
    import stoker
    from stoker.jax import DataLoader


    def main():
        assert len(jax.devices()) == 8
        jax.jit(lambda a: a * 2)(jnp.arange(8.0)).block_until_ready()  # JAX's threads run
        context = None if sys.argv[1] == "default" else sys.argv[1]
        loader = DataLoader(stoker.TensorDataset(np.arange(64, dtype=np.float32)), batch_size=8,
                            num_workers=2, multiprocessing_context=context)
        total = sum(float(batch[0].sum()) for batch in loader)
        assert total == 64 * 63 / 2, total
        print("done")


    if __name__ == "__main__":
        main()
    """
)


def run_script(tmp_path: Any, context: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "workers_after_jax.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", str(script), context],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )


def test_workers_start_without_forking_a_process_running_jax(tmp_path: Any) -> None:
    done = run_script(tmp_path, "default")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done" in done.stdout
    assert "os.fork()" not in done.stderr, done.stderr[-3000:]


def test_fork_workers_show_jaxs_fork_warning(tmp_path: Any) -> None:
    # the control: the check above can fail
    done = run_script(tmp_path, "fork")
    assert "os.fork() was called" in done.stderr and "RuntimeWarning" in done.stderr, done.stderr[-3000:]


# ------------------------------------------------------------------- placed processes
def test_two_placed_processes_rows_make_the_global_batch() -> None:
    args: dict[str, Any] = {"dataset": Samples(192), "shuffle": True, "generator": 5}
    want = numpy_epochs(1, **args)[0]
    parts = [list(jax_loader(**args, process_index=i, process_count=2)) for i in (0, 1)]
    assert len(parts[0]) == len(parts[1]) == len(want) == 12
    for i, (first, second, whole) in enumerate(zip(*parts, want)):
        for key in ("x", "y"):
            assert first[key].shape[0] == second[key].shape[0] == BATCH // 2
            joined = np.concatenate([np.asarray(first[key]), np.asarray(second[key])])
            np.testing.assert_array_equal(joined, whole[key], err_msg=f"batch {i}[{key!r}]")
