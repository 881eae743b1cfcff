from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from tests.support.leakcheck import KINDS, SETTLE_S, Snapshot
from tests.support.processes import START_METHODS

# Every test here, whatever its tier, fails if it leaves a child process, thread, pipe/socket/
# memfd descriptor or /dev/shm entry behind. A test that keeps something alive on purpose says
# what and why: @pytest.mark.leaks_allowed("threads", reason="..."), or with no kinds named,
# @pytest.mark.leaks_allowed(reason="...") to opt out of the check (marker in pyproject.toml).
TESTS = Path(__file__).resolve().parent
CALL_RAISED = pytest.StashKey[bool]()
# the tiers whose tests use object storage: see _warm_store_clients
STORE_TIERS = ("shards", "mix", "user")
_stores_warmed = False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--leak-settle",
        type=float,
        default=SETTLE_S,
        metavar="SECONDS",
        help=f"how long the leak check waits for a test's leftovers to go (polled; default {SETTLE_S})",
    )


@pytest.fixture(scope="session", autouse=True)
def _multiprocessing_helpers():
    """Start multiprocessing's own helper processes (the forkserver, spawn's resource
    tracker) once, up front, and make the first arena of its shared-memory heap (behind
    `Value` and `Array`: an unlinked /dev/shm file kept open, and mapped, for the rest of the
    process), so that leak checks do not mistake them for ours."""
    from multiprocessing import forkserver, heap, resource_tracker

    if "forkserver" in START_METHODS:
        forkserver.ensure_running()
    resource_tracker.ensure_running()
    heap.BufferWrapper(1)  # freed at once; the heap keeps its (small) arena
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    yield
    if call.when == "call":
        # pytest.skip()/xfail() raise BaseExceptions, not Exceptions: the test did not fail
        item.stash[CALL_RAISED] = call.excinfo is not None and call.excinfo.errisinstance(Exception)


def _allowed_kinds(item: pytest.Item) -> set[str]:
    allowed: set[str] = set()
    for mark in item.iter_markers("leaks_allowed"):
        if not mark.kwargs.get("reason"):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.leaks_allowed needs a reason=")
        unknown = set(mark.args) - set(KINDS)
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: leaks_allowed kinds {sorted(unknown)} not in {KINDS}")
        allowed |= set(mark.args or KINDS)
    return allowed


def _warm_store_clients(request: pytest.FixtureRequest) -> None:
    """Start, once per process and before the first snapshot of a tier that uses object
    storage, what a process keeps for its life once it has used it: the session's S3 server
    (tests/support/s3server.py; some tests ask for it only while they run), obstore's runtime
    with the relay thread that serves forked children (stoker._shards.relay), and fsspec's IO
    thread. Like multiprocessing's helpers above, they are not a test's leftovers."""
    global _stores_warmed
    if _stores_warmed:
        return
    _stores_warmed = True
    try:
        server = request.getfixturevalue("s3_server")
    except pytest.FixtureLookupError:
        return
    from tests.support.s3server import client_env

    from stoker._shards.store import Store

    bucket = "leak-check-warm-up"
    server.make_bucket(bucket)
    saved = dict(os.environ)
    os.environ.update(client_env(server.endpoint))
    try:
        for client, module in (("obstore", "obstore"), ("fsspec", "s3fs")):
            if importlib.util.find_spec(module) is None:  # not installed (the user tier): unused
                continue
            store = Store(f"s3://{bucket}/data", client=client)
            store.write("warm", b"1")
            store.read("warm")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _leak_checked(request: pytest.FixtureRequest) -> bool:
    try:
        request.node.path.resolve().relative_to(TESTS)
    except ValueError:
        return False
    return True


@pytest.fixture(autouse=True)
def _leak_check(request: pytest.FixtureRequest):
    """Snapshot before the test; after it (and its other function-scoped fixtures), once its
    locals are gone and garbage is collected, nothing new may be left. Polls, so a clean test
    costs no wait; a DataLoader's arena ("stoker-slot" memfds) goes when the loader is
    collected, so it is not an exception. Failures are reported as errors at teardown, with
    the list of what was left."""
    if not _leak_checked(request):
        yield None
        return
    kinds = set(KINDS) - _allowed_kinds(request.node)
    if request.node.path.resolve().relative_to(TESTS).parts[0] in STORE_TIERS:
        _warm_store_clients(request)
    before = Snapshot()
    yield before
    if request.node.stash.get(CALL_RAISED, False):
        # The test failed: its traceback (kept as sys.last_traceback) holds its frame and
        # so its loaders; the failure is the news, leftovers would only repeat it.
        return
    problems = before.wait_clean(timeout=request.config.getoption("--leak-settle"), kinds=kinds)
    if problems:
        hint = ""
        if any("stoker-slot" in p for p in problems):
            hint = " (stoker-slot descriptors: a DataLoader's arena, still referenced after the test)"
        pytest.fail(f"{request.node.nodeid} left behind: " + "; ".join(problems) + hint, pytrace=False)


@pytest.fixture
def no_leaks(_leak_check: Snapshot) -> Snapshot:
    """The snapshot the leak check (`_leak_check`, on for every test here) took before the test,
    for a test that compares against it itself."""
    return _leak_check


@pytest.fixture(params=START_METHODS)
def start_method(request):
    return request.param


@pytest.fixture(autouse=True)
def _no_worker_info_left_in_this_process():
    """Tests that run the worker loop in-process set the process-wide WorkerInfo a worker
    process would have; it must not leak into later tests (get_worker_info() in the main
    process is None), nor into the workers they fork."""
    yield
    from stoker._core import worker

    worker._process_info = None
    worker.tell_torch(None, thread=False)
