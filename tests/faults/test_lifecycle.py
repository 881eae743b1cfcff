"""Lifecycle under abuse: the main process killed or interrupted, iterators dropped by the
hundred, few file descriptors, a small shared-memory budget. Each runs in a child process
under a hard timeout."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from tests.support.leakcheck import shm_left

from stoker._core.parent import ORPHANED_EXIT

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repo root: tests.support
START_METHODS = ["fork", "spawn", "forkserver"]
# Bounds on a hang, not pass marks for speed: a process that should end, or a child that should
# exit, is waited for at most this long (polled, so a prompt one costs no wait); generous because
# a machine busy with other work may take seconds to schedule a teardown.
HANG_S = 30

PRELUDE = textwrap.dedent(
    f"""
    import signal
    # Ctrl-C as a terminal delivers it, whatever this child inherited: a shell's background job
    # starts its children with SIGINT ignored, and then neither a SIGINT nor a Ctrl-C does anything
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import gc, json, os, sys, time, warnings
    import numpy as np
    sys.path.insert(0, {ROOT!r})
    sys.path.insert(0, {HERE!r})
    import stoker
    from tests.support.leakcheck import Snapshot
    from scenario import _prestart

    class Slow(stoker.Dataset):
        def __init__(self, n=10_000, delay=0.01, shape=(4,)):
            self.n, self.delay, self.shape = n, delay, shape
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            time.sleep(self.delay)
            return np.full(self.shape, i % 251, np.uint8)

    class Stuck(stoker.Dataset):
        # every sample takes a minute, sleeping or (hold_gil) in a C call that keeps the GIL;
        # a worker marks its arrival in `where`
        def __init__(self, where, hold_gil=False):
            self.where, self.hold_gil = where, hold_gil
        def __len__(self):
            return 100
        def __getitem__(self, i):
            open(os.path.join(self.where, str(os.getpid())), "w").close()
            if self.hold_gil:
                import ctypes
                ctypes.PyDLL(None).sleep(60)  # libc's sleep, called without releasing the GIL
            else:
                time.sleep(60)

    def wait_busy(where, count, within=60):
        deadline = time.monotonic() + within
        while len(os.listdir(where)) < count:
            assert time.monotonic() < deadline, "workers never got busy"
            time.sleep(0.02)

    def wait_dead(pid, within=60):
        # until the process has exited (a zombie not yet reaped counts)
        import psutil
        deadline = time.monotonic() + within
        while True:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return
            except psutil.NoSuchProcess:
                return
            assert time.monotonic() < deadline, f"process {{pid}} did not die"
            time.sleep(0.01)

    def worker_pids(method):
        # our worker processes (not multiprocessing's resource tracker or forkserver)
        import psutil
        me = psutil.Process()
        def ours(p):
            cmd = " ".join(p.cmdline())
            return "resource_tracker" not in cmd and "forkserver" not in cmd
        if method == "forkserver":  # the workers are forks of the server, not of us
            servers = [p for p in me.children() if "forkserver" in " ".join(p.cmdline())]
            return [p.pid for server in servers for p in server.children()]
        return [p.pid for p in me.children() if ours(p)]
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
    """The child's first stdout line starting with `prefix`; a hard timeout, even if the child
    hangs without printing (the read happens on a helper thread)."""
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise AssertionError(f"child printed no {prefix!r} within {timeout} s") from None
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
        if not line:
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
    threads = method == "threads"
    _prestart(None if threads else method)
    kwargs = {"thread_pool": True} if threads else {"multiprocessing_context": method}
    loader = stoker.DataLoader(Slow(), batch_size=2, num_workers=2, **kwargs)
    it = iter(loader)
    next(it)
    workers = worker_pids(method)
    print("WORKERS " + json.dumps(workers), flush=True)
    for batch in it:
        pass
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", START_METHODS)
def test_main_process_sigkilled_mid_epoch_takes_its_workers_along(tmp_path, method: str) -> None:
    script = write_script(tmp_path, MID_EPOCH)
    shm_before = set(os.listdir("/dev/shm"))
    with child_with_workers(script, method) as (proc, workers):
        assert len(workers) == 2, workers
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=HANG_S)
        left = wait_gone(workers, within=HANG_S)
        assert not left, f"workers {left} outlived their SIGKILLed parent by {HANG_S} s ({method})"
        left_shm = shm_left(shm_before, [proc.pid, *workers])
        assert not left_shm, f"a SIGKILL must leave nothing in /dev/shm: {left_shm}"
    # forkserver's server and spawn's resource tracker are multiprocessing's own: they end
    # when their pipes close, which the kill did.


BUSY = """
    import threading
    method, where, options = sys.argv[1], sys.argv[2], sys.argv[3:]
    _prestart(method)
    if "helpers" in options:  # multiprocessing's helpers run in this process, whatever the method
        from multiprocessing import forkserver, resource_tracker
        resource_tracker.ensure_running()
        forkserver.ensure_running()
    def consume():
        dataset = Stuck(where, hold_gil="gil" in options)
        loader = stoker.DataLoader(dataset, num_workers=2, multiprocessing_context=method)
        it = iter(loader)
        wait_busy(where, 2)  # both workers are inside a sample that will not finish
        print("WORKERS " + json.dumps(worker_pids(method)), flush=True)
        next(it)
    if "thread" in options:  # the loader is iterated by another thread than the main one
        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        consumer.join()
    else:
        consume()
"""


def kill_leftovers(pids: list[int]) -> None:
    """Our own test's workers, if a failed check left them running: end them by pid."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                os.kill(pid, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass


@contextlib.contextmanager
def child_with_workers(script: str, *args: str, **popen: Any) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """Run a child script until it prints its worker pids; whatever the test then does or
    asserts, the child and any worker it left are killed afterwards."""
    proc = subprocess.Popen(
        [sys.executable, script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )
    workers: list[int] = []
    try:
        workers = json.loads(read_line(proc, "WORKERS "))
        yield proc, workers
    finally:
        proc.kill()
        proc.wait()
        kill_leftovers(workers)


def helper_pids(proc: subprocess.Popen) -> dict[str, int]:
    """multiprocessing's helper processes of the child: its forkserver and resource tracker."""
    helpers = {}
    for p in psutil.Process(proc.pid).children():
        cmd = " ".join(p.cmdline())
        for name in ("forkserver", "resource_tracker"):
            if f"multiprocessing.{name} import main" in cmd:
                helpers[name] = p.pid
    return helpers


def times_to_gone(pids: dict[str, int], within: float) -> dict[str, float | None]:
    """Seconds until each process is gone (exited: a zombie counts), None if still there."""
    start = time.monotonic()
    took: dict[str, float | None] = dict.fromkeys(pids)
    while True:
        now = time.monotonic() - start
        for name, pid in pids.items():
            if took[name] is None and not wait_gone([pid], within=0):
                took[name] = now
        if all(t is not None for t in took.values()) or now > within:
            return took
        time.sleep(0.01)


def sigkill_busy_child(tmp_path, method: str, *options: str) -> None:
    """SIGKILL a child whose two workers are inside a one-minute sample: its workers and
    multiprocessing's helpers (started in the child whatever the method) go after its death
    (HANG_S is a hang guard; how soon, measured from when it is reaped, is printed)."""
    script = write_script(tmp_path, BUSY)
    where = tmp_path / "busy"
    where.mkdir()
    helpers: dict[str, int] = {}
    try:
        with child_with_workers(script, method, str(where), "helpers", *options) as (proc, workers):
            assert len(workers) == 2, workers
            helpers = helper_pids(proc)
            assert sorted(helpers) == ["forkserver", "resource_tracker"], helpers
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=HANG_S)
            watched = {**{f"worker {pid}": pid for pid in workers}, **helpers}
            took = times_to_gone(watched, within=HANG_S)
            report = ", ".join(f"{name} {'still there' if t is None else f'{t:.3f} s'}" for name, t in took.items())
            print(f"\n{method} {' '.join(options)}: gone after {report}")
            left = [name for name, t in took.items() if t is None]
            assert not left, f"{left} outlived their SIGKILLed main process by {HANG_S} s ({method} {options})"
    finally:
        kill_leftovers(list(helpers.values()))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("consumer", ["main", "thread"])
@pytest.mark.parametrize("method", START_METHODS)
def test_main_process_sigkilled_while_workers_are_busy_takes_them_along(tmp_path, method: str, consumer: str) -> None:
    """The workers are inside a long `__getitem__` (sleeping: the GIL is free), not idly
    watching their parent; the loader is iterated from the main thread or another one."""
    sigkill_busy_child(tmp_path, method, consumer)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("consumer", ["main", "thread"])
@pytest.mark.parametrize("method", START_METHODS)
def test_main_process_sigkilled_while_workers_hold_the_gil_takes_them_along(
    tmp_path, method: str, consumer: str
) -> None:
    """The same, with the workers inside a C call that keeps the GIL: no Python code runs
    in them (the watchdog thread cannot), only the kernel can end them."""
    sigkill_busy_child(tmp_path, method, consumer, "gil")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("watchdog", ["pidfd", "polling"])
def test_parent_watchdog_ends_its_process_with_the_main_one_and_tells_a_reused_pid(tmp_path, watchdog: str) -> None:
    """The watchdog on its own, as under forkserver (the watched process is not our parent):
    a pid whose start time differs is not the main process; once the main process has
    exited (a zombie, not yet reaped), the watchdog ends ours at once."""
    script = write_script(
        tmp_path,
        """
        import subprocess
        from stoker._core import parent as _parent
        if sys.argv[1] == "polling":
            del os.pidfd_open  # as on a kernel older than 5.3
        # the stand-in main process lives until killed, or until we are gone (EOF on its stdin)
        main = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        started = _parent._start_time(main.pid)
        reused = _parent.ParentWatch(main.pid, "forkserver", False, started - 1).arm()
        check = _parent.ParentWatch(main.pid, "forkserver", False, started).arm()
        threads = sorted(t.name for t in __import__("threading").enumerate())
        print("RESULT " + json.dumps({"reused": reused is None, "alive": check is not None and check(),
                                      "threads": threads}), flush=True)
        main.kill()  # and not reaped: it stays a zombie while we live
        print(f"KILLED {time.monotonic()}", flush=True)
        time.sleep(60)
        print("SURVIVED", flush=True)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, script, watchdog], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=90)
        ended = time.monotonic()
    finally:
        proc.kill()
        proc.wait()
    result = json.loads(read_line_of(stdout, "RESULT "))
    assert result["reused"], "a pid with another start time was taken for the main process"
    assert result["alive"] and "stoker-parent-watch" in result["threads"], result
    assert "SURVIVED" not in stdout and proc.returncode == ORPHANED_EXIT, (proc.returncode, stdout, stderr)
    # ended by the watchdog (its exit code) before its 60 s sleep ran out ("SURVIVED");
    # how soon is a figure, not a pass mark
    took = ended - float(read_line_of(stdout, "KILLED "))
    print(f"\n{watchdog} watchdog: ended its process {took:.3f} s after the main one was killed")


def read_line_of(output: str, prefix: str) -> str:
    lines = [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]
    assert lines, f"no {prefix!r} line in:\n{output}"
    return lines[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", [*START_METHODS, "threads"])
def test_sigint_mid_epoch_exits_cleanly(tmp_path, method: str) -> None:
    script = write_script(tmp_path, MID_EPOCH)
    with child_with_workers(script, method) as (proc, workers):
        assert len(workers) == (0 if method == "threads" else 2), workers
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=HANG_S)  # no hang
        stderr = proc.stderr.read()
        assert proc.returncode != 0 and "KeyboardInterrupt" in stderr, stderr
        assert stderr.count("Traceback") == 1 and "Exception ignored" not in stderr, stderr
        assert not wait_gone(workers, within=HANG_S)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("method", "busy"), [("fork", False), ("fork", True), ("spawn", True)])
def test_ctrl_c_to_the_whole_process_group(tmp_path, method: str, busy: bool) -> None:
    """A terminal's Ctrl-C reaches the workers too; only the main process may react to it."""
    where = tmp_path / "busy"
    where.mkdir()
    script = write_script(tmp_path, BUSY if busy else MID_EPOCH)
    with child_with_workers(script, method, str(where), start_new_session=True) as (proc, workers):
        assert len(workers) == 2, workers
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=HANG_S)  # no hang
        stderr = proc.stderr.read()
        assert proc.returncode != 0 and "KeyboardInterrupt" in stderr, stderr
        assert stderr.count("Traceback") == 1, f"workers must not print tracebacks of their own:\n{stderr}"
        assert not wait_gone(workers, within=HANG_S)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("engine", [*START_METHODS, "threads"])
def test_iterator_dropped_half_way_stops_its_workers(tmp_path, engine: str) -> None:
    script = write_script(
        tmp_path,
        """
        engine = sys.argv[1]
        kwargs = {"thread_pool": True} if engine == "threads" else {"multiprocessing_context": engine}
        _prestart(None if engine == "threads" else engine)
        snap = Snapshot()
        loader = stoker.DataLoader(Slow(n=400, delay=0.001), batch_size=2, num_workers=2, **kwargs)
        seen = []
        for i, batch in enumerate(loader):
            seen.append(int(batch[0, 0]))
            if i == 10:
                break  # the loop's iterator is dropped here, with work still in flight
        start = time.monotonic()
        del batch
        gc.collect()
        # workers, threads and pipes go with the iterator; the loader keeps its
        # shared-memory slots (one descriptor each) for its next epoch
        problems = snap.wait_clean(timeout=10, allow="stoker-slot")
        took = time.monotonic() - start
        del loader
        problems += snap.wait_clean(timeout=10)
        again = [int(b[0, 0]) for b in stoker.DataLoader(Slow(n=8, delay=0), batch_size=2, num_workers=2, **kwargs)]
        problems += snap.wait_clean(timeout=10)
        print("RESULT " + json.dumps({"seen": seen, "problems": problems, "took": took, "again": again}), flush=True)
        """,
    )
    proc = subprocess.run([sys.executable, script, engine], capture_output=True, text=True, timeout=60)
    result = result_of(proc)
    assert result["seen"] == [(2 * i) % 251 for i in range(11)]
    assert result["problems"] == [], result["problems"]
    assert result["again"] == [0, 2, 4, 6], "a new loader must work after the dropped one"
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_two_hundred_iterators_dropped_half_way_leave_nothing(tmp_path) -> None:
    script = write_script(
        tmp_path,
        """
        import psutil, threading
        me = psutil.Process()
        loader = stoker.DataLoader(Slow(n=64, delay=0), batch_size=4, num_workers=2, multiprocessing_context="fork")
        def state():
            gc.collect()
            return (len(me.children(recursive=True)), threading.active_count(), me.num_fds(), me.memory_info().rss)
        warm = Snapshot()
        for i in range(10):  # warm-up: imports, allocator pools, the loader's arena
            it = iter(loader); next(it); del it
        assert not warm.wait_clean(timeout=60, allow="stoker-slot")  # the warm-up's workers are gone
        before = state()
        snap = Snapshot()
        states = []
        for i in range(200):
            it = iter(loader)
            next(it)
            next(it)
            del it
            if i in (99, 199):
                states.append(state())
        problems = snap.wait_clean(timeout=10, allow="stoker-slot")
        after = state()
        slots = len(loader._arena.slots.maps)
        del loader
        problems += snap.wait_clean(timeout=10)
        print("RESULT " + json.dumps({"before": before, "after": after, "states": states, "slots": slots,
                                      "problems": problems}), flush=True)
        """,
    )
    result = result_of(subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=110))
    assert result["problems"] == []
    before, after = result["before"], result["after"]
    assert after[0] <= before[0] and after[1] <= before[1], (before, after)
    # The loader's arena keeps one descriptor per slot; it may reach its working size (at most
    # the window of 4 batches plus one per worker) but does not grow with the iterators.
    mid, end = result["states"]
    assert end[2] <= mid[2] and after[2] <= before[2] + 6, (before, mid, end, after)
    assert result["slots"] <= 4 + 2 + 2, result["slots"]
    assert after[3] - before[3] < 50 * 2**20, f"RSS grew by {(after[3] - before[3]) / 2**20:.0f} MiB"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", START_METHODS)
def test_interpreter_exit_with_live_iterators_is_clean(tmp_path, method: str) -> None:
    script = write_script(
        tmp_path,
        """
        method = sys.argv[1]
        _prestart(method)
        persistent = stoker.DataLoader(Slow(), batch_size=2, num_workers=2, persistent_workers=True,
                                       multiprocessing_context=method)
        plain = stoker.DataLoader(Slow(), batch_size=2, num_workers=2, multiprocessing_context=method)
        a, b = iter(persistent), iter(plain)
        next(a); next(b)
        print("WORKERS " + json.dumps(worker_pids(method)), flush=True)
        # fall off the end of the script with both iterators alive
        """,
    )
    shm_before = set(os.listdir("/dev/shm"))
    with child_with_workers(script, method) as (proc, workers):
        assert len(workers) == 4, workers
        assert proc.wait(timeout=HANG_S) == 0  # no hang
        stderr = proc.stderr.read()
        for noise in ("Traceback", "Exception ignored", "leaked", "Error"):
            assert noise not in stderr, f"exit was not clean:\n{stderr}"
        assert not wait_gone(workers, within=HANG_S)
        assert not shm_left(shm_before, [proc.pid, *workers])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", START_METHODS)
def test_persistent_loader_deleted_stops_its_workers(tmp_path, method: str) -> None:
    script = write_script(
        tmp_path,
        """
        method = sys.argv[1]
        _prestart(method)
        snap = Snapshot()
        loader = stoker.DataLoader(Slow(n=20, delay=0), batch_size=2, num_workers=2, persistent_workers=True,
                                   multiprocessing_context=method)
        epochs = []
        for epoch in range(3):
            epochs.append([int(b[0, 0]) for b in loader])
        pids = sorted(worker_pids(method))
        for epoch in range(2):
            for i, batch in enumerate(loader):
                if i == 3:
                    break  # leave the epoch half-way; the next one must still be whole
        same = sorted(worker_pids(method)) == pids and len(pids) == 2
        epochs.append([int(b[0, 0]) for b in loader])
        del loader, batch
        gc.collect()
        start = time.monotonic()
        problems = snap.wait_clean(timeout=10)
        took = time.monotonic() - start
        print("RESULT " + json.dumps({"problems": problems, "epochs": epochs, "same": same, "took": took}), flush=True)
        """,
    )
    result = result_of(subprocess.run([sys.executable, script, method], capture_output=True, text=True, timeout=60))
    assert result["epochs"] == [list(range(0, 20, 2))] * 4
    assert result["same"], "persistent workers were replaced"
    assert result["problems"] == [], result["problems"]


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
@pytest.mark.parametrize("limit", [1_000_000, 10 * 2**20])
def test_small_arena_budget_falls_back_with_one_warning_and_correct_values(tmp_path, limit: int) -> None:
    # 1 MB: not even one 4 MiB batch fits, every batch falls back; 10 MiB: the first two fit
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
    env = dict(os.environ, STOKER_ARENA_MAX_BYTES=str(limit))
    result = result_of(subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=110, env=env))
    assert result["ok"] and result["batches"] == 10
    assert len(result["fallback"]) == 1, result["fallback"]
    assert "STOKER_ARENA_MAX_BYTES" in result["fallback"][0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_persistent_worker_killed_between_epochs(tmp_path, method: str) -> None:
    """The next epoch reports the death at once; the one after starts fresh workers."""
    script = write_script(
        tmp_path,
        """
        import signal
        method = sys.argv[1]
        _prestart(method)
        snap = Snapshot()
        loader = stoker.DataLoader(Slow(n=12, delay=0), batch_size=None, num_workers=2, persistent_workers=True,
                                   multiprocessing_context=method)
        out = {"epoch1": [int(b[0]) for b in loader]}
        first = sorted(worker_pids(method))
        os.kill(first[1], signal.SIGKILL)
        wait_dead(first[1])
        start = time.monotonic()
        try:
            out["epoch2"] = [int(b[0]) for b in loader]
        except Exception as exc:
            out["error"] = (type(exc).__name__, str(exc), time.monotonic() - start)
        out["epoch3"] = [int(b[0]) for b in loader]
        second = sorted(worker_pids(method))
        out["killed"], out["replaced"] = first[1], len(second) == 2 and not set(second) & set(first)
        del loader
        gc.collect()
        out["problems"] = snap.wait_clean(timeout=10)
        print("RESULT " + json.dumps(out), flush=True)
        """,
    )
    result = result_of(subprocess.run([sys.executable, script, method], capture_output=True, text=True, timeout=60))
    assert result["epoch1"] == list(range(12))
    assert "epoch2" not in result, "an epoch ran on a dead worker"
    name, message, _ = result["error"]
    assert name == "WorkerDiedError" and f"(pid {result['killed']})" in message and "SIGKILL" in message, message
    assert result["epoch3"] == list(range(12)) and result["replaced"]
    assert result["problems"] == [], result["problems"]
