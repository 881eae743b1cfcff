"""torch DataPipes through `torch.utils.data.DataLoader` and `stoker.torch.DataLoader` side by
side: the same items in the same order for the same seed.

torch's loader gives an IterDataPipe a shared seed drawn from its generator (torch's global
RNG without one) at every epoch, applies it to the pipe's random stages in every worker, and
shards the pipe's `sharding_filter` per worker. Each test runs torch's loader and stoker's on
fresh copies of the same pipe from the same seed and compares the output lists: epochs, a
re-seeded epoch, and where the global RNG is left afterwards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.utils.data as tud  # noqa: E402
from torch.utils.data.datapipes.iter import IterableWrapper  # noqa: E402

import stoker  # noqa: E402
import stoker.torch as st  # noqa: E402

# torch's and stoker's warning of more workers than CPUs, on a small machine
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N = 100
WAIT_S = 60  # the loaders' own timeout: a hang fails the test instead of stalling the run


def _pipe(n: int = N) -> Any:
    return IterableWrapper(range(n)).shuffle(buffer_size=5).sharding_filter()


def _items(batch: Any) -> list[int]:
    if isinstance(batch, torch.Tensor):
        return [int(x) for x in batch.reshape(-1)]
    return [int(batch)]


def _epochs(loader_cls: type, num_workers: int, *, seed: int = 7, epochs: int = 2, **kwargs: Any) -> list[Any]:
    """Each epoch's items, one more epoch after re-seeding, and the next draw of torch's global
    RNG (where the loader left it)."""
    if num_workers:
        kwargs.setdefault("timeout", WAIT_S)
    generator = kwargs.pop("generator_seed", None)
    if generator is not None:
        kwargs["generator"] = torch.Generator().manual_seed(generator)
    torch.manual_seed(seed)
    loader = loader_cls(_pipe(), num_workers=num_workers, **kwargs)
    out: list[Any] = [[x for b in loader for x in _items(b)] for _ in range(epochs)]
    torch.manual_seed(seed)
    out.append([x for b in loader for x in _items(b)])
    out.append(torch.rand(3).tolist())
    return out


CASES = [(0, False)] + [(n, p) for n in (1, 2, 3) for p in (False, True)]


@pytest.mark.parametrize("generator_seed", [None, 3], ids=["global-rng", "generator"])
@pytest.mark.parametrize(
    ("num_workers", "persistent"),
    CASES,
    ids=[f"w{n}{'-persistent' if p else ''}" for n, p in CASES],
)
def test_the_same_order_as_torch_for_the_same_seed(
    num_workers: int, persistent: bool, generator_seed: int | None
) -> None:
    kwargs: dict[str, Any] = {"batch_size": None, "generator_seed": generator_seed}
    if persistent:
        kwargs["persistent_workers"] = True
    theirs = _epochs(tud.DataLoader, num_workers, **kwargs)
    ours = _epochs(st.DataLoader, num_workers, **kwargs)
    assert ours == theirs
    for epoch in ours[:-1]:  # every item once per epoch: each worker keeps its own share
        assert sorted(epoch) == list(range(N))
    assert ours[0] != ours[1]  # a new shared seed each epoch
    if generator_seed is None:  # the first again after the same torch.manual_seed
        assert ours[0] == ours[2]
    else:  # the generator goes on
        assert ours[2] not in (ours[0], ours[1])


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_given_to_the_loader_as_in_torch(num_workers: int, shuffle: bool) -> None:
    theirs = _epochs(tud.DataLoader, num_workers, batch_size=4, shuffle=shuffle)
    ours = _epochs(st.DataLoader, num_workers, batch_size=4, shuffle=shuffle)
    assert ours == theirs
    assert (ours[0] != sorted(ours[0])) is shuffle or num_workers > 0  # workers interleave shares


def test_thread_workers_read_the_pipe_as_torchs_processes_do() -> None:
    # torch has no thread workers: each of stoker's keeps a copy of the pipe, as a process does
    theirs = _epochs(tud.DataLoader, 2, batch_size=4, persistent_workers=True)
    ours = _epochs(st.DataLoader, 2, batch_size=4, persistent_workers=True, thread_pool=True)
    assert ours == theirs


def test_forkserver_workers_as_torchs() -> None:
    theirs = _epochs(tud.DataLoader, 2, batch_size=4, multiprocessing_context="forkserver")
    ours = _epochs(st.DataLoader, 2, batch_size=4, multiprocessing_context="forkserver")
    assert ours == theirs


@pytest.mark.parametrize("persistent", [False, True])
def test_half_an_epoch_then_the_next_as_in_torch(persistent: bool) -> None:
    def run(loader_cls: type) -> list[Any]:
        torch.manual_seed(11)
        loader = loader_cls(_pipe(), num_workers=2, batch_size=4, persistent_workers=persistent, timeout=WAIT_S)
        first = iter(loader)
        half = [x for _ in range(6) for x in _items(next(first))]
        del first
        whole = [x for b in loader for x in _items(b)]
        return [half, whole, torch.rand(2).tolist()]

    theirs, ours = run(tud.DataLoader), run(st.DataLoader)
    assert ours == theirs
    assert sorted(ours[1]) == list(range(N))  # nothing of the abandoned epoch, nothing twice


def test_a_persistent_iterator_shut_down_as_torchs_tests_do() -> None:
    # torch's own tests stop a persistent loader's workers through its private iterator
    def run(loader_cls: type) -> list[Any]:
        torch.manual_seed(5)
        loader = loader_cls(_pipe(), num_workers=2, batch_size=4, persistent_workers=True, timeout=WAIT_S)
        out = [[x for b in loader for x in _items(b)]]
        loader._iterator._shutdown_workers()
        loader._iterator = None
        out.append([x for b in loader for x in _items(b)])
        return out

    theirs, ours = run(tud.DataLoader), run(st.DataLoader)
    assert ours == theirs


def _fails_at_seven(x: int) -> int:
    if x == 7:
        raise ValueError(f"item {x} is bad")
    return x


def test_an_error_inside_a_pipe_reaches_the_main_process_naming_its_worker() -> None:
    pipe = IterableWrapper(range(20)).sharding_filter().map(_fails_at_seven)
    loader = st.DataLoader(pipe, num_workers=2, batch_size=2, timeout=WAIT_S)
    # item 7 is worker 1's (odd items), in its second batch: batch 3 of the epoch
    with pytest.raises(ValueError, match=re.escape("item 7 is bad")) as raised:
        list(loader)
    assert "DataLoader worker 1 " in str(raised.value)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pipe_sharded_twice_is_refused_as_torch_refuses_it(num_workers: int) -> None:
    def twice() -> Any:
        return IterableWrapper(range(10)).sharding_filter().sharding_filter()

    timeout = WAIT_S if num_workers else 0
    for loader_cls in (tud.DataLoader, st.DataLoader):
        loader = loader_cls(twice(), num_workers=num_workers, timeout=timeout)
        with pytest.raises(RuntimeError, match="Sharding twice on a single pipeline"):
            list(loader)


class _Locked(tud.IterDataPipe):
    """A pipe holding a lock: it cannot be copied."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __iter__(self) -> Any:
        return iter(range(8))


def test_a_pipe_a_thread_worker_cannot_copy_is_reported_at_its_first_batch() -> None:
    loader = st.DataLoader(_Locked(), num_workers=2, thread_pool=True, timeout=WAIT_S)
    with pytest.raises(TypeError, match="lock") as raised:
        list(loader)
    assert "copying its DataPipe" in str(raised.value)


def test_two_training_ranks_share_rank_0s_seed_and_split_the_pipe_as_torch(tmp_path: Path) -> None:
    # each rank seeds torch differently; torch broadcasts rank 0's shared seed, so the ranks
    # shuffle alike and their workers' shares split one order
    script = Path(__file__).with_name("datapipe_ranks.py")
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for rank in ranks:
        assert rank["stoker"] == rank["torch"]
    for epoch in range(2):
        assert sorted(ranks[0]["stoker"][epoch] + ranks[1]["stoker"][epoch]) == list(range(60))


def test_stokers_own_loader_shards_a_pipe_per_worker() -> None:
    # stoker.DataLoader (numpy batches) draws the seeds from numpy: other orders than torch's,
    # the same share per worker
    for num_workers in (0, 2):
        loader = stoker.DataLoader(
            _pipe(), num_workers=num_workers, batch_size=None, timeout=WAIT_S if num_workers else 0
        )
        for _ in range(2):
            assert sorted(int(x) for x in loader) == list(range(N))
