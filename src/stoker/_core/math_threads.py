"""One thread per math library inside each worker process, so workers never oversubscribe.

Why: torch, OpenCV and BLAS each size their thread pool to the whole machine. A worker
process that runs a torch op (`torch.stack` in collate, `tensor.flip` in `__getitem__`)
would use every core for it, and 14 such workers on 16 cores run 14 x 16 threads that
fight over the caches and each other's locks. torch's own DataLoader workers call
`torch.set_num_threads(1)`; `limit_worker_pools()`, called first thing in every worker
process (fork, spawn, forkserver), does the same and a little more:

- torch: `torch.set_num_threads(1)`, at once if torch is already imported (fork
  inherits it; spawn may have imported it while unpickling the dataset), otherwise right
  after torch is first imported in that worker, before any user code gets it. We never
  import torch ourselves: a numpy-only worker stays free of it.
- OpenCV: `cv2.setNumThreads(0)`, the same way. 0, not 1: 0 means "no parallel
  framework, run in the calling thread" on every OpenCV version and backend, while 1
  still went through the framework (a one-thread TBB arena or OpenMP team) on older
  versions. Current versions treat both alike and report `getNumThreads() == 1`.
- BLAS: every OpenBLAS (numpy's and scipy's wheels bundle one) or MKL (`libmkl_rt`) already
  loaded into the worker is set to 1 thread through its own C API, found in
  `/proc/self/maps` and called through ctypes (Linux only; silently nothing elsewhere).
  A `numpy.dot` in `__getitem__` then runs in the worker's thread instead of waking a
  pool of spinning BLAS threads per worker. A BLAS library loaded later (scipy.linalg's own
  OpenBLAS) is not limited, and the pools are not touched again after start, so a count a
  user sets in `worker_init_fn` stays.

Not limited: torch's inter-op pool (torch's workers leave it too, and it can be sized only
once per process). Environment variables (OMP_NUM_THREADS and the like) are not set: they
would leak into the user's subprocesses and are read only when a library loads.

A user's `worker_init_fn` runs after `limit_worker_pools()`, so it can raise any count
again (`torch.set_num_threads(4)`, `cv2.setNumThreads(2)`,
`threadpoolctl.threadpool_limits(4)`), including for a torch it imports for the first time.

Thread workers (`thread_pool=True`) never call this: they share the main process's pools,
and shrinking those would slow the training loop. Each thread worker's torch ops use the
main process's `torch.get_num_threads()`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, NamedTuple

WORKER_THREADS = 1  # torch intra-op and BLAS threads per worker process
CV2_WORKER_THREADS = 0  # OpenCV's "run sequentially in the calling thread"

_MAPS = "/proc/self/maps"


class _BlasApi(NamedTuple):
    keyword: str  # in the library's file name
    setters: Sequence[str]  # the first one the library exports is used
    getters: Sequence[str]


def _openblas_names(verb: str) -> list[str]:
    # vanilla OpenBLAS, and scipy-openblas (numpy's and scipy's wheels): prefixed, and
    # suffixed in its ILP64 build
    return [
        f"{prefix}openblas_{verb}_num_threads{suffix}" for prefix in ("", "scipy_") for suffix in ("", "64_", "_64")
    ]


_BLAS_APIS = (
    _BlasApi("openblas", _openblas_names("set"), _openblas_names("get")),
    _BlasApi("mkl_rt", ["MKL_Set_Num_Threads"], ["MKL_Get_Max_Threads"]),
)


def limit_worker_pools() -> None:
    """Limit torch, OpenCV and BLAS to one thread each in this worker process.

    Libraries already imported are limited at once; torch and cv2 imported later are
    limited right after their import completes. Never raises, never imports torch or cv2.
    """
    _quietly(set_blas_threads, WORKER_THREADS)
    limits: dict[str, Callable[[ModuleType], object]] = {
        "torch": _limit_torch,
        "cv2": _limit_cv2,
    }
    for finder in [f for f in sys.meta_path if isinstance(f, AfterImport)]:
        finder.uninstall()  # called twice in one process: the newest watch wins
    later = {}
    for name, limit in limits.items():
        module = sys.modules.get(name)
        if module is None:
            later[name] = limit
        else:
            _quietly(limit, module)
    if later:
        AfterImport(later).install()


def _limit_torch(torch: ModuleType) -> None:
    torch.set_num_threads(WORKER_THREADS)


def _limit_cv2(cv2: ModuleType) -> None:
    cv2.setNumThreads(CV2_WORKER_THREADS)


def _quietly(function: Callable[..., object], *args: Any) -> None:
    # Limiting threads is an optimisation: a library without the expected API (a stub, an
    # old version) must never fail a worker or the user's import.
    try:
        function(*args)
    except Exception:
        pass


class AfterImport:
    """A `sys.meta_path` finder that calls `callbacks[name](module)` right after the
    top-level module `name` finishes executing, before the importer receives it. (It has
    `importlib.abc.MetaPathFinder`'s protocol, not the class: importing `importlib.abc`
    costs a worker process 15-20 ms of start-up.)

    It finds nothing itself: it asks the other finders on `sys.meta_path` for the spec and
    wraps that spec's loader's `exec_module` on the loader instance (type and identity
    unchanged, restored once the module ran). Each name fires once; the finder removes
    itself once all have fired. Anything unexpected (no spec, a loader it cannot wrap, a
    callback that raises) leaves the import exactly as it would be without the finder.
    """

    def __init__(self, callbacks: Mapping[str, Callable[[ModuleType], object]]) -> None:
        self._pending = dict(callbacks)
        self._lock = threading.Lock()
        self._finding = threading.local()  # names this thread is asking the other finders for

    @property
    def pending(self) -> frozenset[str]:
        """Names whose callback has not fired yet."""
        with self._lock:
            return frozenset(self._pending)

    def install(self) -> None:
        """Put the finder first on `sys.meta_path`."""
        sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        """Take the finder off `sys.meta_path` (a no-op if it is not there)."""
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        """The spec the other finders give for a watched name, its loader wrapped; else None."""
        with self._lock:
            callback = self._pending.get(fullname)
        finding: set[str] = getattr(self._finding, "names", set())
        self._finding.names = finding
        if callback is None or fullname in finding:
            return None  # not watched, or asked again by a finder we are asking
        finding.add(fullname)
        try:
            spec = self._find_elsewhere(fullname, path, target)
        except Exception:
            # Returning None lets the import system ask the same finders again, so an error
            # one of them raises reaches the user as if we were not here.
            return None
        finally:
            finding.discard(fullname)
        if spec is not None and spec.loader is not None:
            try:
                self._wrap(spec.loader, fullname, callback)
            except Exception:
                pass
        return spec

    def _find_elsewhere(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> ModuleSpec | None:
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _wrap(self, loader: Any, fullname: str, callback: Callable[[ModuleType], object]) -> None:
        if isinstance(loader, type):
            return  # a class used as a loader (builtins, frozen) is shared: never patch it
        exec_module = loader.exec_module

        def exec_then_call(module: ModuleType) -> None:
            if getattr(module, "__name__", None) != fullname:
                exec_module(module)  # a loader shared by several modules (a zip archive)
                return
            try:
                exec_module(module)
            finally:
                if loader.__dict__.get("exec_module") is exec_then_call:
                    del loader.exec_module
            self._fire(fullname, callback, module)

        loader.exec_module = exec_then_call

    def _fire(self, fullname: str, callback: Callable[[ModuleType], object], module: ModuleType) -> None:
        with self._lock:
            self._pending.pop(fullname, None)
            done = not self._pending
        if done:
            self.uninstall()
        _quietly(callback, module)


def _loaded_libraries(keyword: str) -> list[str]:
    """Paths of the shared libraries mapped into this process whose file name contains
    `keyword`; empty where /proc/self/maps does not exist."""
    try:
        with open(_MAPS) as maps:
            lines = maps.readlines()
    except OSError:
        return []
    paths: dict[str, None] = {}
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6:
            path = fields[5].strip()
            if keyword in os.path.basename(path).lower():
                paths[path] = None
    return list(paths)


def _blas_functions(getter: bool) -> list[tuple[str, Any]]:
    """(path, C function) for each loaded BLAS library: its setter, or its getter."""
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:
        return []
    found = []
    for api in _BLAS_APIS:
        for path in _loaded_libraries(api.keyword):
            try:
                # RTLD_NOLOAD: a handle to the copy already loaded, never a new load
                library = ctypes.CDLL(path, mode=no_load | os.RTLD_NOW)
            except OSError:
                continue
            for name in api.getters if getter else api.setters:
                function = getattr(library, name, None)
                if function is not None:
                    found.append((path, function))
                    break
    return found


# (pid, len(sys.modules), setters) found by `prepare_fork` in the main process just before it
# forks workers: a forked worker inherits the mapped libraries and the function pointers with
# them, and skips the search (reading /proc/self/maps of a process holding torch: 5-10 ms of
# each worker's start-up)
_fork_setters: tuple[int, int, list[tuple[str, Any]]] | None = None


def prepare_fork() -> None:
    """In the main process, before forking workers: find the BLAS setters once for them all."""
    global _fork_setters
    known = _fork_setters
    if known is None or known[0] != os.getpid() or known[1] != len(sys.modules):
        try:
            _fork_setters = (os.getpid(), len(sys.modules), _blas_functions(getter=False))
        except Exception:
            _fork_setters = None


def _known_setters() -> list[tuple[str, Any]]:
    """`_blas_functions(getter=False)`, from `prepare_fork`'s search when it still holds."""
    known = _fork_setters
    if known is not None:
        pid, modules, setters = known
        # found by our parent right before it forked us; or by this process, and no module
        # imported since (it may have mapped another BLAS)
        if pid == os.getppid() or (pid == os.getpid() and modules == len(sys.modules)):
            return setters
    return _blas_functions(getter=False)


def _openblas_count_without_pool(path: str, count: int) -> bool:
    """Set the OpenBLAS at `path` to `count` threads without starting its pool, where the pool
    is down (in a forked child: OpenBLAS stops it around a fork and starts it again at the
    next call that needs it). `openblas_set_num_threads` starts the whole pool first (a
    thread per core, each spinning before it sleeps: ~20 ms of CPU per worker on 2 cores);
    with the count at 1 OpenBLAS computes in the calling thread and never needs it. Only
    lowers the count, and only for libraries that export the two counters; False where it
    did nothing."""
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None or "openblas" not in os.path.basename(path).lower():
        return False
    try:
        library = ctypes.CDLL(path, mode=no_load | os.RTLD_NOW)
        available = ctypes.c_int.in_dll(library, "blas_server_avail")
        number = ctypes.c_int.in_dll(library, "blas_cpu_number")
    except (OSError, ValueError):
        return False
    # the pool runs: the API is cheap then; a higher count may need threads the pool lacks
    if available.value != 0 or not 1 <= count <= number.value:
        return False
    number.value = count
    return True


def set_blas_threads(count: int) -> list[str]:
    """Set every loaded OpenBLAS and MKL to `count` threads; returns the libraries' paths.
    An OpenBLAS whose pool is down keeps it down (see `_openblas_count_without_pool`)."""
    done = []
    for path, set_threads in _known_setters():
        if _openblas_count_without_pool(path, count):
            done.append(path)
            continue
        set_threads.restype = None
        set_threads.argtypes = [ctypes.c_int]
        set_threads(count)
        done.append(path)
    return done


def blas_threads() -> dict[str, int]:
    """Thread count of every loaded OpenBLAS and MKL, by library path."""
    counts = {}
    for path, get_threads in _blas_functions(getter=True):
        get_threads.restype = ctypes.c_int
        get_threads.argtypes = []
        counts[path] = int(get_threads())
    return counts
