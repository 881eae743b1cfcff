"""The exception types of `stoker.mix` (re-exported there): one place for what its datasets raise
beyond Python's own TypeError, ValueError and IndexError."""

from __future__ import annotations


class DocumentError(TypeError):
    """A document is not a 1-D integer array (or a mapping holding one under the `field`); the
    message names its source and index."""
