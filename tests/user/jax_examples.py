"""Runs one program as several JAX processes, for tests/user/test_user_jax.py (the JAX guide's
`jax.distributed` example, which a user starts once per process with its index).

`python jax_examples.py SCRIPT PROCESSES TIMEOUT_S` starts `python SCRIPT 0` ...
`python SCRIPT PROCESSES-1` in the current folder, waits for them all (killing every one of
them, their workers included, if any runs past TIMEOUT_S) and writes world.json there: each
process's exit code (None: killed at the timeout) and output. The test runs it inside a
loopback-only network namespace, so the coordinator's port cannot be reached from outside.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main(script: str, processes: int, timeout_s: float) -> None:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the program sets its own device count
    children = [
        subprocess.Popen(
            [sys.executable, script, str(index)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # its own group: a kill reaches its workers too
        )
        for index in range(processes)
    ]
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    outputs: list[str] = []
    for child in children:
        try:
            output, _ = child.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            codes.append(child.returncode)
        except subprocess.TimeoutExpired:
            for other in children:
                try:
                    os.killpg(other.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            output, _ = child.communicate()
            output += f"\n[jax_examples] killed after {timeout_s} s"
            codes.append(None)
        outputs.append(output)
    Path("world.json").write_text(json.dumps({"codes": codes, "outputs": outputs}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
