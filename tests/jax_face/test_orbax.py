"""A stoker.jax loader's state in an Orbax checkpoint (orbax-checkpoint's CheckpointManager),
saved in the same step as a small Flax NNX model: the restored model and loader train on exactly
the remaining batches, with the uninterrupted run's losses; a dataset's own state that JSON
cannot hold as it is comes back equal and of the same types; a checkpoint without the loader's
state is refused, naming what is missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker

pytest.importorskip("orbax.checkpoint", reason="needs orbax-checkpoint")
pytest.importorskip("flax.nnx", reason="needs flax")

BATCH = 16
N = 160  # 10 batches
SAVED_AT = 4  # batches trained before the checkpoint


class Samples(stoker.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": np.linspace(-1, 1, 3, dtype=np.float32) * (i % 7), "y": np.float32(i % 5)}


class KeepsState(Samples):
    """A map-style dataset with a state of its own (`kept`), recording every state loaded."""

    def __init__(self, kept: Any = None) -> None:
        self.kept = kept
        self.loaded: list[Any] = []

    def state_dict(self) -> Any:
        return self.kept

    def load_state_dict(self, state: Any) -> None:
        self.loaded.append(state)


def loader(dataset: Any = None, **kwargs: Any) -> Any:
    from stoker.jax import DataLoader

    return DataLoader(Samples() if dataset is None else dataset, batch_size=BATCH, shuffle=True, generator=0, **kwargs)


def manager(directory: Path) -> Any:
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(directory)


def model(seed: int = 0) -> Any:
    from flax import nnx

    return nnx.Linear(3, 1, rngs=nnx.Rngs(seed))


def trainer(graphdef: Any) -> Any:
    """A jitted SGD step on the model's state: (state, batch) -> (state, loss)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @jax.jit
    def step(state: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
        def loss_of(params: Any) -> Any:
            prediction = nnx.merge(graphdef, params)(batch["x"])[:, 0]
            return jnp.mean((prediction - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_of)(state)
        return jax.tree.map(lambda p, g: p - 0.05 * g, state, grads), loss

    return step


def train(step: Any, state: Any, batches: Any, count: int | None = None) -> tuple[Any, list[float], list[Any]]:
    """`count` steps (all of `batches` when None): the state, the losses and the batches (numpy)."""
    losses, seen = [], []
    for batch in batches:
        state, loss = step(state, batch)
        losses.append(float(loss))
        seen.append({k: np.asarray(v) for k, v in batch.items()})
        if len(losses) == count:
            break
    return state, losses, seen


def test_model_and_loader_restored_together_train_on_exactly_the_remaining_batches(tmp_path: Path) -> None:
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    import stoker.jax

    graphdef, initial = nnx.split(model())
    step = trainer(graphdef)
    _, want_losses, want_batches = train(step, initial, loader())
    assert len(want_batches) == N // BATCH

    # interrupted: SAVED_AT steps with batches placed ahead, then a checkpoint of both
    first = loader(device_prefetch=3)
    iterator = iter(first)
    state, losses, _ = train(step, initial, iterator, SAVED_AT)
    assert losses == want_losses[:SAVED_AT]
    mngr = manager(tmp_path / "checkpoints")
    mngr.save(
        SAVED_AT,
        args=ocp.args.Composite(model=ocp.args.StandardSave(state), loader=stoker.jax.CheckpointSave(first)),
    )
    mngr.wait_until_finished()
    mngr.close()
    saved = sorted(p.name for p in (tmp_path / "checkpoints" / str(SAVED_AT) / "loader").iterdir())
    assert "process_0-of-1.json" in saved, saved
    del iterator, first

    # restored in a fresh model and a fresh loader (of another device_prefetch)
    abstract_graph, abstract_state = nnx.split(nnx.eval_shape(lambda: model(seed=1)))
    resumed = loader(device_prefetch=1)
    mngr = manager(tmp_path / "checkpoints")
    assert mngr.latest_step() == SAVED_AT
    restored = mngr.restore(
        SAVED_AT,
        args=ocp.args.Composite(
            model=ocp.args.StandardRestore(abstract_state), loader=stoker.jax.CheckpointRestore(resumed)
        ),
    )
    mngr.close()
    assert restored.loader is resumed
    for got, kept in zip(jax.tree.leaves(restored.model), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(kept))
    _, rest_losses, rest_batches = train(trainer(abstract_graph), restored.model, resumed)
    assert len(rest_batches) == len(want_batches) - SAVED_AT
    for i, (got, want) in enumerate(zip(rest_batches, want_batches[SAVED_AT:])):
        for key in ("x", "y"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"batch {SAVED_AT + i}[{key!r}]")
    np.testing.assert_allclose(rest_losses, want_losses[SAVED_AT:], rtol=1e-6)


def save_and_restore(tmp_path: Path, kept: Any) -> tuple[list[str], KeepsState, Any, Any]:
    """A loader over KeepsState(kept) checkpointed after 3 batches and restored in a fresh one:
    the loader's files, the fresh dataset, its first batch after the restore, and the batch the
    interrupted loader would have given next."""
    import orbax.checkpoint as ocp

    import stoker.jax

    first = loader(KeepsState(kept))
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    mngr = manager(tmp_path / "checkpoints")
    mngr.save(1, args=ocp.args.Composite(loader=stoker.jax.CheckpointSave(first)))
    mngr.wait_until_finished()
    files = sorted(p.name for p in (tmp_path / "checkpoints" / "1" / "loader").iterdir())
    dataset = KeepsState()
    resumed = loader(dataset)
    mngr.restore(1, args=ocp.args.Composite(loader=stoker.jax.CheckpointRestore(resumed)))
    mngr.close()
    return files, dataset, next(iter(resumed)), next(iterator)


def assert_equal_and_same_types(got: Any, want: Any, where: str = "state") -> None:
    assert type(got) is type(want), f"{where}: {type(got).__name__}, saved as {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_equal_and_same_types(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_equal_and_same_types(g, w, f"{where}[{i}]")
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, where
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert got == want, where


def test_a_dataset_state_json_cannot_hold_round_trips_through_pickle(tmp_path: Path) -> None:
    kept = {"seen": (3, 4), "weights": np.arange(3, dtype=np.int16)}
    files, dataset, got, want = save_and_restore(tmp_path, kept)
    assert "process_0-of-1.pkl" in files and "process_0-of-1.json" not in files, files
    assert len(dataset.loaded) == 1
    assert_equal_and_same_types(dataset.loaded[0], kept)
    for key in ("x", "y"):
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))


@pytest.mark.parametrize(
    "kept",
    [
        pytest.param({"seen": (3, 4)}, id="tuple"),
        pytest.param({"by_shard": {7: 2}}, id="int-keys"),
    ],
)
def test_a_dataset_state_json_would_change_comes_back_of_the_same_types(tmp_path: Path, kept: Any) -> None:
    # json.dumps accepts these, but json.loads gives a list for the tuple, "7" for the key 7
    _, dataset, got, want = save_and_restore(tmp_path, kept)
    assert len(dataset.loaded) == 1
    assert_equal_and_same_types(dataset.loaded[0], kept)
    for key in ("x", "y"):
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))


def test_a_checkpoint_without_the_loaders_state_is_refused_naming_it(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp
    from flax import nnx

    import stoker.jax

    _, state = nnx.split(model())
    mngr = manager(tmp_path / "checkpoints")
    mngr.save(1, args=ocp.args.Composite(model=ocp.args.StandardSave(state)))
    first = loader()
    next(iter(first))
    mngr.save(2, args=ocp.args.Composite(model=ocp.args.StandardSave(state), loader=stoker.jax.CheckpointSave(first)))
    mngr.wait_until_finished()
    item = tmp_path / "checkpoints" / "2" / "loader"
    for path in item.glob("process_*"):
        path.unlink()

    resumed = loader()
    # no loader item in the step: Orbax names the item
    with pytest.raises(KeyError, match="loader"):
        mngr.restore(1, args=ocp.args.Composite(loader=stoker.jax.CheckpointRestore(resumed)))
    # the item without a state file: stoker names the directory
    with pytest.raises(FileNotFoundError, match=f"{item}.*holds no stoker loader state"):
        mngr.restore(2, args=ocp.args.Composite(loader=stoker.jax.CheckpointRestore(resumed)))
    mngr.close()
    assert resumed.state_dict()["position"] == 0  # nothing applied


def test_checkpoint_args_refuse_what_is_not_a_loader(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    import stoker.jax

    mngr = manager(tmp_path / "checkpoints")
    with pytest.raises(TypeError, match=r"CheckpointSave takes a loader.*dict"):
        mngr.save(1, args=ocp.args.Composite(loader=stoker.jax.CheckpointSave({"not": "a loader"})))
        mngr.wait_until_finished()
    mngr.close()
