"""What the saved_*_main.py rank scripts share: starting their ranks, and writing records.

`launch_world(...)` is the test's side: it runs this module's `launch` for a script inside a
loopback-only network namespace and returns each rank's record, failing the test with each
rank's output when the ranks did not exit as expected.

`launch(script, mode, out)` starts 2 ranks of `script MODE OUT` with torchrun's variables (gloo
on loopback; the tests run it inside a loopback-only network namespace), waits for each rank and
for every process that holds its output (its workers too, after a SIGKILL of the rank), killing
them all after `RANK_TIMEOUT_S`, and writes OUT/world-MODE.json: each rank's exit code (-9 for a
rank killed by SIGKILL) and output. torch's launcher is not used: it tears the whole job down
when a rank dies, and the tests kill ranks on purpose.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RANK_TIMEOUT_S = float(os.environ.get("RANK_TIMEOUT_S", "100"))


def write(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, whole or not at all (a kill never leaves half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def watch_for_hangs() -> None:
    """A rank that hangs prints every thread's stack and exits, before the launcher kills it."""
    faulthandler.dump_traceback_later(max(RANK_TIMEOUT_S - 10, 1), exit=True)


def launch(script: str, mode: str, out: Path, world: int = 2, port: int = 29511) -> None:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    env.update(GLOO_SOCKET_IFNAME="lo", LOCAL_WORLD_SIZE=str(world))
    procs = [
        subprocess.Popen(
            [sys.executable, script, mode, str(out)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # the rank and its workers: one group to kill
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + RANK_TIMEOUT_S
    codes, outputs = [], []
    for p in procs:
        try:
            output, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            output, _ = p.communicate()
            output += f"\n[saved_ranks] killed after {RANK_TIMEOUT_S} s"
        codes.append(p.returncode)
        outputs.append(output)
    write(out / f"world-{mode}.json", {"codes": codes, "outputs": outputs})


def main(script: str, rank_main: Any) -> None:
    """`script world MODE OUT` launches; `script MODE OUT` is one rank: `rank_main(MODE, OUT)`."""
    if sys.argv[1] == "world":
        launch(script, sys.argv[2], Path(sys.argv[3]))
        return
    watch_for_hangs()
    rank_main(sys.argv[1], Path(sys.argv[2]))


def launch_world(
    script: Path, mode: str, out: Path, timeout_s: float, label: str, expected: list[int], **env: str
) -> list[dict[str, Any]]:
    """`script world MODE OUT` in a loopback-only namespace (its ranks started by `launch`),
    with `env` added to the environment; each rank's record, OUT/MODE-RANK.json. Fails the
    test, with each rank's output, when the ranks' exit codes are not `expected`."""
    import pytest
    from tests.support.namespaces import run_in_namespace

    environment = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(sys.path),
        PYTHONWARNINGS="ignore",
        RANK_TIMEOUT_S=str(timeout_s - 15),
        **env,
    )
    run_in_namespace([str(script), "world", mode, str(out)], out, environment, timeout_s, label, grace_s=10)
    world = json.loads((out / f"world-{mode}.json").read_text())
    if world["codes"] != expected:
        ranks = enumerate(zip(world["codes"], world["outputs"]))
        outputs = "\n".join(f"--- rank {r} exited {c}:\n{o[-4000:]}" for r, (c, o) in ranks)
        pytest.fail(f"{mode}: the ranks exited {world['codes']}, not {expected}\n{outputs}")
    return [json.loads((out / f"{mode}-{rank}.json").read_text()) for rank in range(2)]
