"""Worker processes run torch, OpenCV and BLAS on one thread each; thread workers and the
main process keep theirs.

Each loader runs in a fresh interpreter whose environment sets no thread-count variable,
so that the counts seen are the libraries' own defaults and what stoker changed. The first
tests check the import hook (`AfterImport`) in-process on throwaway modules.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.support.processes import START_METHODS

from stoker._core.math_threads import AfterImport, blas_threads, set_blas_threads

CHILD_TIMEOUT_S = 60  # a hang guard: each child takes a few seconds
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "OPENCV_FOR_THREADS_NUM",
)

# ---------------------------------------------------------------- the import hook, in-process


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for throwaway modules, forgotten (with any hook) afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def write(directory: Path, relative: str, source: str) -> None:
    path = directory / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    importlib.invalidate_caches()


def test_hook_fires_once_after_the_module_ran(modules: Path) -> None:
    write(modules, "threads_fake_a.py", "ran = True\n")
    seen = []

    def limit(module) -> None:
        seen.append((module.__name__, module.ran))
        module.limited = True

    hook = AfterImport({"threads_fake_a": limit})
    hook.install()
    import threads_fake_a

    assert threads_fake_a.limited, "the callback ran before the import statement returned"
    assert seen == [("threads_fake_a", True)]
    importlib.reload(threads_fake_a)
    assert seen == [("threads_fake_a", True)], "fires once"
    assert hook not in sys.meta_path, "removed itself once every watched module fired"
    assert "exec_module" not in vars(threads_fake_a.__loader__), "the loader is restored"


def test_hook_waits_for_every_watched_module_and_fires_for_a_package(modules: Path) -> None:
    write(modules, "threads_fake_b.py", "")
    write(modules, "threads_fake_pkg/__init__.py", "")
    write(modules, "threads_fake_pkg/sub.py", "")
    seen = []
    hook = AfterImport({"threads_fake_b": seen.append, "threads_fake_pkg": seen.append})
    hook.install()
    import threads_fake_b

    assert hook in sys.meta_path and hook.pending == {"threads_fake_pkg"}
    import threads_fake_pkg.sub

    assert seen == [threads_fake_b, threads_fake_pkg]
    assert hook not in sys.meta_path


def test_a_failing_callback_never_breaks_the_import(modules: Path) -> None:
    write(modules, "threads_fake_c.py", "value = 7\n")

    def broken(module) -> None:
        raise RuntimeError("limit failed")

    hook = AfterImport({"threads_fake_c": broken})
    hook.install()
    import threads_fake_c

    assert threads_fake_c.value == 7
    assert hook not in sys.meta_path


def test_a_module_that_fails_to_import_fails_as_usual_and_stays_watched(modules: Path) -> None:
    write(modules, "threads_fake_d.py", "raise ValueError('broken module')\n")
    seen = []
    hook = AfterImport({"threads_fake_d": seen.append, "threads_fake_missing": seen.append})
    hook.install()
    with pytest.raises(ValueError, match="broken module"):
        import threads_fake_d
    with pytest.raises(ModuleNotFoundError, match="threads_fake_missing"):
        import threads_fake_missing  # noqa: F401
    assert seen == [] and hook.pending == {"threads_fake_d", "threads_fake_missing"}

    write(modules, "threads_fake_d.py", "fixed = True\n")
    import threads_fake_d

    assert seen == [threads_fake_d] and threads_fake_d.fixed


def test_an_error_from_another_finder_reaches_the_user_unchanged(modules: Path) -> None:
    class Exploding:
        def find_spec(self, fullname, path, target=None):
            if fullname == "threads_fake_e":
                raise LookupError("finder exploded")
            return None

    sys.meta_path.insert(0, Exploding())
    AfterImport({"threads_fake_e": print}).install()
    with pytest.raises(LookupError, match="finder exploded"):
        import threads_fake_e  # noqa: F401


def test_two_hooks_on_one_module_both_fire(modules: Path) -> None:
    write(modules, "threads_fake_f.py", "")
    seen = []
    AfterImport({"threads_fake_f": lambda m: seen.append("first")}).install()
    AfterImport({"threads_fake_f": lambda m: seen.append("second")}).install()
    import threads_fake_f

    assert sorted(seen) == ["first", "second"]
    assert "exec_module" not in vars(threads_fake_f.__loader__)
    assert not any(isinstance(f, AfterImport) for f in sys.meta_path)


def test_blas_threads_read_back_what_was_set() -> None:
    pytest.importorskip("numpy")
    before = blas_threads()
    if not before:
        pytest.skip("no OpenBLAS or MKL loaded in this process")
    try:
        assert sorted(set_blas_threads(1)) == sorted(before)
        assert set(blas_threads().values()) == {1}
    finally:
        for count in set(before.values()):
            set_blas_threads(count)
    assert blas_threads() == before


def test_setters_found_before_a_fork_are_used_until_a_module_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker._core import math_threads as threads

    before = blas_threads()
    if not before:
        pytest.skip("no OpenBLAS or MKL loaded in this process")
    monkeypatch.setattr(threads, "_fork_setters", None)
    threads.prepare_fork()
    searches = []
    real = threads._blas_functions
    monkeypatch.setattr(threads, "_blas_functions", lambda getter: searches.append(getter) or real(getter))
    try:
        assert sorted(set_blas_threads(1)) == sorted(before) and searches == []  # the inherited ones
        monkeypatch.setitem(sys.modules, "stoker_test_new_module", sys)  # as if one was imported
        assert sorted(set_blas_threads(1)) == sorted(before) and searches  # searched again
    finally:
        for count in set(before.values()):
            set_blas_threads(count)
    assert blas_threads() == before


def _exports_pool_counters(path: str) -> bool:
    try:
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        ctypes.c_int.in_dll(library, "blas_server_avail")
        ctypes.c_int.in_dll(library, "blas_cpu_number")
    except (OSError, ValueError):
        return False
    return True


def test_a_forked_worker_limits_openblas_without_starting_its_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenBLAS stops its pool around a fork; openblas_set_num_threads in the child would start
    it again, whole (~20 ms of CPU per worker, measured). The worker sets the count alone: one
    thread computes, no pool thread ever starts, and the main process is untouched."""
    np = pytest.importorskip("numpy")
    from stoker._core import math_threads as threads

    before = blas_threads()
    openblas = [path for path in before if "openblas" in os.path.basename(path).lower()]
    if not openblas:
        pytest.skip("no OpenBLAS loaded in this process")
    if max(before[path] for path in openblas) < 2:
        pytest.skip("OpenBLAS runs one thread here already")
    if not all(_exports_pool_counters(path) for path in openblas):
        # newer builds (numpy 2.5's scipy-openblas) keep them private: the worker then sets
        # the count through the API, which starts the pool (what this test would see)
        pytest.skip("this OpenBLAS does not export blas_server_avail and blas_cpu_number")
    real = threads._known_setters
    called: list[str] = []

    def spied() -> list[tuple[str, Any]]:
        return [(path, lambda count, path=path: called.append(path)) for path, _ in real()]

    monkeypatch.setattr(threads, "_known_setters", spied)
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            threads.limit_worker_pools()
            product = np.ones((400, 400)) @ np.ones((400, 400))  # large enough to use the pool
            report = [threads.blas_threads(), called, len(os.listdir("/proc/self/task")), float(product[0, 0])]
            os.write(writer, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as out:
        counts, child_called, tasks, value = json.loads(out.read())
    os.waitpid(pid, 0)
    assert {counts[path] for path in openblas} == {1} and value == 400.0
    assert not set(child_called) & set(openblas)  # the API, which starts the pool, was not called
    assert tasks == 1  # and no pool thread was started, even by a product that would use one
    assert blas_threads() == before


# ---------------------------------------------------------------- real workers, in a child


HELPER = '''
import json
import os
import sys

import numpy as np

import stoker
from stoker._core.math_threads import blas_threads


class TorchThreads(stoker.Dataset):
    """torch's intra-op thread count inside the worker; torch is imported lazily."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import torch

        torch.ones(4).flip(0)
        return torch.get_num_threads()


class Cv2Threads(TorchThreads):
    def __getitem__(self, i):
        import cv2

        return cv2.getNumThreads()


class NumpyReport(TorchThreads):
    def __getitem__(self, i):
        a = np.ones((64, 64))
        a @ a
        return json.dumps({"pid": os.getpid(), "torch": "torch" in sys.modules, "blas": blas_threads()})


def three_threads(worker_id):
    import torch

    torch.set_num_threads(3)
'''

TORCH_SCRIPT = """
import json, sys
method, parent = sys.argv[1:]
before = None
if parent == "torch":
    import torch
    before = torch.get_num_threads()
import stoker
from threads_helper import TorchThreads, three_threads


def run(**kwargs):
    loader = stoker.DataLoader(TorchThreads(), batch_size=2, num_workers=2, **kwargs)
    return [int(v) for batch in loader for v in batch]


got = {"before": before, "workers": run(multiprocessing_context=method)}
if parent == "torch":
    got["threads"] = run(thread_pool=True)
else:
    got["init_three"] = run(multiprocessing_context=method, worker_init_fn=three_threads)
got["torch_in_parent"] = "torch" in sys.modules
got["hooked"] = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "AfterImport"]
import torch
got["after"] = torch.get_num_threads()
print(json.dumps(got))
"""

CV2_SCRIPT = """
import json, sys
import stoker
from threads_helper import Cv2Threads
loader = stoker.DataLoader(Cv2Threads(), batch_size=2, num_workers=2, multiprocessing_context=sys.argv[1])
values = [int(v) for batch in loader for v in batch]
cv2_in_parent = "cv2" in sys.modules
import cv2
print(json.dumps({"values": values, "cv2_in_parent": cv2_in_parent, "after": cv2.getNumThreads()}))
"""

NUMPY_SCRIPT = """
import json, os, sys
import stoker
from stoker._core.math_threads import blas_threads
from threads_helper import NumpyReport
before = blas_threads()
loader = stoker.DataLoader(NumpyReport(), batch_size=None, num_workers=2, multiprocessing_context=sys.argv[1])
reports = [json.loads(r) for r in loader]
print(json.dumps({"reports": reports, "pid": os.getpid(), "before": before, "after": blas_threads(),
                  "torch_in_parent": "torch" in sys.modules}))
"""

FAKE_CV2 = """
threads = 8


def setNumThreads(n):
    global threads
    threads = n


def getNumThreads():
    return threads
"""


def run_child(tmp_path: Path, script: str, *args: str, path: tuple[Path, ...] = ()) -> dict:
    """Run `script` in a fresh interpreter with no thread-count variables set; its last
    stdout line, as JSON."""
    (tmp_path / "threads_helper.py").write_text(HELPER)
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(
        [*(str(p) for p in path), str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    child = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """`run_child`, each script and arguments run once for the tests that share them."""
    results: dict[tuple, dict] = {}

    def run(script: str, *args: str, path: tuple[Path, ...] = ()) -> dict:
        key = (script, args, path)
        if key not in results:
            results[key] = run_child(tmp_path_factory.mktemp("child"), script, *args, path=path)
        return results[key]

    return run


def skip_if_single_threaded(count: int) -> None:
    if count == 1:
        pytest.skip("torch defaults to one thread here: a limit to 1 would not show")


@pytest.mark.parametrize("method", START_METHODS)
def test_workers_limit_a_torch_the_parent_imported(method: str, child) -> None:
    pytest.importorskip("torch")
    got = child(TORCH_SCRIPT, method, "torch")
    skip_if_single_threaded(got["before"])
    assert got["workers"] == [1] * 8
    assert got["after"] == got["before"], "the main process keeps its threads"
    assert got["hooked"] == [], "no import hook in the main process"


@pytest.mark.parametrize("method", START_METHODS)
def test_workers_limit_a_torch_first_imported_in_getitem(method: str, child) -> None:
    pytest.importorskip("torch")
    got = child(TORCH_SCRIPT, method, "numpy")
    assert not got["torch_in_parent"], "neither the test nor stoker imported torch in the parent"
    skip_if_single_threaded(got["after"])
    assert got["workers"] == [1] * 8


@pytest.mark.parametrize("method", START_METHODS)
def test_worker_init_fn_can_raise_the_count_of_a_torch_it_imports(method: str, child) -> None:
    pytest.importorskip("torch")
    got = child(TORCH_SCRIPT, method, "numpy")
    assert not got["torch_in_parent"]
    assert got["init_three"] == [3] * 8


def test_thread_workers_keep_the_process_threads(child) -> None:
    pytest.importorskip("torch")
    got = child(TORCH_SCRIPT, START_METHODS[0], "torch")
    skip_if_single_threaded(got["before"])
    assert got["threads"] == [got["before"]] * 8
    assert got["after"] == got["before"]
    assert got["hooked"] == []


@pytest.mark.parametrize("method", START_METHODS)
def test_numpy_only_workers_never_import_torch(method: str, child) -> None:
    got = child(NUMPY_SCRIPT, method)
    assert not got["torch_in_parent"]
    assert len(got["reports"]) == 8
    assert all(r["pid"] != got["pid"] for r in got["reports"]), "samples came from workers"
    assert [r["torch"] for r in got["reports"]] == [False] * 8


@pytest.mark.parametrize("method", START_METHODS)
def test_workers_limit_openblas_to_one_thread(method: str, child) -> None:
    got = child(NUMPY_SCRIPT, method)
    if not got["before"]:
        pytest.skip("no OpenBLAS or MKL found in the process")
    assert all(r["blas"] and set(r["blas"].values()) == {1} for r in got["reports"])
    assert got["after"] == got["before"], "the main process keeps its BLAS threads"


@pytest.mark.parametrize("method", START_METHODS)
def test_workers_run_opencv_sequentially(method: str, child) -> None:
    pytest.importorskip("cv2")
    got = child(CV2_SCRIPT, method)
    assert not got["cv2_in_parent"]
    if got["after"] == 1:
        pytest.skip("OpenCV defaults to one thread here: a limit would not show")
    assert got["values"] == [1] * 8, "setNumThreads(0): sequential, reported as 1"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_set_opencv_to_zero_threads(method: str, tmp_path: Path) -> None:
    if method not in START_METHODS:
        pytest.skip(f"no {method} here")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "cv2.py").write_text(FAKE_CV2)
    got = run_child(tmp_path, CV2_SCRIPT, method, path=(fake,))
    assert not got["cv2_in_parent"]
    assert got["values"] == [0] * 8
    assert got["after"] == 8, "the main process's OpenCV is untouched"
