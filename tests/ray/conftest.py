"""One real two-node Ray cluster for the whole test session, inside a loopback-only network
namespace: `cluster_run` starts `cluster_session.py` there once (with a hard timeout that kills
every process of the namespace) and hands its JSON to the tests that judge it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
HARD_TIMEOUT_S = 240  # the whole cluster session; it takes ~60 s on 2 cores
NAMESPACE = ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child", "--"]
ELSEWHERE = '''
import stoker


class Elsewhere(stoker.Dataset):
    """Importable in the driver only (its directory is on the driver's sys.path alone)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i
'''


def ray_missing() -> str | None:
    """Why the cluster tests cannot run for want of Ray, or None."""
    try:
        importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return "ray is not installed (pip install 'stoker[ray]')"
    return None


def namespace_missing() -> str | None:
    """Why a loopback-only network namespace cannot be made here, or None."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip (util-linux, iproute2) is not installed"
    try:
        done = subprocess.run(
            [*NAMESPACE, "sh", "-c", "ip link set lo up && ip -o link show"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a network namespace: {exc}"
    if done.returncode != 0:
        return f"cannot make a network namespace (root or CAP_SYS_ADMIN needed): {done.stderr.strip()}"
    links = [line.split(":")[1].strip() for line in done.stdout.splitlines() if ":" in line]
    if links != ["lo"]:
        return f"the new network namespace has interfaces {links}, not only lo"
    return None


def leftover_processes(marker: str) -> list[Any]:
    """Processes on this machine whose command line names `marker` (the cluster's temp dir)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


def run_cluster_session(scenarios: str | None = None) -> tuple[dict[str, Any], str]:
    """Run cluster_session.py in a fresh namespace; (its JSON, its output)."""
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live in it
    elsewhere = tempfile.mkdtemp(prefix="stoker-elsewhere-")
    Path(elsewhere, "elsewhere_dataset.py").write_text(textwrap.dedent(ELSEWHERE))
    out = Path(temp_dir, "results.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(SRC)]), RAY_USAGE_STATS_ENABLED="0")
    if scenarios:
        env["STOKER_RAY_SCENARIOS"] = scenarios
    command = [
        *NAMESPACE,
        "sh",
        "-c",
        'ip link set lo up && exec "$0" "$@"',
        sys.executable,
        str(HERE / "cluster_session.py"),
        str(out),
        temp_dir,
        elsewhere,
    ]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # unshare --kill-child: killing unshare kills the namespace's first process, and with it
        # every process of the namespace
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        for left in leftover_processes(temp_dir):
            left.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(elsewhere, ignore_errors=True)
        pytest.fail(f"the Ray cluster session ran past {HARD_TIMEOUT_S} s and was killed:\n{output[-6000:]}")
    try:
        if proc.returncode != 0 or not out.exists():
            pytest.fail(f"the Ray cluster session failed (exit {proc.returncode}):\n{output[-6000:]}")
        results = json.loads(out.read_text())
        results["left_on_host"] = [" ".join(p.cmdline())[:160] for p in leftover_processes(temp_dir)]
        return results, output
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(elsewhere, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster_run() -> dict[str, Any]:
    """The cluster session's results (run once per test session)."""
    reason = ray_missing() or namespace_missing()
    if reason:
        pytest.skip(reason)
    results, _ = run_cluster_session()
    return results


@pytest.fixture
def scenario(cluster_run: dict[str, Any], request: pytest.FixtureRequest) -> Any:
    """The result of the scenario named by the test's `scenario_name` marker."""
    name = request.node.get_closest_marker("scenario").args[0]
    recorded = cluster_run["scenarios"].get(name)
    assert recorded is not None, f"the cluster session did not run scenario {name!r}"
    assert recorded["ok"], f"scenario {name!r} raised in the cluster session:\n{recorded['error']}"
    return recorded["result"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "scenario(name): the cluster_session.py scenario a test judges")
