"""A loader's whole state saved as users save it, and resumed from the file: `torch.save` then
`torch.load(weights_only=True)` (torch's default) or `weights_only=False`, with tensors inside
(a dataset whose own state holds `torch.get_rng_state()`, a dict with int keys and a tuple),
and `json.dumps` / `json.loads` where every part the dataset returns is JSON. Map-style and
iterable, 0 and 2 workers; torchdata 0.11's `StatefulDataLoader` and
`stoker.torch.StatefulDataLoader` side by side in each test, the same dataset and the same
interruption point (after 4 of an epoch's 6 batches): each resumed run gives exactly the items,
draws and dataset states its own uninterrupted run gives, through the next epoch, and stoker's
items are torchdata's (no shuffle: both orders are the dataset's).

A dataset's `load_state_dict` refuses a state whose types changed on the way (a tensor that
came back as a list, int keys as strings, a tuple as a list): the loader must hand back what
the dataset gave, whatever the file format did not have to convert."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata", minversion="0.11")
import torch.utils.data as tud  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader as TorchdataLoader  # noqa: E402

import stoker.torch as st  # noqa: E402

N = 12  # 6 batches of 2 an epoch; 2 workers make 3 each (iterable: 6 items each)
BATCH = 2
STOP = 4  # batches of epoch 0 before the state is saved
EPOCHS = 2
FORMATS = ["weights_only", "pickle", "json"]
LIBRARIES = ["torchdata", "stoker"]

Row = tuple[int, int, int]  # (item, its draw, items its replica had made by then)


def _worker() -> tuple[int, int]:
    """(worker id, number of workers) of whichever loader runs us; (0, 1) in process."""
    info = tud.get_worker_info() or st.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def _require(value: Any, kind: type, what: str) -> Any:
    if type(value) is not kind:
        raise TypeError(f"{what}: saved as {kind.__name__}, came back as {type(value).__name__}")
    return value


class _Drawing:
    """Items that draw from torch's global RNG and count what this replica made.

    Its state: torch's RNG state, the counts per `i % 3` and the last item. With
    `json_state=False` as Python keeps them (a uint8 tensor, int keys, a tuple); with
    `json_state=True` as JSON keeps them (a list of ints, str keys, a list)."""

    def __init__(self, json_state: bool = False) -> None:
        self.json_state = json_state
        self.counts: dict[int, int] = {}
        self.last: tuple[int, int] = (-1, -1)

    def _item(self, i: int) -> dict[str, int]:
        draw = int(torch.randint(1 << 30, ()).item())
        self.counts[i % 3] = self.counts.get(i % 3, 0) + 1
        self.last = (i, draw)
        return {"i": i, "draw": draw, "served": sum(self.counts.values())}

    def _own_state(self) -> dict[str, Any]:
        if self.json_state:
            return {
                "rng": torch.get_rng_state().tolist(),
                "counts": {str(k): v for k, v in self.counts.items()},
                "last": list(self.last),
            }
        return {"rng": torch.get_rng_state(), "counts": dict(self.counts), "last": self.last}

    def _load_own(self, state: dict[str, Any]) -> None:
        if self.json_state:
            rng = torch.tensor(_require(state["rng"], list, "the RNG state"), dtype=torch.uint8)
            counts = {int(_require(k, str, "a count's key")): v for k, v in state["counts"].items()}
            last = tuple(_require(state["last"], list, "the last item"))
        else:
            rng = _require(state["rng"], torch.Tensor, "the RNG state")
            counts = {_require(k, int, "a count's key"): v for k, v in state["counts"].items()}
            last = _require(state["last"], tuple, "the last item")
        torch.set_rng_state(rng)
        self.counts = counts
        self.last = last  # type: ignore[assignment]


class DrawingMap(_Drawing, tud.Dataset):
    """Map-style: item i, drawn in the replica that fetches it."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, int]:
        return self._item(i)

    def state_dict(self) -> dict[str, Any]:
        return self._own_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_own(state)


class DrawingStream(_Drawing, tud.IterableDataset):
    """Iterable: the replica in worker w of n yields w, w + n, ... and keeps its position."""

    def __init__(self, json_state: bool = False) -> None:
        super().__init__(json_state)
        self.position = 0

    def __iter__(self) -> Iterator[dict[str, int]]:
        first, step = _worker()
        mine = list(range(first, N, step))
        while self.position < len(mine):
            self.position += 1
            yield self._item(mine[self.position - 1])
        self.position = 0  # the next epoch starts over

    def state_dict(self) -> dict[str, Any]:
        return {**self._own_state(), "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_own(state)
        self.position = _require(state["position"], int, "the position")


KINDS: dict[str, Callable[[bool], Any]] = {"map": DrawingMap, "iterable": DrawingStream}


def _loader(library: str, kind: str, workers: int, fmt: str) -> Any:
    cls = TorchdataLoader if library == "torchdata" else st.StatefulDataLoader
    dataset = KINDS[kind](fmt == "json")
    # a generator: the workers' base seeds come from it, the same in every run
    return cls(dataset, batch_size=BATCH, num_workers=workers, generator=torch.Generator().manual_seed(7))


def _rows(batch: dict[str, Any]) -> list[Row]:
    return [(int(i), int(d), int(s)) for i, d, s in zip(batch["i"], batch["draw"], batch["served"])]


def _save(state: dict[str, Any], fmt: str, path: Path) -> None:
    if fmt == "json":
        path.write_text(json.dumps(state))
    else:
        torch.save(state, path)


def _load(fmt: str, path: Path) -> dict[str, Any]:
    if fmt == "json":
        return json.loads(path.read_text())
    return torch.load(path, weights_only=fmt == "weights_only")


def _close(iterator: Any) -> None:
    """Stop an iterator's workers now (stoker's `close`, torch's `_shutdown_workers`)."""
    stop = getattr(iterator, "close", None) or getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


def _run(library: str, kind: str, workers: int, fmt: str, path: Path) -> dict[str, Any]:
    """The uninterrupted run (2 epochs); the run stopped after STOP batches, its state saved to
    `path`; and a new loader resumed from the file (the rest of that epoch, then the next)."""
    torch.manual_seed(0)
    loader = _loader(library, kind, workers, fmt)
    full = [[_rows(batch) for batch in loader] for _ in range(EPOCHS)]
    del loader

    torch.manual_seed(0)
    stopped = _loader(library, kind, workers, fmt)
    iterator = iter(stopped)
    head = [_rows(next(iterator)) for _ in range(STOP)]
    _save(stopped.state_dict(), fmt, path)
    _close(iterator)
    del iterator, stopped

    torch.manual_seed(1)  # a new process: its global RNG is not the first run's
    resumed = _loader(library, kind, workers, fmt)
    resumed.load_state_dict(_load(fmt, path))
    rest = [[_rows(batch) for batch in resumed] for _ in range(EPOCHS)]
    return {"full": full, "head": head, "rest": rest}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_saved_state_resumes_exactly(kind: str, workers: int, fmt: str, tmp_path: Path) -> None:
    with torch.random.fork_rng(devices=[]):  # the runs seed torch's global RNG: the test's is kept
        runs = {library: _run(library, kind, workers, fmt, tmp_path / f"{library}.state") for library in LIBRARIES}
    for library, run in runs.items():
        full, head, rest = run["full"], run["head"], run["rest"]
        assert [len(epoch) for epoch in full] == [N // BATCH] * EPOCHS, library
        assert head == full[0][:STOP], library
        assert rest[0] == full[0][STOP:], f"{library}: the rest of the interrupted epoch"
        assert rest[1] == full[1], f"{library}: the epoch after"
    ours, theirs = runs["stoker"], runs["torchdata"]
    items = [[[row[0] for row in batch] for batch in epoch] for epoch in theirs["full"]]
    assert [[[row[0] for row in batch] for batch in epoch] for epoch in ours["full"]] == items
    assert [[row[0] for row in batch] for batch in ours["rest"][0]] == items[0][STOP:]
