"""Test helpers for users of stoker: check that your own datasets and samplers resume exactly.

```python
import stoker
from stoker.testing import assert_resumes_identically

class MyDataset(stoker.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return i + stoker.sample_rng().random()

def make_loader(num_workers=2):
    return stoker.DataLoader(MyDataset(), batch_size=8, shuffle=True, generator=0,
                             num_workers=num_workers)

assert_resumes_identically(make_loader, worker_counts=[0, 2])
```
"""

from __future__ import annotations

import pickle
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["assert_resumes_identically"]


def _global_rngs() -> list[tuple[Callable[[Any], Any], Any]]:
    """Python's, numpy's and (if imported) torch's global RNG states, with their setters: a
    training script checkpoints these next to the loader's state."""
    import numpy as np

    states: list[tuple[Callable[[Any], Any], Any]] = [
        (random.setstate, random.getstate()),
        (np.random.set_state, np.random.get_state()),
    ]
    torch = sys.modules.get("torch")
    if torch is not None:
        states.append((torch.set_rng_state, torch.get_rng_state()))
    return states


def _plain(batch: Any) -> Any:
    """A batch as nested Python values, so that batches compare with ==."""
    if hasattr(batch, "tolist") and callable(batch.tolist):
        return ("array", str(getattr(batch, "dtype", "")), tuple(getattr(batch, "shape", ())), batch.tolist())
    if isinstance(batch, dict):
        return {key: _plain(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch).__name__, [_plain(value) for value in batch]
    return batch


def _run(loader: Any, epochs: int, stop: int | None = None) -> tuple[list[Any], int, bool]:
    """Batches of up to `epochs` epochs, stopping before batch `stop`; the number of
    iter() calls made; and whether the last epoch was left part-way (its end not seen)."""
    out: list[Any] = []
    calls = 0
    for _ in range(epochs):
        if stop is not None and len(out) == stop:
            return out, calls, False
        iterator = iter(loader)
        calls += 1
        while True:
            if stop is not None and len(out) == stop:
                return out, calls, True
            try:
                batch = next(iterator)
            except StopIteration:
                break
            out.append(_plain(batch))
    return out, calls, False


def assert_resumes_identically(
    make_loader: Callable[..., Any],
    *,
    steps: Iterable[int] | None = None,
    worker_counts: Sequence[int] | None = None,
    epochs: int = 2,
) -> None:
    """Assert that a loader resumed from its `state_dict()` at any point goes on exactly as
    the uninterrupted run did.

    Runs `make_loader()` for `epochs` epochs; then, for each interruption point, takes
    `state_dict()` there (through pickle, as `torch.save` would keep it), loads it into a
    fresh loader and asserts that the rest of the run is identical, batch for batch. The
    global RNGs (random, numpy, torch) are put back to their state at the interruption
    before each resume, as a training script's checkpoint does: a generator-less sampler
    draws its next epochs from them.

    Args:
        make_loader: Makes a fresh loader (a `stoker.DataLoader` or `stoker.torch.DataLoader`),
            the same each call; with `worker_counts`, it takes `num_workers` as a keyword.
        steps: The interruption points, as numbers of batches delivered before the
            interruption (0 to the run's total); None: every point, from before the first
            batch to after the last. Defaults to None.
        worker_counts: The `num_workers` each resumed loader is made with
            (`make_loader(num_workers=n)`, each in turn), to check a resume with another
            worker count; None: `make_loader()` as it is. Defaults to None.
        epochs: How many epochs the run lasts. Defaults to 2.

    Raises:
        AssertionError: when a resumed run differs, naming the interruption point, the
            worker count and the first batch that differs, with both versions of it.
        ValueError: when a step lies outside the run.
    """
    reference, _, _ = _run(make_loader(), epochs)
    points = range(len(reference) + 1) if steps is None else steps
    counts: list[int | None] = list(worker_counts) if worker_counts is not None else [None]
    for step in points:
        if not 0 <= step <= len(reference):
            raise ValueError(f"steps: {step} is outside the run's {len(reference)} batches")
        interrupted = make_loader()
        head, calls, partway = _run(interrupted, epochs, stop=step)
        state = pickle.loads(pickle.dumps(interrupted.state_dict()))
        rngs = _global_rngs()
        del interrupted
        for count in counts:
            resumed = make_loader() if count is None else make_loader(num_workers=count)
            for restore, saved in rngs:  # as the script's own checkpoint would
                restore(saved)
            resumed.load_state_dict(state)
            rest, _, _ = _run(resumed, epochs - calls + (1 if partway else 0))
            got = head + rest
            if got != reference:
                first = next(
                    (i for i, (a, b) in enumerate(zip(got, reference)) if a != b),
                    min(len(got), len(reference)),
                )
                workers = "" if count is None else f" with num_workers={count}"
                expected = reference[first] if first < len(reference) else "(the run had ended)"
                actual = got[first] if first < len(got) else "(nothing more)"
                raise AssertionError(
                    f"resumed after batch {step}{workers}: batch {first} of the run differs "
                    f"(batch {first - step} after the resume): expected {expected!r:.300}, got {actual!r:.300}"
                )
