"""The mixed-and-packed resume scenario of tests/mix/test_elastic.py, run inside a loopback-only
network namespace (torch's TCPStore listens on every interface).

The stream: three token sources mixed by tokens under a three-piece weight schedule, packed
best-fit into rows of SEQ_LEN tokens, walked by `StreamSampler(drop_last=True)` and read with
stoker.torch's DataLoader and `collate_packed`. `python elastic_main.py OUT` runs, each rank a
process with torchrun's variables (gloo on loopback):

- reference: 4 ranks x 2 workers read the epoch;
- killed: 4 ranks x 2 workers read in lock-step (a barrier per step, as gradient all-reduce
  would), save `loader.state_dict()` after each step, and SIGKILL themselves after step KILL_AT;
- resumed-2: 2 ranks x 3 workers each load the state killed rank 0 saved and read the rest;
- resumed-1: 1 rank, no workers, loads the same state and reads the rest.

`python elastic_main.py rank MODE OUT` is one rank. What each rank read (a fingerprint of each
row, step by step) goes to OUT/<mode>-<rank>.json, the exit codes and each world's seconds to
OUT/report.json; the scenario exits non-zero if a rank's exit code is not the one its mode
expects.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

SIZES = (400, 250, 150)  # documents of each source
SCHEDULE = [(0, [0.5, 0.3, 0.2]), (300, [0.2, 0.3, 0.5]), (600, [0.3, 0.4, 0.3])]
SEQ_LEN = 512
WINDOW = 64
SEED = 3
BATCH = 4
KILL_AT = 13  # of 36 steps a rank takes in the 4-rank epoch (576 rows)
TIMEOUT_S = 90  # for each world
WORLDS = {"reference": (4, 2), "killed": (4, 2), "resumed-2": (2, 3), "resumed-1": (1, 0)}  # ranks, workers
FIELDS = ("input_ids", "position_ids", "segment_ids", "labels")


def build(schedule: list[tuple[int, list[float]]] = SCHEDULE) -> Any:
    """The packed rows every rank (and the test) builds from the construction arguments alone."""
    import numpy as np

    from stoker.mix import MixedDataset, PackedDataset, TokenDataset

    rng = np.random.default_rng(0)
    sources = [
        TokenDataset.from_documents([rng.integers(1, 30000, rng.integers(5, 700)) for _ in range(n)]) for n in SIZES
    ]
    mix = MixedDataset(sources, schedule, weigh="tokens", seed=SEED)
    return PackedDataset(mix, seq_len=SEQ_LEN, window_size=WINDOW, method="best_fit")


def fingerprint(row: dict[str, Any]) -> str:
    """One packed row's content: its tokens, positions, segments and labels."""
    import numpy as np

    digest = hashlib.sha256()
    for key in FIELDS:
        digest.update(np.ascontiguousarray(np.asarray(row[key]), dtype=np.int64).tobytes())
    return digest.hexdigest()


def rank(mode: str, out: Path) -> None:
    import torch.distributed as dist

    import stoker.torch as st
    from stoker.mix import StreamSampler, collate_packed

    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    me, ranks = dist.get_rank(), dist.get_world_size()
    rows = build()
    sampler = StreamSampler(rows, drop_last=True)  # world and rank from torch.distributed
    assert (sampler.num_replicas, sampler.rank) == (ranks, me)
    loader = st.DataLoader(
        rows, batch_size=BATCH, sampler=sampler, collate_fn=collate_packed, num_workers=WORLDS[mode][1]
    )
    if mode.startswith("resumed"):
        loader.load_state_dict(json.loads((out / "state-0.json").read_text()))
    sampler.set_epoch(0)
    read: list[list[str]] = []
    for step, batch in enumerate(loader):
        read.append([fingerprint({k: batch[k][i] for k in FIELDS}) for i in range(len(batch["input_ids"]))])
        (out / f"{mode}-{me}.json").write_text(json.dumps(read))
        if mode == "killed":
            saved = out / f"state-{me}.json.new"
            saved.write_text(json.dumps(loader.state_dict()))
            saved.replace(out / f"state-{me}.json")
        dist.barrier()
        if mode == "killed" and step + 1 == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()


def world(mode: str, out: Path) -> list[int]:
    """Run a world's ranks to their end; if one exits otherwise than its mode expects, or the
    world runs past TIMEOUT_S, kill the others."""
    ranks = WORLDS[mode][0]
    expected = -signal.SIGKILL if mode == "killed" else 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for r in range(ranks):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(subprocess.Popen([sys.executable, __file__, "rank", mode, str(out)], env=env))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: ranks did not finish in {TIMEOUT_S} s")
            if any(p.returncode not in (None, expected) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def scenario(out: Path) -> None:
    codes: dict[str, list[int]] = {}
    seconds: dict[str, float] = {}
    for mode in WORLDS:
        start = time.monotonic()
        codes[mode] = world(mode, out)
        seconds[mode] = round(time.monotonic() - start, 2)
        if codes[mode] != [-signal.SIGKILL if mode == "killed" else 0] * WORLDS[mode][0]:
            break
    (out / "report.json").write_text(json.dumps({"codes": codes, "seconds": seconds}))
    if len(codes) < len(WORLDS):
        raise SystemExit(f"a rank exited otherwise than expected: {codes}")


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank(sys.argv[2], Path(sys.argv[3]))
    else:
        scenario(Path(sys.argv[1]))
