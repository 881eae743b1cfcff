"""Drawing ahead: a map-style dataset that fetches ahead (`_base/hooks.py`'s `FetchesAhead`,
`stoker_upcoming(indices, behind)`, read through `upcoming_of`) is told each batch's indices
as the loader's sampler draws them, ahead of their dispatch, so it can fetch what they need
(`stoker.shards.ShardedDataset` downloads their shards).

The hook is opt-in by the dataset's class (and, through `stoker_fetches_ahead`, by the
instance), and costs nothing to a dataset without it: its sampler is read exactly as before,
one batch at a time when the scheduler dispatches. With it, the sampler is drawn ahead while
the dataset answers True; what the loader delivers, its order and its `state_dict()` (a count
of batches delivered) are the same either way.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

# a bound on the batches drawn ahead of dispatch, whatever the dataset answers
MOST_AHEAD = 4096


def drawing_ahead(source: Iterator[Any], hook: Any, window: int) -> Iterator[Any]:
    """`source` (an index sampler's iterator), drawn ahead while `hook` asks for more; each
    item is passed to `hook` once, in order, when drawn.

    `window`: how many batches may be dispatched and not yet delivered (the loader's
    prefetch window); the hook hears how many drawn batches may still be unread."""
    ahead: collections.deque[Any] = collections.deque()
    done = False
    while True:
        more = True
        while not done and (not ahead or more) and len(ahead) < MOST_AHEAD:
            try:
                item = next(source)
            except StopIteration:
                done = True
                break
            ahead.append(item)
            indices = [item] if isinstance(item, int) else list(item)
            more = bool(hook(indices, window + len(ahead)))
        if not ahead:
            return
        yield ahead.popleft()
