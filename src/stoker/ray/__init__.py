"""stoker on a Ray cluster: a map-style dataset read by Ray Data, batches as stoker gives them.

    driver (this process)                               Ray cluster (any node)
    ---------------------                               ----------------------
    DataLoader.__iter__
      this rank's batches: DistributedSampler
      + BatchSampler, from the saved position
      dataset ──ray.put (once)──────────────────────▶ object store
      _Source(batches) ──read_datasource─────────────▶ read task k: a contiguous run of batches
                                                        ray.get(dataset); for each batch: fetch
                                                        under stoker's per-sample seeding scope,
                                                        collate, pickle ──▶ one Arrow row
      iter_batches(prefetch) ◀── blocks (position, pickled batch) ─┘
      unpickle ──▶ the batch, exactly as the collate_fn made it

Samples cross the cluster pickled inside an Arrow binary column, so they come back as the
very objects the dataset and the collate_fn made (Ray Data would otherwise turn rows into
Arrow columns and change their types). Nothing depends on the state of a Ray worker process:
a read task gets everything it needs (dataset, batches, seeds) as arguments.

`stoker.sample_rng()` / `stoker.sample_seed()` inside a read task give what they give in
stoker's own workers: (base seed, epoch, sample index), the base seed being the one a
`stoker.DataLoader(..., generator=seed)` draws first (see `base_seed_of`).

The package, one concern per module (imports point down this list): `epoch` (which batches a
rank reads, how read tasks share them), `errors`, `blocks` (samples and batches as Arrow rows
and back), `read` (the read tasks, the datasource, `to_ray_dataset`), `loader` (`DataLoader`)
and `split` (`streaming_split`). This module is the public face: the names below, each
reporting `stoker.ray` as its module, as they did when stoker.ray was one file.
"""

from __future__ import annotations

# `X as X`: not in __all__, but attributes of stoker.ray when it was one file (tests read them)
from .blocks import IN_BAND_BYTES as IN_BAND_BYTES
from .blocks import _batch_block as _batch_block
from .blocks import _BatchRows as _BatchRows
from .blocks import decode
from .epoch import SAMPLES_PER_FETCH as SAMPLES_PER_FETCH
from .epoch import UNITS_PER_TASK as UNITS_PER_TASK
from .epoch import _batch_tasks as _batch_tasks
from .epoch import _sample_tasks as _sample_tasks
from .epoch import base_seed_of, read_task_count
from .epoch import contiguous_slices as contiguous_slices
from .epoch import rank_batches as rank_batches
from .errors import ReadError, ShippingError
from .loader import ELASTIC_KEYS as ELASTIC_KEYS
from .loader import STATE_VERSION as STATE_VERSION
from .loader import DataLoader
from .loader import config_differences as config_differences
from .read import to_ray_dataset
from .split import StreamingSplit, streaming_split

__all__ = [
    "DataLoader",
    "ReadError",
    "ShippingError",
    "StreamingSplit",
    "base_seed_of",
    "decode",
    "read_task_count",
    "streaming_split",
    "to_ray_dataset",
]

for _name in __all__:  # tracebacks, reprs and pickles name them stoker.ray.X, their public home
    globals()[_name].__module__ = __name__
del _name
