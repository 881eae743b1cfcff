"""A process forked from the one that made a loader never touches that loader.

A child made by `os.fork()` (or a `multiprocessing` fork child, or a fork worker of another
loader, torch's included) starts with a copy of everything its parent held: the loader, its
iterator, the iterator's workers' process objects and sockets, the pin thread's state. Three
things would run stoker's cleanup there, on the parent's workers, when the child ends or
collects garbage:

- `weakref.finalize` runs every live finalizer at interpreter exit, and the child inherits
  the registry; the garbage collector runs them too, when the child drops its copy (a failed
  iterator kept alive by its traceback is collected in whatever process collects next).
  The iterator's finalizer would send Stop down the sockets the parent's workers read,
  terminate them and join them (`AssertionError: can only join a child process`).
- `multiprocessing`'s own exit function terminates, then joins, every daemon process in its
  list of this process's children, and a child made by `os.fork()` inherits that list.
- CUDA calls made by the pin thread's, the device copier's or a pinned slot's cleanup are
  undefined in a forked child.

So stoker's finalizers are made with `finalize` (or wrapped with `only_here`, both from
`_base/process.py`, the one home of fork safety): they do nothing in any process other than
the one that made them, and `adopt` records each worker process started, which an at-fork
hook removes from a forked child's copy of multiprocessing's list.
What a child releases of its own (its copies of descriptors, its mappings) stays released
there: that is the child's memory, not the parent's loader.
"""

from __future__ import annotations

import weakref
from multiprocessing import process as mp_process
from multiprocessing.process import BaseProcess

from .._base.process import at_fork, finalize, only_here

__all__ = ["adopt", "finalize", "only_here"]

_workers: weakref.WeakSet[BaseProcess] = weakref.WeakSet()


def adopt(process: BaseProcess) -> None:
    """Record a worker process this process started, so that a child forked from this
    process does not count it among its own children (see the module's docstring).

    Args:
        process: a started `multiprocessing` process object.
    """
    _workers.add(process)


def _forget_inherited_workers() -> None:
    """In a forked child: the recorded workers are the parent's, not ours."""
    children = getattr(mp_process, "_children", None)
    if isinstance(children, set):
        children.difference_update(list(_workers))
    _workers.clear()


at_fork(after_in_child=_forget_inherited_workers)
