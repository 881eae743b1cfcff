"""The order of the at-fork hooks is said where they are registered, never set by which module
was imported first: hooks that stop threads (`at_fork(..., stops_threads=True)`, the lease
watch of the downloads ahead) run their `before` ahead of every other hook's, and their
`after_*` after them, so a thread being stopped never waits on a lock another hook took for the
fork (the shard cache's descriptor lock). Forks run in a fresh interpreter under a deadline."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from stoker._base.process import at_fork

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork")

CHILD_TIMEOUT_S = 120


def run_fresh(code: str) -> dict:
    """Run `code` in a new interpreter (modules imported in the order it says) and return the
    JSON it prints last."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_hooks_that_stop_threads_run_outside_the_others_whatever_the_registration_order() -> None:
    got = run_fresh(
        """
        import json, os
        from stoker._base.process import at_fork

        calls = []
        def hooks(name, **kw):
            at_fork(before=lambda: calls.append(f"before {name}"),
                    after_in_parent=lambda: calls.append(f"parent {name}"),
                    after_in_child=lambda: calls.append(f"child {name}"), **kw)

        hooks("lock 1")
        hooks("threads 1", stops_threads=True)
        hooks("lock 2")
        hooks("threads 2", stops_threads=True)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, json.dumps(calls).encode())
            os._exit(0)
        os.close(write)
        in_child = json.loads(os.read(read, 65536))
        os.waitpid(pid, 0)
        print(json.dumps({"child": in_child, "parent": calls}))
        """
    )
    befores = ["before threads 2", "before threads 1", "before lock 2", "before lock 1"]
    assert got["child"] == [*befores, "child lock 1", "child lock 2", "child threads 1", "child threads 2"]
    assert got["parent"] == [*befores, "parent lock 1", "parent lock 2", "parent threads 1", "parent threads 2"]


@pytest.mark.parametrize("first", ["ahead", "cache"])
def test_the_lease_watch_is_stopped_before_the_cache_takes_its_lock(first: str) -> None:
    # the watch is stopped in `pause_for_fork` of each live DownloadsAhead: one that records
    # whether the cache's descriptor lock is held by then stands in the registry beside them
    second = "cache" if first == "ahead" else "ahead"
    got = run_fresh(
        f"""
        import json, os
        import stoker._shards.{first}, stoker._shards.{second}
        from stoker._shards import ahead, cache

        seen = []
        class Probe:
            def pause_for_fork(self):
                seen.append(("pause", cache._FD_LOCK.locked()))
            def resume_after_fork(self):
                seen.append(("resume", cache._FD_LOCK.locked()))

        probe = Probe()
        ahead._live.add(probe)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print(json.dumps({{"seen": seen}}))
        """
    )
    assert got["seen"] == [["pause", False], ["resume", False]]


def test_stops_threads_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="stops_threads should be a bool, but got stops_threads=1"):
        at_fork(after_in_child=lambda: None, stops_threads=1)  # type: ignore[arg-type]
