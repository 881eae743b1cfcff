"""What both tests of a state's stream description share (tests/unit/test_stream_identity.py,
tests/shards/test_shard_identity.py): run a loader, save its state part-way, load it into a
loader over a changed stream, and check that it is refused naming the differing key exactly
when the rows differ (nothing applied), and accepted and continued exactly when they are equal."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

import stoker

ELASTIC = "elastic"  # an argument whose change an elastic resume accepts (rank, world size)
TAKEN = 3  # batches consumed before the state is saved


def fingerprint(x: Any) -> Any:
    """A comparable form of a sample, a row or a batch: arrays by dtype, shape and bytes (a
    torch tensor as its numpy view: the same values are the same row)."""
    if isinstance(x, Mapping):
        return tuple(sorted((k, fingerprint(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(fingerprint(v) for v in x)
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):
        x = x.numpy()
    if isinstance(x, np.ndarray):
        return (x.dtype.str, x.shape, x.tobytes())
    return x


def listed(batch: list[Any]) -> list[Any]:
    return batch


def epoch(make: Callable[[], stoker.DataLoader[Any]]) -> list[Any]:
    return [fingerprint(b) for b in make()]


def stream(make: Callable[[], stoker.DataLoader[Any]]) -> list[Any]:
    """The first epoch's batches and, with a sampler that has epochs, the second's: a stream's
    later epochs may differ where its first does not (a schedule past the first epoch)."""
    loader = make()
    out = [fingerprint(b) for b in loader]
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(1)
        out += [fingerprint(b) for b in loader]
    return out


def saved_state(make: Callable[[], stoker.DataLoader[Any]]) -> dict[str, Any]:
    loader = make()
    it = iter(loader)
    for _ in range(TAKEN):
        next(it)
    state: dict[str, Any] = json.loads(json.dumps(loader.state_dict()))
    del it
    return state


def check_case(
    base: Callable[[], stoker.DataLoader[Any]], other: Callable[[], stoker.DataLoader[Any]], key: str | None
) -> None:
    """Rows differ => refused naming `key`, nothing applied; rows equal => accepted and the
    rest of the saved epoch follows. `key` None says the change leaves the rows equal."""
    saved_rows, other_rows = epoch(base), epoch(other)
    differ = stream(base) != stream(other)
    state = saved_state(base)
    loader = other()
    if key == ELASTIC:
        loader.load_state_dict(state)  # another rank or world: the elastic path takes it
        return
    assert differ == (key is not None), f"this case was meant to {'change' if key else 'keep'} the rows"
    if differ:
        with pytest.raises(
            ValueError, match=r"^this DataLoader state comes from another configuration and was not applied; "
        ):
            loader.load_state_dict(state)
        with pytest.raises(ValueError) as refused:
            loader.load_state_dict(state)
        assert f"{key}: saved " in str(refused.value), str(refused.value)
        assert [fingerprint(b) for b in loader] == other_rows  # nothing was applied
    else:
        loader.load_state_dict(state)
        assert [fingerprint(b) for b in loader] == saved_rows[TAKEN:]


def check_signature(cls: type, cases: Mapping[str, Any]) -> None:
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]  # type: ignore[misc]
    missing = [p for p in params if p not in cases]
    assert not missing, (
        f"{cls.__name__} has argument(s) {missing} that this test does not change: add a case for each "
        f"here, and record it in {cls.__name__}.stoker_describe() if it changes a row"
    )
    assert not set(cases) - set(params), f"cases for arguments {cls.__name__} no longer has"
