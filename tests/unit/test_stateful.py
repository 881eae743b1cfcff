"""The Stateful protocol stoker documents (torchdata's): `state_dict()` callable with no
argument and `load_state_dict(state)` with one, read from the signatures. A method of that
name with another signature is the object's own business, never called by stoker."""

from __future__ import annotations

import pickle
import re
import threading
from typing import Any

import numpy as np
import pytest

from stoker._core.replica import Unsaved, snapshot
from stoker._core.resume import is_stateful, why_not_stateful


class Protocol:
    def state_dict(self) -> dict[str, Any]:
        return {"at": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Optional(Protocol):
    def state_dict(self, destination: Any = None, *, keep_vars: bool = False) -> dict[str, Any]:  # type: ignore[override]
        return {}

    def load_state_dict(self, state: Any, strict: bool = True) -> None:  # type: ignore[override]
        pass


class Variadic(Protocol):
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return {}

    def load_state_dict(self, *args: Any) -> None:  # type: ignore[override]
        pass


class LitdataLike(Protocol):
    """litdata 0.2.76's StreamingDataset.state_dict asks for the loader's counts."""

    def state_dict(self, num_samples_yielded: int, num_workers: int, batch_size: int) -> dict[str, Any]:  # type: ignore[override]
        return {}


class MosaicLike(Protocol):
    """MosaicML Streaming 0.13's StreamingDataset.state_dict(num_samples, from_beginning)."""

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:  # type: ignore[override]
        return {}


class LoadsNothing(Protocol):
    def load_state_dict(self) -> None:  # type: ignore[override]
        pass


class LoadsTwo(Protocol):
    def load_state_dict(self, state: Any, strict: bool) -> None:  # type: ignore[override]
        pass


class OnlySave:
    def state_dict(self) -> dict[str, Any]:
        return {}


class NotAMethod(Protocol):
    state_dict = {"a": 1}  # type: ignore[assignment]


class Unreadable(Protocol):
    state_dict = staticmethod(getattr)  # a builtin without a signature inspect can read


class Delegating:
    """A wrapper whose __getattr__ raises something other than AttributeError."""

    def __getattr__(self, name: str) -> Any:
        raise KeyError(name)


@pytest.mark.parametrize("obj", [Protocol(), Optional(), Variadic()], ids=lambda o: type(o).__name__)
def test_the_protocols_signatures_are_stateful(obj: Any) -> None:
    assert why_not_stateful(obj) is None
    assert is_stateful(obj)


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        (
            LitdataLike(),
            r"its state_dict\(\) requires num_samples_yielded, num_workers, batch_size, and stoker calls it with no argument",
        ),
        (MosaicLike(), r"state_dict\(\) requires num_samples, from_beginning, and .* no argument"),
        (LoadsNothing(), r"load_state_dict\(\) takes no argument, and stoker calls it with one argument"),
        (LoadsTwo(), r"load_state_dict\(\) requires state, strict, and .* one argument"),
        (OnlySave(), r"no load_state_dict\(\) method"),
        (object(), r"no state_dict\(\) method"),
        (NotAMethod(), r"its state_dict is not a method"),
        (Unreadable(), r"signature of its state_dict\(\) cannot be read"),
        (Delegating(), r"no state_dict\(\) method"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else "",
)
def test_other_signatures_are_not_stateful_and_say_why(obj: Any, reason: str) -> None:
    assert not is_stateful(obj)
    said = why_not_stateful(obj)
    assert said is not None and re.search(reason, said), said


class Raises(Protocol):
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("no position yet")


class Unpicklable(Protocol):
    def state_dict(self) -> dict[str, Any]:
        return {"lock": threading.Lock()}


class Typed(Protocol):
    def state_dict(self) -> dict[str, Any]:
        return {"seen": {0: 3, 1: (2, 5)}, "array": np.arange(3), "kinds": {1, 2}}


class Live(Protocol):
    def __init__(self) -> None:
        self.state = {"at": 0}

    def state_dict(self) -> dict[str, Any]:
        return self.state  # the dataset's own dict, changed as it goes on


def test_a_replica_state_is_a_pickled_snapshot_of_any_type_or_the_reason_it_cannot_be_saved() -> None:
    assert pickle.loads(snapshot(Protocol())) == {"at": 1}
    live = Live()
    saved = snapshot(live)
    live.state["at"] = 5
    assert pickle.loads(saved) == {"at": 0}  # not the dict the dataset goes on changing
    typed = pickle.loads(snapshot(Typed()))  # int keys, tuples, arrays and sets come back as they were
    assert typed["seen"] == {0: 3, 1: (2, 5)} and isinstance(typed["seen"][1], tuple)
    assert isinstance(typed["array"], np.ndarray) and typed["array"].tolist() == [0, 1, 2]
    assert typed["kinds"] == {1, 2}
    raised = snapshot(Raises())
    assert isinstance(raised, Unsaved) and raised.kind == "raised"
    assert raised.reason == "its state_dict() raised RuntimeError: no position yet"
    unsaved = snapshot(Unpicklable())
    assert isinstance(unsaved, Unsaved) and unsaved.kind == "pickle"
    assert "cannot be pickled" in unsaved.reason and "lock" in unsaved.reason
