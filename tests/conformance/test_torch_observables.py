"""What a torch user observes beyond the batches, through `torch.utils.data` and `stoker.torch`
side by side: `get_worker_info()`'s fields, the warning of a stream longer than its reported
length (its words, and when it is given), the iterator's `_workers` (torch's private list of
worker processes, which torch's own clean-exit tests and some users read), the class `a + b`
makes, and `shuffle` handed to an IterDataPipe."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.utils.data as tud  # noqa: E402
from torch.utils.data._utils.worker import _generate_state  # noqa: E402

import stoker.torch as st  # noqa: E402

JOIN_S = 30.0


class Fields(tud.Dataset):
    """Each sample is what get_worker_info() says inside the worker that fetched it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = tud.get_worker_info()
        ours = st.get_worker_info()
        return {
            "method": info.worker_method,
            "rng_none": info.rng is None,
            "ours_method": ours.worker_method if ours is not None else "no stoker worker",
            "ours_rng_none": ours.rng is None if ours is not None else "no stoker worker",
        }


def _fields(loader: Any) -> set[tuple[Any, ...]]:
    return {tuple(_plain(b[k][0]) for k in ("method", "rng_none", "ours_method", "ours_rng_none")) for b in loader}


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def test_worker_info_has_torchs_rng_and_worker_method_in_process_workers() -> None:
    theirs = _fields(tud.DataLoader(Fields(), num_workers=2))
    ours = _fields(st.DataLoader(Fields(), num_workers=2))
    assert theirs == {("multiprocessing", True, "no stoker worker", "no stoker worker")}
    assert ours == {("multiprocessing", True, "multiprocessing", True)}  # torch's record and stoker's agree


class ThreadDraws(tud.Dataset):
    """Draws from the thread worker's own generators, and checks torch's helper finds them."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> list[float]:
        info = st.get_worker_info()
        assert info is not None and info.worker_method == "thread" and info.rng is not None
        assert torch.thread_safe_generator() is info.rng.torch_generator  # torch's own helper
        base_seed = info.seed - info.id
        fresh = np.random.default_rng(_generate_state(base_seed, info.id))  # as torch seeds a thread worker's
        return [
            float(info.rng.random_generator.random() == random.Random(info.seed).random()),
            float(info.rng.numpy_generator.random() == fresh.random()),
            float(
                torch.rand(1, generator=info.rng.torch_generator).item()
                == torch.rand(1, generator=torch.Generator().manual_seed(info.seed)).item()
            ),
        ]


def test_thread_workers_have_their_own_seeded_generators() -> None:
    # batch_size=None: one sample per batch, so each draw is a worker's first from fresh generators
    loader = st.DataLoader(ThreadDraws(), batch_size=None, num_workers=2, thread_pool=True, sampler=[0, 1])
    assert [list(map(float, b)) for b in loader] == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]


def test_the_numpy_flavour_worker_info_has_the_fields_without_torch() -> None:
    code = (
        "import sys, stoker\n"
        "class D(stoker.Dataset):\n"
        "    def __len__(self): return 2\n"
        "    def __getitem__(self, i):\n"
        "        w = stoker.get_worker_info()\n"
        "        return w.worker_method + ' ' + type(w.rng).__name__ + ' ' + type(w.rng and w.rng.numpy_generator).__name__\n"
        "rows = list(stoker.DataLoader(D(), batch_size=None, num_workers=1, thread_pool=True))\n"
        "assert rows == ['thread WorkerRNG Generator'] * 2, rows\n"
        "rows = list(stoker.DataLoader(D(), batch_size=None, num_workers=1))\n"
        "assert rows == ['multiprocessing NoneType NoneType'] * 2, rows\n"
        "assert 'torch' not in sys.modules, 'stoker imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------ length warning
class Unsharded(tud.IterableDataset):
    """A stream that reports 3 items and, unsharded, yields 6 per worker."""

    def __iter__(self) -> Any:
        return iter(range(6))

    def __len__(self) -> int:
        return 3

    def __repr__(self) -> str:
        return "Unsharded()"


def _length_warnings(mod: Any, persistent: bool, len_first: bool, batch_size: int) -> list[tuple[int, str]]:
    """(epoch * 100 + batch, message) of each length warning over two epochs; `len_first`:
    len(loader) is read before the first iter(), else between the first and second epochs."""
    loader = mod.DataLoader(Unsharded(), batch_size=batch_size, num_workers=2, persistent_workers=persistent)
    if len_first:
        len(loader)
    seen: list[tuple[int, str]] = []
    for epoch in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch, _ in enumerate(loader):
                seen += [(epoch * 100 + batch, str(w.message)) for w in caught if "IterableDataset" in str(w.message)]
                caught.clear()
        if not len_first and epoch == 0:
            len(loader)
    return seen


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("len_first", [True, False], ids=["len-then-iter", "iter-then-len"])
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_length_warning_is_torchs_in_words_and_timing(persistent: bool, len_first: bool, batch_size: int) -> None:
    theirs = _length_warnings(tud, persistent, len_first, batch_size)
    ours = _length_warnings(st, persistent, len_first, batch_size)
    assert theirs  # the configurations do warn under torch
    assert ours == theirs


# ------------------------------------------------------------------ _workers
class Numbers(tud.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return i


def test_workers_are_torchs_list_of_worker_processes(no_leaks: Any) -> None:
    it = iter(st.DataLoader(Numbers(), batch_size=2, num_workers=3))
    workers = it._workers
    assert [w.pid for w in workers] == [it._engine.pid(i) for i in range(3)]
    assert all(w.is_alive() and w.exitcode is None for w in workers)
    assert len({w.pid for w in workers}) == 3 and os.getpid() not in {w.pid for w in workers}
    for i, _ in enumerate(it):
        if i == 5:
            break
    del it  # dropped half-way: the workers stop on their own
    for w in workers:
        w.join(JOIN_S)
        assert not w.is_alive() and w.exitcode == 0
        w.terminate()  # as torch's tests do after join: a no-op on an ended worker


def test_workers_after_the_epoch_still_answer(no_leaks: Any) -> None:
    it = iter(st.DataLoader(Numbers(), batch_size=8, num_workers=2))
    assert len(list(it)) == 8
    workers = it._workers  # read after the workers stopped, as torch's test_get_worker_info does
    assert len(workers) == 2 and all(w.pid is not None for w in workers)
    assert [w.exitcode for w in workers] == [0, 0] and not any(w.is_alive() for w in workers)
    assert iter(st.DataLoader(Numbers(), batch_size=8))._workers == []
    assert iter(st.DataLoader(Numbers(), batch_size=8, num_workers=2, thread_pool=True))._workers == []


KILLED_WORKER = """
import os, signal, sys, time
import torch.utils.data as tud
import stoker.torch as st

class Slow(tud.Dataset):
    def __len__(self): return 40
    def __getitem__(self, i):
        time.sleep(0.02)
        return i

it = iter(st.DataLoader(Slow(), batch_size=2, num_workers=2))
workers = it._workers
next(it)
os.kill(workers[1].pid, signal.SIGKILL)
try:
    for _ in it:
        pass
except RuntimeError as exc:
    assert "DataLoader worker" in str(exc) and str(workers[1].pid) in str(exc), exc
else:
    sys.exit("no error for the killed worker")
for w in workers:
    w.join(30)
assert not any(w.is_alive() for w in workers)
assert workers[1].exitcode == -signal.SIGKILL, workers[1].exitcode
assert workers[0].exitcode == 0, workers[0].exitcode
print("ok")
"""


def test_workers_show_a_killed_worker_and_a_clean_exit_of_the_rest() -> None:
    done = subprocess.run([sys.executable, "-c", KILLED_WORKER], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# ----------------------------------------------------------------- a + b
class Squares(st.Dataset):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> int:
        return i * i


class Stream(st.IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(2))


def test_a_plus_b_is_the_exported_concat_and_chain_dataset() -> None:
    both = Squares() + Squares()
    assert isinstance(both, st.ConcatDataset) and type(both) is tud.ConcatDataset
    assert [int(x) for x in st.DataLoader(both, batch_size=None)] == [0, 1, 4, 0, 1, 4]
    chained = Stream() + Stream()
    assert isinstance(chained, st.ChainDataset)
    assert isinstance(st.TensorDataset(torch.arange(2)) + Squares(), st.ConcatDataset)
    with pytest.raises(AssertionError, match="does not support IterableDataset"):
        st.ConcatDataset([Squares(), Stream()])  # torch's own check, and torch's words


# --------------------------------------------------------------- IterDataPipe
def _pipe() -> Any:
    from torch.utils.data.datapipes.iter import IterableWrapper

    return IterableWrapper(range(20)).shuffle(buffer_size=20)


def test_shuffle_reaches_an_iterdatapipes_shuffler_as_in_torch() -> None:
    assert list(tud.DataLoader(_pipe(), shuffle=False, batch_size=None)) == list(range(20))
    assert list(st.DataLoader(_pipe(), shuffle=False, batch_size=None)) == list(range(20))
    torch.manual_seed(0)
    drawn = list(st.DataLoader(_pipe(), shuffle=True, batch_size=None))
    assert sorted(drawn) == list(range(20)) and drawn != list(range(20))
    with pytest.raises(ValueError, match=re.escape("expected unspecified shuffle option, but got shuffle=True")):
        st.DataLoader(Stream(), shuffle=True)  # other streams still refuse it, as torch's do
