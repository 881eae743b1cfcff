from __future__ import annotations

import multiprocessing

import pytest

from leakcheck import Snapshot

START_METHODS = [m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()]


@pytest.fixture(scope="session", autouse=True)
def _multiprocessing_helpers():
    """Start multiprocessing's own helper processes (the forkserver, spawn's resource
    tracker) once, up front, so that leak checks do not mistake them for ours."""
    from multiprocessing import forkserver, resource_tracker

    if "forkserver" in START_METHODS:
        forkserver.ensure_running()
    resource_tracker.ensure_running()
    yield


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves a child process, thread, pipe, socket or /dev/shm entry."""
    before = Snapshot()
    yield before
    problems = before.wait_clean()
    assert not problems, "; ".join(problems)


@pytest.fixture(params=START_METHODS)
def start_method(request):
    return request.param
