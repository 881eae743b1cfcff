"""README "More than one machine", Ray: the example it shows is examples/ray_resume.py, and it
runs as written (in a loopback-only namespace, as the cluster tests do)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NAMESPACE, namespace_missing, ray_missing

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ray_resume.py"
TIMEOUT_S = 120


def readme_ray_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Ray: `stoker.ray`") :]
    found = re.search(r"```python\n(.*?)```\n", section, re.S)
    assert found is not None, "the README's Ray section has no python block"
    return found.group(1)


def test_readme_shows_the_example_file():
    assert readme_ray_block() == EXAMPLE.read_text()


def test_the_example_runs_as_written():
    reason = ray_missing() or namespace_missing()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), RAY_USAGE_STATS_ENABLED="0")
    command = [*NAMESPACE, "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, str(EXAMPLE)]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # --kill-child: the namespace's processes go with it
        out, err = proc.communicate()
        pytest.fail(f"examples/ray_resume.py ran past {TIMEOUT_S} s:\n{out}\n{err[-4000:]}")
    assert proc.returncode == 0, err[-4000:]
    # 1,000 samples in batches of 64 with drop_last: 15 a epoch; epoch 0 whole, 6 of epoch 1
    assert out.strip().splitlines()[-1] == "1344 samples read; 9 batches left of epoch 1"
