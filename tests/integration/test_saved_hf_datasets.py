"""Hugging Face `datasets` streamed from local files, resumed as with torchdata: an
`IterableDataset` from `load_dataset("parquet" | "json", data_files=..., streaming=True)` over
6 files the test writes, split for rank 1 of 2 with `split_dataset_by_node` (3 files each: one
per worker with 3 workers), read 2 epochs by torchdata 0.11's `StatefulDataLoader` and by
`stoker.torch.StatefulDataLoader` side by side, with 0 and 3 workers, persistent or not, the
dataset told each epoch's number with `set_epoch` as `datasets` asks. A state taken mid-epoch
(after STOP batches) and one taken at the epoch's end, each loaded into a new loader over a new
dataset, continue exactly as the uninterrupted run, through the next epoch, for both loaders;
and stoker's batches are torchdata's, uninterrupted and resumed.

`set_epoch` matters beyond shuffling: a `datasets` IterableDataset resumes every iteration of the
epoch it was given a state for from that state, so without it the epoch after a resume (with 0
or persistent workers, whose replica took the state) starts where the saved one was, with
either loader; and the node's share of the files changes with the epoch.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata", minversion="0.11")
datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")
import pyarrow as pa  # noqa: E402
from datasets.distributed import split_dataset_by_node  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader as TorchdataLoader  # noqa: E402

import stoker.torch as st  # noqa: E402

FILES = 6
ROWS = 4  # a file's rows: ids f * ROWS ... f * ROWS + 3
RANK, WORLD = 1, 2  # this reader's node: files 1, 3, 5
BATCH = 2
STOP = 3  # of an epoch's 6 batches
EPOCHS = 2
FORMATS = ["parquet", "json"]


class Config(NamedTuple):
    workers: int
    persistent: bool

    def __str__(self) -> str:
        return f"{self.workers}-workers{'-persistent' if self.persistent else ''}"


CONFIGS = [Config(0, False), Config(3, False), Config(3, True)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """The same rows as Parquet files and as JSON-lines files."""
    root = tmp_path_factory.mktemp("hf-files")
    written: dict[str, list[str]] = {"parquet": [], "json": []}
    for f in range(FILES):
        ids = list(range(f * ROWS, (f + 1) * ROWS))
        rows = [{"id": i, "text": f"row {i}"} for i in ids]
        parquet = root / f"part-{f}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), parquet)
        jsonl = root / f"part-{f}.jsonl"
        jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
        written["parquet"].append(str(parquet))
        written["json"].append(str(jsonl))
    for fmt in FORMATS:
        # a first load draws `datasets`' progress bars, whose tqdm monitor thread then lives as
        # long as the process: started here, before any test's leak check looks
        next(iter(_dataset(fmt, written)))
    return written


def _dataset(fmt: str, files: dict[str, list[str]]) -> Any:
    streamed = datasets.load_dataset(fmt, data_files={"train": files[fmt]}, split="train", streaming=True)
    return split_dataset_by_node(streamed, rank=RANK, world_size=WORLD)


def _loader(library: str, fmt: str, files: dict[str, list[str]], config: Config) -> Any:
    cls = TorchdataLoader if library == "torchdata" else st.StatefulDataLoader
    return cls(_dataset(fmt, files), batch_size=BATCH, num_workers=config.workers, persistent_workers=config.persistent)


def _ids(batch: dict[str, Any]) -> list[int]:
    assert batch["text"] == [f"row {i}" for i in batch["id"].tolist()]
    return [int(i) for i in batch["id"]]


def _epoch(loader: Any, epoch: int) -> list[list[int]]:
    """One epoch of `loader`, the dataset told its number first, as `datasets` asks."""
    loader.dataset.set_epoch(epoch)
    return [_ids(batch) for batch in loader]


def _runs(library: str, fmt: str, files: dict[str, list[str]], config: Config) -> dict[str, Any]:
    """The uninterrupted run, with a state taken after STOP batches and one at the first epoch's
    end; and new loaders resumed from each."""
    loader = _loader(library, fmt, files, config)
    first: list[list[int]] = []
    mid: dict[str, Any] = {}
    loader.dataset.set_epoch(0)
    for step, batch in enumerate(loader, start=1):
        first.append(_ids(batch))
        if step == STOP:
            mid = loader.state_dict()
    end = loader.state_dict()
    full = [first, _epoch(loader, 1)]
    del loader
    resumed = _loader(library, fmt, files, config)
    resumed.load_state_dict(mid)
    from_mid = [_epoch(resumed, epoch) for epoch in range(EPOCHS)]
    del resumed
    resumed = _loader(library, fmt, files, config)
    resumed.load_state_dict(end)
    from_end = _epoch(resumed, 1)
    return {"full": full, "from_mid": from_mid, "from_end": from_end}


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_streamed_dataset_resumes_exactly(fmt: str, config: Config, files: dict[str, list[str]]) -> None:
    theirs = _runs("torchdata", fmt, files, config)
    ours = _runs("stoker", fmt, files, config)
    full = theirs["full"]
    for epoch, batches in enumerate(full):  # each epoch: the node's share, each item once
        dataset = _dataset(fmt, files)
        dataset.set_epoch(epoch)
        assert sorted(i for batch in batches for i in batch) == sorted(row["id"] for row in dataset), epoch
    assert ours["full"] == full

    assert theirs["from_mid"] == [full[0][STOP:], full[1]] and theirs["from_end"] == full[1]
    assert ours["from_mid"][0] == full[0][STOP:], "stoker: the rest of the interrupted epoch"
    assert ours["from_mid"][1] == full[1], "stoker: the epoch after a mid-epoch resume"
    assert ours["from_end"] == full[1], "stoker: the epoch after an end-of-epoch state"
