"""Run by test_fork_threads.py in a fresh interpreter (no pytest, no timeout or faulthandler
thread): loaders with fork workers over a numpy dataset and over shards in a local folder,
two epochs each, persistent and not, with stats and the progress bar on. At every fork this
process makes, records the Python threads other than the main one; records every
DeprecationWarning that says a fork happened in a multi-threaded process (Python 3.12+).
Prints one line, `RESULT <json>`.

    python fork_threads_child.py <scratch folder> [control]

`control`: starts a thread of its own before the loaders, to show that both records see it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from typing import Any

forks: list[list[str]] = []


def _record_threads() -> None:
    forks.append(sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()))


# Registered before stoker is imported: `before` hooks run in the reverse order of
# registration, so this one runs last, after stoker's own, just before the fork itself.
os.register_at_fork(before=_record_threads)

import numpy as np  # noqa: E402

import stoker  # noqa: E402
from stoker.shards import ShardedDataset, ShardedSampler, write_shards  # noqa: E402

N = 48


class Rows(stoker.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(4, index, dtype=np.int64)


def _progress() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def _numbers(loader: Any) -> list[list[int]]:
    epochs = []
    for _ in range(2):
        seen = []
        for batch in loader:
            seen += [int(key) for key in batch["__key__"]] if isinstance(batch, dict) else batch[:, 0].tolist()
        epochs.append(sorted(seen))
    return epochs


def main(scratch: str, control: bool) -> dict[str, Any]:
    stop = threading.Event()
    own = threading.Thread(target=stop.wait, name="the-users-thread", daemon=True)
    if control:
        own.start()
    out: dict[str, Any] = {"epochs": []}
    progress = _progress()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for persistent in (False, True):
            loader = stoker.DataLoader(
                Rows(),
                batch_size=8,
                shuffle=True,
                num_workers=2,
                multiprocessing_context="fork",
                persistent_workers=persistent,
                stats=True,
                progress=progress,
                generator=0,
            )
            out["epochs"].append(_numbers(loader))
            del loader
        url = os.path.join(scratch, "shards")
        write_shards(({"row.npy": np.full(4, i)} for i in range(N)), url, shard_bytes=2048)  # keys 0..N-1
        data = ShardedDataset(url, cache_dir=os.path.join(scratch, "cache"))
        for persistent in (False, True):
            loader = stoker.DataLoader(
                data,
                batch_size=8,
                sampler=ShardedSampler(data, seed=0),
                num_workers=2,
                multiprocessing_context="fork",
                persistent_workers=persistent,
                stats=True,
                progress=progress,
            )
            out["epochs"].append(_numbers(loader))
            del loader
    stop.set()
    out["forks"] = forks
    out["fork_warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and "fork()" in str(w.message)
    ]
    out["progress"] = progress
    return out


if __name__ == "__main__":
    result = main(sys.argv[1], control=sys.argv[2:] == ["control"])
    print("RESULT " + json.dumps(result), flush=True)
