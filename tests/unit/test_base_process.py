"""`_base/process.py`, the one home of fork safety: `PerProcess` makes its value once per
process (again in a forked child, whose copy of the parent's is never closed there), pickles
empty, survives a fork taken while another thread was making its value; `at_fork` runs its
hooks around each fork; `finalize` does nothing in a forked child. Children are forked by
multiprocessing and joined under a deadline."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stoker._base.process import PerProcess, at_fork, finalize

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork children")

CHILD_TIMEOUT_S = 30


class Thing:
    made = 0

    def __init__(self) -> None:
        Thing.made += 1
        self.pid = os.getpid()
        self.closed_in: list[int] = []

    def close(self) -> None:
        self.closed_in.append(os.getpid())


def in_fork_child(body: Callable[[], Any]) -> Any:
    """Run `body` in a forked child and return what it returned (it must pickle)."""
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def run() -> None:
        try:
            writer.send(("ok", body()))
        except BaseException as exc:
            writer.send(("raised", repr(exc)))

    child = ctx.Process(target=run)
    child.start()
    try:
        assert reader.poll(CHILD_TIMEOUT_S), "the forked child did not answer"
        kind, value = reader.recv()
    finally:
        child.join(CHILD_TIMEOUT_S)
        if child.is_alive():
            child.kill()
            child.join()
        reader.close()
        writer.close()
    assert kind == "ok", value
    return value


def test_the_value_is_made_once_per_process_even_by_racing_threads() -> None:
    made: list[int] = []
    gate = threading.Barrier(8)

    def factory() -> object:
        made.append(1)
        return object()

    holder: PerProcess[object] = PerProcess(factory)
    assert holder.peek() is None and not holder.made_here
    got: list[object] = []

    def use() -> None:
        gate.wait()
        got.append(holder.get())

    threads = [threading.Thread(target=use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(g is got[0] for g in got)
    assert holder.made_here and holder.peek() is got[0]


def test_a_forked_child_makes_its_own_and_never_closes_its_parents() -> None:
    holder: PerProcess[Thing] = PerProcess(Thing, close=Thing.close)
    parent_value = holder.get()

    def child() -> dict[str, Any]:
        had = holder.peek()  # the parent's value is not this process's
        mine = holder.get()
        holder.clear()  # closes the child's own value, not the parent's
        return {
            "had": had,
            "new": mine is not parent_value,
            "mine_pid": mine.pid,
            "mine_closed": mine.closed_in,
            "parent_closed": parent_value.closed_in,
            "pid": os.getpid(),
        }

    got = in_fork_child(child)
    assert got["had"] is None and got["new"]
    assert got["mine_pid"] == got["pid"] and got["mine_closed"] == [got["pid"]]
    assert got["parent_closed"] == []
    assert holder.get() is parent_value and parent_value.closed_in == []
    holder.clear()
    assert parent_value.closed_in == [os.getpid()] and holder.peek() is None


def test_a_fork_while_another_thread_makes_the_value_does_not_deadlock_the_child() -> None:
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(CHILD_TIMEOUT_S)
        return f"made in {os.getpid()}"

    holder: PerProcess[str] = PerProcess(slow)
    maker = threading.Thread(target=holder.get)
    maker.start()
    assert started.wait(CHILD_TIMEOUT_S)  # the maker holds the holder's lock now
    try:

        def child() -> tuple[str, int]:
            release.set()  # the child's copy of the event: its maker thread does not exist here
            return holder.get(), os.getpid()

        value, pid = in_fork_child(child)
        assert value == f"made in {pid}" and pid != os.getpid()
    finally:
        release.set()
        maker.join()
    assert holder.get() == f"made in {os.getpid()}"


def test_it_pickles_without_its_value() -> None:
    holder: PerProcess[Thing] = PerProcess(Thing, close=Thing.close)
    value = holder.get()
    copy = pickle.loads(pickle.dumps(holder))
    assert copy.peek() is None
    assert copy.get() is not value and isinstance(copy.get(), Thing)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="factory should be a callable, but got factory=3"):
        PerProcess(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="close should be a callable or None, but got close='x'"):
        PerProcess(Thing, close="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="after_in_child should be a callable or None, but got after_in_child=1"):
        at_fork(after_in_child=1)  # type: ignore[arg-type]


calls: list[str] = []
recording = threading.Event()  # the hooks stay registered: they record only during the test


def _record(what: str) -> Callable[[], None]:
    return lambda: calls.append(what) if recording.is_set() else None


def test_at_fork_hooks_run_around_a_fork_in_order() -> None:
    calls.clear()
    for n in (1, 2):
        at_fork(
            before=_record(f"before {n}"), after_in_parent=_record(f"parent {n}"), after_in_child=_record(f"child {n}")
        )
    recording.set()
    try:
        in_child = in_fork_child(lambda: list(calls))
    finally:
        recording.clear()
    assert in_child == ["before 2", "before 1", "child 1", "child 2"]
    assert calls == ["before 2", "before 1", "parent 1", "parent 2"]


def test_finalize_runs_only_in_the_process_that_made_it() -> None:
    ran: list[int] = []

    class Owner:
        pass

    owner = Owner()
    done = finalize(owner, ran.append, 1)

    def child() -> list[int]:
        done()  # the parent's cleanup, called in the child: detached, not run
        return list(ran)

    assert in_fork_child(child) == []
    assert ran == [] and done.alive
    del owner
    assert ran == [1]


def test_at_fork_is_the_one_registration_point() -> None:
    src = Path(__file__).resolve().parents[2] / "src" / "stoker"
    callers = sorted(
        str(path.relative_to(src)) for path in src.rglob("*.py") if "os.register_at_fork(" in path.read_text()
    )
    assert callers == ["_base/process.py"]
