"""The streaming libraries users load with torch's DataLoader, loaded by stoker.torch's: litdata's
`StreamingDataset` (whose `state_dict` takes the loader's counts: never called), a Hugging Face
`datasets` IterableDataset shuffled with a seed and moved on with `set_epoch(e)` before each
epoch (Stateful: its state travels with each batch), and WebDataset over tar shards. Each is
written locally with the library's own writer (nothing downloaded), and read at num_workers 0
and 2, persistent or not, under fork and spawn: every item once per epoch, and the batches
torch's DataLoader gives on the same dataset.

MosaicML Streaming 0.13 (the newest) is not here: it imports torchvision when it is imported,
and the only torchvision wheels for torch 2.13 are CUDA builds that cannot load beside the CPU
build the tests pin; it also pins numpy<2.2 and transformers<5 (so huggingface-hub<1.0, which
datasets 5 refuses). Its argument-taking `state_dict(num_samples, from_beginning)` is covered by
tests/unit/test_stateful.py and tests/integration/test_stateful_datasets.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

pytest.importorskip("torch")
import torch.utils.data as tud

import stoker.torch as st

N = 24  # items in each dataset
BATCH = 4
SHARDS = 4  # chunks / shards / HF shards: two for each of two workers
EPOCHS = 2


class Case(NamedTuple):
    workers: int
    persistent: bool
    context: str | None

    def __str__(self) -> str:
        if not self.workers:
            return "inline"
        return f"{self.context}-{'persistent' if self.persistent else 'fresh'}"


# Under spawn the dataset reaches each worker pickled; a persistent loader does that once for
# both epochs, a fresh one again per epoch (the same path, at several seconds per start here).
CASES = [
    Case(0, False, None),
    Case(2, False, "fork"),
    Case(2, True, "fork"),
    Case(2, True, "spawn"),
]


# --------------------------------------------------------------- the datasets
def _litdata(root: Path) -> Callable[[], Any]:
    litdata = pytest.importorskip("litdata")
    from litdata.streaming.writer import BinaryWriter

    out = root / "litdata"
    writer = BinaryWriter(str(out), chunk_size=N // SHARDS)
    for i in range(N):
        writer.add_item(i, {"index": i, "x": np.full(3, i, dtype=np.float32)})
    writer.done()
    writer.merge()
    return lambda: litdata.StreamingDataset(str(out), shuffle=True, seed=7)


def _huggingface(root: Path) -> Callable[[], Any]:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"index": list(range(N)), "x": [[float(i)] * 3 for i in range(N)]})
    table.save_to_disk(str(root / "hf"), num_shards=SHARDS)

    def make() -> Any:
        loaded = datasets.load_from_disk(str(root / "hf"))
        return loaded.to_iterable_dataset(num_shards=SHARDS).shuffle(seed=11, buffer_size=8).with_format("numpy")

    return make


def _webdataset(root: Path) -> Callable[[], Any]:
    wds = pytest.importorskip("webdataset")
    urls = []
    for shard in range(SHARDS):
        url = str(root / f"shard-{shard}.tar")
        with wds.TarWriter(url) as writer:
            for i in range(shard * N // SHARDS, (shard + 1) * N // SHARDS):
                writer.write({"__key__": f"{i:04d}", "index.cls": i, "x.npy": np.full(3, i, dtype=np.float32)})
        urls.append(url)
    return lambda: (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode().rename(index="index.cls", x="x.npy")
    )


LIBRARIES = {"litdata": _litdata, "huggingface": _huggingface, "webdataset": _webdataset}


@pytest.fixture(scope="module")
def makers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Callable[[], Any] | str]:
    """Each library's dataset written once, before the tests' leak checks begin (a writer may
    leave a thread of its own, such as tqdm's monitor): a maker of fresh dataset objects, or
    why the library cannot be tested (it is not installed)."""
    made: dict[str, Callable[[], Any] | str] = {}
    for name, write in LIBRARIES.items():
        try:
            made[name] = write(tmp_path_factory.mktemp(name))
        except pytest.skip.Exception as absent:
            made[name] = str(absent)
    return made


# ------------------------------------------------------------------- running
def _epochs(loader_class: type, dataset: Any, case: Case) -> list[list[list[int]]]:
    """Each epoch's batches (their items' indices), as a training loop reads them: a dataset
    with set_epoch is told the epoch before iter()."""
    kwargs: dict[str, Any] = {"batch_size": BATCH, "num_workers": case.workers}
    if case.workers:
        kwargs.update(persistent_workers=case.persistent, multiprocessing_context=case.context)
    loader = loader_class(dataset, **kwargs)
    epochs = []
    for epoch in range(EPOCHS):
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        epochs.append([[int(i) for i in batch["index"]] for batch in loader])
    return epochs


_REFERENCES: dict[tuple[str, int, bool], list[list[list[int]]]] = {}


def _torchs(library: str, make: Callable[[], Any], case: Case) -> list[list[list[int]]]:
    """torch's DataLoader's epochs at this worker count and persistence. Its order does not
    depend on the start method, so it runs under fork (a spawn case is compared with it)."""
    key = (library, case.workers, case.persistent)
    if key not in _REFERENCES:
        reference = Case(case.workers, case.persistent, "fork" if case.workers else None)
        _REFERENCES[key] = _epochs(tud.DataLoader, make(), reference)
    return _REFERENCES[key]


PARAMS = [pytest.param(library, case, id=f"{library}-{case}") for library in sorted(LIBRARIES) for case in CASES]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("library", "case"), PARAMS)
def test_stoker_gives_torchs_batches_with_each_item_once_per_epoch(
    library: str, case: Case, makers: dict[str, Callable[[], Any] | str]
) -> None:
    make = makers[library]
    if isinstance(make, str):
        pytest.skip(make)
    expected = _torchs(library, make, case)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning per batch (or at all) from stoker
        warnings.filterwarnings("ignore", message=".*NumPy array is not writable.*")  # torch's collate
        got = _epochs(st.DataLoader, make(), case)
    for epoch in got:
        assert sorted(i for batch in epoch for i in batch) == list(range(N))
    assert got == expected
    if library == "huggingface":  # set_epoch reshuffles: each epoch's order is its own
        assert got[0] != got[1]
