"""`DataLoader(progress=True)`: one tqdm bar per epoch, drawn by the main process only.

tqdm is optional (`pip install stoker[progress]`); `require_tqdm()` is called when the
loader is made, so a missing tqdm is an error at construction, not in the middle of a run.
"""

from __future__ import annotations

import importlib
from typing import Any

from .stats import Recorder, clock

REFRESH_S = 0.5  # how often the samples/s and readiness figures are recomputed


def require_tqdm() -> Any:
    """The tqdm module, or an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module("tqdm")
    except ImportError as exc:
        raise ImportError(
            "DataLoader(progress=True) draws its bar with tqdm, which is not installed; "
            "install it with: pip install 'stoker[progress]' (or pip install tqdm)"
        ) from exc


class EpochBar:
    """A bar over one epoch's batches, with samples/s and readiness from the iterator's
    statistics."""

    def __init__(self, total: int | None, epoch: int) -> None:
        tqdm = require_tqdm()
        self._bar = tqdm.tqdm(total=total, desc=f"epoch {epoch}", unit="batch", dynamic_ncols=True)
        self._next_refresh = clock() + REFRESH_S

    def advance(self, recorder: Recorder | None) -> None:
        """One batch was handed out."""
        self._bar.update(1)
        if recorder is not None and clock() >= self._next_refresh:
            self._next_refresh = clock() + REFRESH_S
            self._bar.set_postfix_str(_figures(recorder), refresh=False)

    def close(self, recorder: Recorder | None) -> None:
        if recorder is not None:
            self._bar.set_postfix_str(_figures(recorder), refresh=False)
        self._bar.close()


def _figures(recorder: Recorder) -> str:
    stats = recorder.snapshot(ready=0)
    return f"{stats.samples_per_s:,.0f} samples/s, readiness {stats.readiness:.2f}"
