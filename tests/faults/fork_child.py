"""Child-process side of test_forked_children: `python fork_child.py SCENARIO METHOD`.

A process forked from the one running a stoker loader must leave that loader alone, however
the fork ends. Each scenario runs a persistent loader (two workers started with METHOD) and
forks from its process mid-epoch; the parent then finishes the epoch and the next one and
prints one `RESULT <json>` line: the samples each epoch gave, how each forked child ended,
and what was left behind once the loader was dropped. Whatever a child prints goes to the
same stderr, which the test reads.

Scenarios:
    os_fork       os.fork() five times in one epoch; the children end by falling off the end
                  of this script (a normal interpreter exit: finalizers and atexit hooks run),
                  by an uncaught exception, by SIGTERM and by SIGKILL; the fifth iterates the
                  loader it inherited (an epoch of its own, on workers and shared memory of
                  its own) while the parent finishes its epoch, and exits with status 0 if
                  its epoch had every sample once. The parent keeps every batch until the
                  end and the children drop their copies at once: a shared-memory slot that
                  a child reused would show in the parent's batches.
    mp_fork       multiprocessing fork children that collect garbage and return normally,
                  while a failed stoker iterator is garbage not yet collected.
    torch_fork    torch.utils.data.DataLoader fork workers, likewise.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the repo root: tests.support
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scenario import _prestart
from tests.support.leakcheck import Snapshot

import stoker

SAMPLES = 40
BATCH = 2
ENDINGS = ("exit", "raise", "sigterm", "sigkill", "iterate")


MAIN_PID = "FORK_CHILD_MAIN_PID"  # set by the first process: its workers' parent
CHILDS = 1000  # added to the samples made by the workers of a forked child


class Indices(stoker.Dataset):
    """Sample i is 256 copies of i (batches large enough for the shared-memory slots), or of
    CHILDS + i when a forked child's worker makes it; a little slow, so that the workers are
    busy when the fork happens."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> np.ndarray:
        time.sleep(0.002)
        mine = str(os.getppid()) == os.environ[MAIN_PID]
        return np.full(256, i if mine else CHILDS + i, np.int64)


class FailsAtThree(stoker.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 3:
            raise ValueError("sample 3 is broken")
        return np.int64(i)


class Collects:
    """A torch dataset whose samples run the garbage collector, as any allocation may."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        gc.collect()
        return i


def samples(batches: list[Any]) -> list[int]:
    """The samples' indices, sorted; each sample must still be 256 copies of its index."""
    rows = [np.asarray(row) for batch in batches for row in np.asarray(batch)]
    return sorted(int(row[0]) if (row == row[0]).all() else -1 for row in rows)


def loader(method: str) -> stoker.DataLoader:
    return stoker.DataLoader(
        Indices(), batch_size=BATCH, num_workers=2, persistent_workers=True, multiprocessing_context=method
    )


def ending_child(ending: str, the_loader: stoker.DataLoader) -> None:
    """In a forked child: end as `ending` says. Returns only for "exit" (the caller then
    falls off the end of the script)."""
    if ending == "iterate":
        own = samples(list(iter(the_loader)))
        sys.exit(0 if own == [CHILDS + i for i in range(SAMPLES)] else 3)
    if ending == "raise":
        raise RuntimeError("the forked child fails")
    if ending in ("sigterm", "sigkill"):
        os.kill(os.getpid(), signal.SIGTERM if ending == "sigterm" else signal.SIGKILL)
        time.sleep(30)


def how_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return f"exit {os.WEXITSTATUS(status)}"


def os_fork(method: str) -> dict[str, Any] | None:
    """None in a forked child (which then ends), the result in the parent."""
    the_loader = loader(method)
    it = iter(the_loader)
    first: list[Any] = []
    children: dict[str, str] = {}
    for ending in ENDINGS:
        first += [next(it) for _ in range(3)]
        pid = os.fork()
        if pid == 0:
            del first, it  # the parent's batches and iterator are of no use here
            ending_child(ending, the_loader)
            return None
        if ending != "iterate":
            _, status = os.waitpid(pid, 0)
            children[ending] = how_ended(status)
    first += list(it)
    _, status = os.waitpid(pid, 0)  # the one that iterates, meanwhile
    children["iterate"] = how_ended(status)
    second = list(iter(the_loader))
    return {"epochs": [samples(first), samples(second)], "children": children}


def _collect() -> None:
    gc.collect()


def fail_and_drop(method: str) -> None:
    """Leave a failed stoker iterator as garbage: its exception's traceback holds this frame,
    which holds the iterator, which holds the exception."""
    it = iter(stoker.DataLoader(FailsAtThree(), num_workers=2, multiprocessing_context=method))
    try:
        list(it)
    except ValueError:
        pass


def forked_after_failure(method: str, scenario: str) -> dict[str, Any]:
    the_loader = loader(method)
    it = iter(the_loader)
    first = [next(it) for _ in range(3)]
    gc.disable()  # the failed iterator must still be garbage when the children are forked
    fail_and_drop(method)
    children: dict[str, str] = {}
    if scenario == "mp_fork":
        context = multiprocessing.get_context("fork")
        for n in range(2):
            child = context.Process(target=_collect)
            child.start()
            child.join(30)
            children[str(n)] = f"exit {child.exitcode}"
    else:
        import torch.utils.data

        torch_loader = torch.utils.data.DataLoader(
            Collects(), batch_size=2, num_workers=2, multiprocessing_context="fork"
        )
        children["torch"] = f"batches {len(list(torch_loader))}"
    gc.enable()
    first += list(it)
    second = list(iter(the_loader))
    return {"epochs": [samples(first), samples(second)], "children": children}


def main() -> None:
    scenario, method = sys.argv[1], sys.argv[2]
    os.environ[MAIN_PID] = str(os.getpid())
    _prestart(method)
    before = Snapshot()
    if scenario == "os_fork":
        result = os_fork(method)
        if result is None:
            return  # a forked child: this script ends here, normally
    else:
        result = forked_after_failure(method, scenario)
    gc.collect()
    result["leaks"] = before.wait_clean(timeout=10)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
