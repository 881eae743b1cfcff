"""Network namespaces for tests that listen on a port: a process started inside one with only
the loopback interface up cannot be reached from outside this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

# run a command inside: ["unshare", "-n", "--", "sh", "-c", LOOPBACK_UP, program, *arguments]
LOOPBACK_UP = 'ip link set lo up && exec "$0" "$@"'


def loopback_only() -> str | None:
    """Why a loopback-only network namespace cannot be made here, or None."""
    try:
        made = subprocess.run(
            ["unshare", "-n", "--", "sh", "-c", "ip link set lo up"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -n could not run: {exc}"
    return None if made.returncode == 0 else f"unshare -n failed: {made.stderr.strip()}"


def processes_of(out: Path) -> list[psutil.Process]:
    """Everything with `out` on its command line (a launcher, its ranks), and their children."""
    found: dict[int, psutil.Process] = {}
    for process in psutil.process_iter(["cmdline"]):
        try:
            if process.pid != os.getpid() and str(out) in " ".join(process.info["cmdline"] or []):
                for p in [process, *process.children(recursive=True)]:
                    found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return list(found.values())


def _kill(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run_in_namespace(
    program: list[str], out: Path, env: dict[str, str], timeout_s: float, what: str, grace_s: float = 0.0
) -> subprocess.CompletedProcess[str]:
    """Run `python program...` in a loopback-only namespace, in `out` (whose path every process
    of the run carries on its command line). Fails the test if it runs past `timeout_s` (after
    killing what it started), exits otherwise than 0, or leaves a process alive `grace_s`
    seconds after it returned (which is then killed)."""
    command = ["unshare", "-n", "--", "sh", "-c", LOOPBACK_UP, sys.executable, *program]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=out, start_new_session=True
        )
    except subprocess.TimeoutExpired as exc:
        _kill(processes_of(out))
        pytest.fail(f"{what} did not finish in {timeout_s} s:\n{_text(exc.stderr)[-8000:]}")
    _, alive = psutil.wait_procs(processes_of(out), timeout=grace_s) if grace_s else ([], processes_of(out))
    _kill(alive)
    assert done.returncode == 0, f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    assert not alive, f"{what} left processes behind: {[p.pid for p in alive]}"
    return done
