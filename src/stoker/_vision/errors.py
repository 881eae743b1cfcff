"""The exception types of `stoker.vision`, which re-exports them."""

from __future__ import annotations

__all__ = ["DecodeError"]


class DecodeError(OSError):
    """An image that cannot be decoded: the message names the file (or the bytes) and why.

    Raised by `DecodeCrop`; the original error is its `__cause__`. An `OSError`, as
    Pillow's `UnidentifiedImageError` is.
    """
