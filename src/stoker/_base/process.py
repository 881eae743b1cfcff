"""Fork safety in one place: values that belong to the process that made them.

A child made by `fork()` starts with a copy of everything its parent held: open files and
their locks, sockets, mappings, threads' locks (held by threads that do not exist in the
child), clients whose runtimes did not survive the fork. Each such value must be made anew in
the child, and the parent's copy must not be closed there (closing it would release the
parent's resources, or act on its workers). stoker says this once:

- `PerProcess[T]` holds a value made by a factory on first use, and makes it anew in any
  process other than the one that made it; its `close` runs only in that process. It pickles
  empty: a spawned worker makes its own.
- `at_fork` is the one registration point for what must happen around a fork of this process
  (stopping threads, closing descriptors that carry a lock, dropping what a child must not
  keep); one `os.register_at_fork` runs every registered hook, in an order said at
  registration (`stops_threads`), never by which module happened to be imported first.
- `only_here` makes a cleanup that does nothing in any process but the one that made it, and
  `finalize` is `weakref.finalize` with such a cleanup.

This module imports nothing of stoker: every layer may use it.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["PerProcess", "at_fork", "finalize", "only_here"]

T = TypeVar("T")


class _Ring:
    """The hooks of one ring, each list in the order it runs (as `os.register_at_fork` orders
    them: `before` hooks in the reverse order of registration, `after_*` in that order)."""

    def __init__(self) -> None:
        self.before: list[Callable[[], None]] = []
        self.in_parent: list[Callable[[], None]] = []
        self.in_child: list[Callable[[], None]] = []


# the outer ring, `at_fork(..., stops_threads=True)`: a thread being stopped may need a lock that
# an inner `before` takes for the fork (the shard cache's descriptor lock, for the lease watch)
_outer = _Ring()
_inner = _Ring()


def at_fork(
    before: Callable[[], None] | None = None,
    after_in_parent: Callable[[], None] | None = None,
    after_in_child: Callable[[], None] | None = None,
    *,
    stops_threads: bool = False,
) -> None:
    """Run these around every `fork()` of this process, as `os.register_at_fork` does.

    Hooks run in two rings. Those registered with `stops_threads=True` are the outer ring:
    their `before` hooks run first and their `after_*` hooks last, so a thread they stop can
    still take any lock the other hooks take for the fork. Within a ring, `before` hooks run
    in the reverse order of registration and the `after_*` hooks in the order of registration
    (as `os.register_at_fork` orders them), so a lock taken by a later `before` is released by
    its `after_*` before an earlier one's. Where the platform has no fork (Windows) nothing is
    registered and nothing runs.

    Args:
        before: Called in the parent just before the fork (e.g. take a lock so that no
            other thread holds it while the child is copied). None means none. Defaults to
            None.
        after_in_parent: Called in the parent just after the fork. None means none.
            Defaults to None.
        after_in_child: Called in the child just after the fork (e.g. close inherited
            descriptors, drop inherited state). None means none. Defaults to None.
        stops_threads: Whether `before` stops threads of this process (waits for them to
            end), which may take locks other hooks hold across the fork: such hooks run
            outside every other (bool). Defaults to False.

    Raises:
        TypeError: when a hook given is not callable, or `stops_threads` is not a bool.
    """
    for name, hook in (("before", before), ("after_in_parent", after_in_parent), ("after_in_child", after_in_child)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} should be a callable or None, but got {name}={hook!r}")
    if not isinstance(stops_threads, bool):
        raise TypeError(f"stops_threads should be a bool, but got stops_threads={stops_threads!r}")
    ring = _outer if stops_threads else _inner
    if before is not None:
        ring.before.insert(0, before)
    if after_in_parent is not None:
        ring.in_parent.append(after_in_parent)
    if after_in_child is not None:
        ring.in_child.append(after_in_child)


def _run(*hooks: list[Callable[[], None]]) -> None:
    for hook in [h for ring in hooks for h in ring]:
        hook()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=lambda: _run(_outer.before, _inner.before),
        after_in_parent=lambda: _run(_inner.in_parent, _outer.in_parent),
        after_in_child=lambda: _run(_inner.in_child, _outer.in_child),
    )


def only_here(func: Callable[..., Any]) -> Callable[..., None]:
    """`func`, made to do nothing when called in any process other than this one.

    Args:
        func: the cleanup to run; its result is dropped.

    Returns:
        A callable taking `func`'s arguments.
    """
    pid = os.getpid()

    def call(*args: Any) -> None:
        if os.getpid() == pid:
            func(*args)

    return call


def finalize(obj: Any, func: Callable[..., Any], *args: Any) -> weakref.finalize:
    """`weakref.finalize(obj, func, *args)` that calls `func` only in this process: in a forked
    child, calling the finalizer, collecting `obj` or the child's exit just detach it.

    Args:
        obj: the object whose collection triggers the call.
        func: the cleanup; it must not hold a reference to `obj`.
        *args: passed to `func`.

    Returns:
        The finalizer (call it to run the cleanup early; `alive` says whether it has run).
    """
    return weakref.finalize(obj, only_here(func), *args)


# Every holder, so that a forked child can replace their locks: a thread of the parent may
# have held one at the fork, and it would stay held in the child for ever.
_holders: weakref.WeakSet[PerProcess[Any]] = weakref.WeakSet()


class PerProcess(Generic[T]):
    """A value that belongs to the process that made it: made by `factory` on first use, and
    made anew in a process other than the one that made it (a forked child). `close` is called
    on the value only in the process that made it; a forked child forgets its parent's copy
    without closing it.

        self._files = PerProcess(_OpenFiles, close=_OpenFiles.close)
        self._files.get().read(...)   # this process's own _OpenFiles
        self._files.clear()           # closed here; a child's copy is never closed by it

    Thread safe: concurrent first uses make one value. It pickles without its value (a process
    that unpickles it makes its own); `factory` and `close` must then pickle (functions,
    classes and bound methods do).

    Args:
        factory: Makes the value, called with no argument in the process that needs it.
        close: Releases a value, called with it in the process that made it (by `clear`).
            None means nothing to release. Defaults to None.

    Raises:
        TypeError: when `factory` is not callable, or `close` is neither callable nor None.
    """

    def __init__(self, factory: Callable[[], T], close: Callable[[T], Any] | None = None) -> None:
        if not callable(factory):
            raise TypeError(f"factory should be a callable, but got factory={factory!r}")
        if close is not None and not callable(close):
            raise TypeError(f"close should be a callable or None, but got close={close!r}")
        self._factory = factory
        self._close = close
        self._made: tuple[int, T] | None = None  # (the pid that made it, the value)
        self._lock = threading.Lock()
        _holders.add(self)

    def get(self) -> T:
        """This process's value, made now if this process has none.

        Returns:
            The value made by `factory` in this process.

        Raises:
            Exception: whatever `factory` raises (nothing is held then; the next call tries
                again).
        """
        made = self._made
        pid = os.getpid()
        if made is not None and made[0] == pid:
            return made[1]
        with self._lock:
            made = self._made
            if made is None or made[0] != pid:
                made = self._made = (pid, self._factory())
        return made[1]

    def peek(self) -> T | None:
        """This process's value if it has made one, else None (nothing is made)."""
        made = self._made
        if made is not None and made[0] == os.getpid():
            return made[1]
        return None

    @property
    def made_here(self) -> bool:
        """Whether this process has made its value (and holds it)."""
        made = self._made
        return made is not None and made[0] == os.getpid()

    def clear(self) -> None:
        """Forget the value; close it first if this process made it (a copy inherited from
        another process is forgotten, never closed)."""
        with self._lock:
            made, self._made = self._made, None
        if made is not None and made[0] == os.getpid() and self._close is not None:
            self._close(made[1])

    def __getstate__(self) -> dict[str, Any]:
        return {"factory": self._factory, "close": self._close}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["factory"], state["close"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"PerProcess({getattr(self._factory, '__qualname__', self._factory)!r}, made_here={self.made_here})"


def _new_locks_in_child() -> None:
    for holder in list(_holders):
        holder._lock = threading.Lock()


at_fork(after_in_child=_new_locks_in_child)
