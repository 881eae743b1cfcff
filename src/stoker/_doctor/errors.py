"""The exception types of `stoker doctor` (the command's own module is `_cli.py`): a problem
with the target it was given, and a failure of the dataset while it measured. Each is reported
as one line, and the command exits with status 2."""

from __future__ import annotations

__all__ = ["DoctorError", "MeasureError"]


class DoctorError(Exception):
    """A problem with the target (import, factory, returned object): one line, exit 2."""


class MeasureError(Exception):
    """The dataset failed while the doctor measured it (one line, naming the sample)."""
