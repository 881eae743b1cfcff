"""Lifecycle under abuse: the main process killed or interrupted, iterators dropped by the
hundred, few file descriptors, a small shared-memory budget. Each runs in a child process
under a hard timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
START_METHODS = ["fork", "spawn", "forkserver"]

PRELUDE = textwrap.dedent(
    f"""
    import gc, json, os, sys, time, warnings
    import numpy as np
    sys.path.insert(0, {TESTS!r})
    sys.path.insert(0, {HERE!r})
    import stoker
    from leakcheck import Snapshot
    from scenario import _prestart

    class Slow(stoker.Dataset):
        def __init__(self, n=10_000, delay=0.01, shape=(4,)):
            self.n, self.delay, self.shape = n, delay, shape
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            time.sleep(self.delay)
            return np.full(self.shape, i % 251, np.uint8)
    """
)


def write_script(tmp_path, body: str) -> str:
    path = tmp_path / "child.py"
    main = textwrap.indent(textwrap.dedent(body), "    ")
    path.write_text(PRELUDE + '\nif __name__ == "__main__":\n' + main)
    return str(path)


def result_of(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


def read_line(proc: subprocess.Popen, prefix: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"child never printed {prefix!r}; stderr: {proc.stderr.read()}")


def wait_gone(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


MID_EPOCH = """
    method = sys.argv[1]
    _prestart(method)
    loader = stoker.DataLoader(Slow(), batch_size=2, num_workers=2, multiprocessing_context=method)
    it = iter(loader)
    next(it)
    import psutil
    workers = [p.pid for p in psutil.Process().children() if p.pid != os.getpid()]
    if method == "forkserver":  # the workers are forks of the server, not of us
        servers = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
        workers = [p.pid for server in servers for p in server.children()]
    print("WORKERS " + json.dumps(workers), flush=True)
    for batch in it:
        pass
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", START_METHODS)
def test_main_process_sigkilled_mid_epoch_takes_its_workers_along(tmp_path, method: str) -> None:
    script = write_script(tmp_path, MID_EPOCH)
    proc = subprocess.Popen([sys.executable, script, method], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = json.loads(read_line(proc, "WORKERS "))
        assert len(workers) >= 2, workers
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        left = wait_gone(workers, within=5.0)
        assert not left, f"workers {left} outlived their SIGKILLed parent by 5 s ({method})"
    finally:
        proc.kill()
        proc.wait()
    # forkserver's server and spawn's resource tracker are multiprocessing's own: they end
    # when their pipes close, which the kill did.


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", START_METHODS)
def test_sigint_mid_epoch_exits_cleanly(tmp_path, method: str) -> None:
    script = write_script(tmp_path, MID_EPOCH)
    proc = subprocess.Popen([sys.executable, script, method], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = json.loads(read_line(proc, "WORKERS "))
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=5)
        took = time.monotonic() - start
        stderr = proc.stderr.read()
        assert "KeyboardInterrupt" in stderr, stderr
        assert took < 5
        assert not wait_gone(workers, within=5.0)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(120)
def test_two_hundred_iterators_dropped_half_way_leave_nothing(tmp_path) -> None:
    script = write_script(
        tmp_path,
        """
        import psutil, threading
        me = psutil.Process()
        loader = stoker.DataLoader(Slow(n=64, delay=0), batch_size=4, num_workers=2)
        def state():
            gc.collect()
            return (len(me.children(recursive=True)), threading.active_count(), me.num_fds(), me.memory_info().rss)
        for i in range(10):  # warm-up: imports, allocator pools
            it = iter(loader); next(it); del it
        time.sleep(0.5)
        before = state()
        snap = Snapshot()
        for i in range(200):
            it = iter(loader)
            next(it)
            next(it)
            del it
        problems = snap.wait_clean(timeout=10)
        after = state()
        print("RESULT " + json.dumps({"before": before, "after": after, "problems": problems}), flush=True)
        """,
    )
    result = result_of(subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=110))
    assert result["problems"] == []
    before, after = result["before"], result["after"]
    assert after[0] <= before[0] and after[1] <= before[1] and after[2] <= before[2], (before, after)
    assert after[3] - before[3] < 50 * 2**20, f"RSS grew by {(after[3] - before[3]) / 2**20:.0f} MiB"


@pytest.mark.timeout(90)
def test_interpreter_exit_with_live_iterators_is_clean(tmp_path) -> None:
    script = write_script(
        tmp_path,
        """
        import psutil
        persistent = stoker.DataLoader(Slow(), batch_size=2, num_workers=2, persistent_workers=True)
        plain = stoker.DataLoader(Slow(), batch_size=2, num_workers=2)
        a, b = iter(persistent), iter(plain)
        next(a); next(b)
        print("WORKERS " + json.dumps([p.pid for p in psutil.Process().children()]), flush=True)
        # fall off the end of the script with both iterators alive
        """,
    )
    proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = json.loads(read_line(proc, "WORKERS "))
        assert len(workers) == 4
        assert proc.wait(timeout=10) == 0, proc.stderr.read()
        assert not wait_gone(workers, within=5.0)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(90)
def test_persistent_loader_deleted_stops_its_workers(tmp_path) -> None:
    script = write_script(
        tmp_path,
        """
        import psutil
        snap = Snapshot()
        loader = stoker.DataLoader(Slow(n=20, delay=0), batch_size=2, num_workers=2, persistent_workers=True)
        for epoch in range(3):
            assert len(list(loader)) == 10
        pids = sorted(p.pid for p in psutil.Process().children())
        for epoch in range(2):
            for i, batch in enumerate(loader):
                if i == 3:
                    break  # leave the epoch half-way; the next one must still be whole
        assert sorted(p.pid for p in psutil.Process().children()) == pids, "persistent workers were replaced"
        assert len(list(loader)) == 10
        del loader, batch
        print("RESULT " + json.dumps({"problems": snap.wait_clean(timeout=10)}), flush=True)
        """,
    )
    result = result_of(subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=80))
    assert result["problems"] == []


@pytest.mark.timeout(120)
def test_works_under_ulimit_of_64_file_descriptors(tmp_path) -> None:
    script = write_script(
        tmp_path,
        """
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        loader = stoker.DataLoader(Slow(n=500 * 64, delay=0, shape=(3, 32, 32)), batch_size=64, num_workers=2)
        kept = []
        count = 0
        for i, batch in enumerate(loader):
            assert batch.shape == (64, 3, 32, 32) and int(batch[0, 0, 0, 0]) == (i * 64) % 251
            count += 1
            if i % 50 == 0:
                kept.append(batch)  # some batches stay alive: their slots must not cost fds
        print("RESULT " + json.dumps({"batches": count, "fds": len(os.listdir("/proc/self/fd"))}), flush=True)
        """,
    )
    result = result_of(subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=110))
    assert result["batches"] == 500
    assert result["fds"] < 64


@pytest.mark.timeout(120)
def test_small_arena_budget_falls_back_with_one_warning_and_correct_values(tmp_path) -> None:
    script = write_script(
        tmp_path,
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = stoker.DataLoader(Slow(n=40, delay=0, shape=(1024, 1024)), batch_size=4, num_workers=2)
            kept = list(loader)  # the user keeps every 4 MiB batch
        ok = all(int(b[j, 0, 0]) == (i * 4 + j) % 251 and b.shape == (4, 1024, 1024)
                 for i, b in enumerate(kept) for j in range(4))
        fallback = [str(w.message) for w in caught if "shared memory" in str(w.message)]
        print("RESULT " + json.dumps({"ok": ok, "batches": len(kept), "fallback": fallback}), flush=True)
        """,
    )
    env = dict(os.environ, STOKER_ARENA_MAX_BYTES=str(10 * 2**20))
    result = result_of(subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=110, env=env))
    assert result["ok"] and result["batches"] == 10
    assert len(result["fallback"]) == 1, result["fallback"]
    assert "STOKER_ARENA_MAX_BYTES" in result["fallback"][0]
