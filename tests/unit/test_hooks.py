"""`_base/hooks.py`: what `follows` and `upcoming_of` accept, and that the design page for
dataset authors lists every hook the module declares."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

from stoker._base import hooks
from stoker._base.hooks import (
    DescribesStream,
    KeepsEpoch,
    SetsEpoch,
    Stateful,
    follows,
    upcoming_of,
)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "design" / "hooks.md"


class Forwarding:
    """A wrapper that forwards every attribute it lacks to what it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Described:
    def stoker_describe(self) -> dict[str, Any]:
        return {"type": "Described"}


class Fetching:
    def __init__(self, fetches: bool = True) -> None:
        self.fetches = fetches
        self.told: list[list[int]] = []

    def stoker_upcoming(self, indices: list[int], behind: int) -> bool:
        self.told.append(indices)
        return True

    def stoker_fetches_ahead(self) -> bool:
        return self.fetches


def protocols() -> dict[str, type]:
    return {
        name: obj
        for name, obj in vars(hooks).items()
        if inspect.isclass(obj) and getattr(obj, "_is_protocol", False) and obj.__module__ == hooks.__name__
    }


def test_follows_reads_attributes_as_hasattr_does_on_every_python() -> None:
    assert follows(Described(), DescribesStream)
    assert not follows(object(), DescribesStream)
    # a forwarding wrapper follows what it forwards (3.12's isinstance would say no)
    assert follows(Forwarding(Described()), DescribesStream)
    # a protocol's inherited members count: KeepsEpoch is set_epoch and epoch

    class OnlySets:
        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    sampler = OnlySets()
    assert follows(sampler, SetsEpoch) and not follows(sampler, KeepsEpoch)
    sampler.set_epoch(3)
    assert follows(sampler, KeepsEpoch)
    assert hooks._members(Stateful) == ("state_dict", "load_state_dict")


def test_upcoming_of_asks_the_class_then_the_instance() -> None:
    fetching = Fetching()
    hook = upcoming_of(fetching)
    assert hook is not None and hook([1, 2], 0) is True and fetching.told == [[1, 2]]
    assert upcoming_of(Fetching(fetches=False)) is None  # the instance has nothing to fetch
    assert upcoming_of(Forwarding(Fetching())) is None  # never through a wrapper's __getattr__
    plain = Described()
    plain.stoker_upcoming = lambda indices, behind: True  # type: ignore[attr-defined]
    assert upcoming_of(plain) is None  # an instance attribute is not the class's hook


def test_the_design_page_lists_every_hook() -> None:
    page = PAGE.read_text()
    found = protocols()
    assert len(found) >= 14
    for name, protocol in found.items():
        assert f"`{name}`" in page, f"docs/design/hooks.md does not name the protocol {name}"
        for member in hooks._members(protocol):
            assert re.search(rf"`{re.escape(member)}[(:`]", page), f"docs/design/hooks.md does not list {name}.{member}"
