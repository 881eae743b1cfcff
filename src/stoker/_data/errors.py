"""The exception types of the data layer (datasets and collation), for `stoker` and
`stoker.torch`: each subclasses the built-in error torch raises in the same place, so a user's
`except` clause written for torch catches it, and collation errors name the path of the
offending leaf (`sample['image'][1]`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "CollateRuntimeError",
    "CollateTypeError",
    "CollateValueError",
    "DatasetTypeError",
    "DatasetValueError",
    "format_path",
]


def format_path(path: Sequence[Any]) -> str:
    """`sample['image'][1]` for the keys ['image', 1]."""
    return "sample" + "".join(f"[{key!r}]" for key in path)


class DatasetValueError(ValueError, AssertionError):
    """Datasets that do not fit together (torch asserts here; this is also a ValueError)."""


class DatasetTypeError(TypeError, AssertionError):
    """A dataset of the wrong kind (torch asserts here; this is also a TypeError)."""


class _Located(Exception):
    """Mixin for collate errors that learn their path on the way out of the recursion."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.path: list[Any] = []
        super().__init__(reason)

    def __str__(self) -> str:
        return f"default_collate: {self.reason} at {format_path(self.path)}"


class CollateTypeError(_Located, TypeError):
    """A sample holds a type collation does not support, or types differ across samples."""


class CollateValueError(_Located, ValueError):
    """Samples do not line up: arrays of different shapes, sequences of different lengths."""


class CollateRuntimeError(_Located, RuntimeError):
    """Samples do not line up (torch raises RuntimeError here; so do we, with the path)."""
