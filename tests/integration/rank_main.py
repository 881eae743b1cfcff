"""Training ranks for tests/integration/test_ranks.py.

`python rank_main.py world N MODE OUT` starts N ranks (`python rank_main.py MODE OUT` with
torchrun's variables) and waits for them; the test runs it inside a network namespace with
only the loopback interface, as torch's TCPStore listens on every interface. Each rank
initialises torch.distributed with the gloo backend on loopback. Modes:

- cover: a DistributedSampler(seed=None) epoch through stoker.torch workers, and an
  IterableDataset sharded with `stoker.shard_for`; writes what each sample saw.
- uneven: rank r first builds r loaders of its own (with samplers of seed=None) that the
  other ranks do not build, then the shared one, and reads an epoch of it: no constructor
  may wait for the other ranks.
- train: reads batches in lock-step with the other ranks (a barrier per step, as gradient
  all-reduce would), saves `loader.state_dict()` after each step, and SIGKILLs itself after
  step KILL_AT (its workers must go with it).
- resume: loads the state saved by rank STATE_FROM ("own": its own rank's) of the killed run,
  reads to the end and writes what it read to OUT/<RESUMED_AS><rank>.json.

Every rank seeds torch's global RNG alike first, as a DDP script does for its model: the
loaders' base seeds come from it, so the per-sample draws agree across ranks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stoker
import stoker.torch as st

N = int(os.environ.get("RANK_TEST_N", "48"))
BATCH = 4


class Recorded(stoker.Dataset):
    """Sample i: its index, its per-sample random draw, and what its worker knows."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = stoker.get_worker_info()
        assert info is not None
        return {
            "i": i,
            "draw": int(stoker.sample_rng().integers(1 << 62)),
            "torch_draw": int(torch.randint(1 << 62, ()).item()),
            "worker": info.id,
            "rank": info.rank,
            "world_size": info.world_size,
            "local_rank": info.local_rank,
        }


class Stream(stoker.IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        shard = stoker.shard_for(stoker.get_worker_info())
        return iter(shard.indices(50))


def _loader(dataset: Any, **kwargs: Any) -> st.DataLoader:
    sampler = st.DistributedSampler(dataset, seed=None, shuffle=True)
    return st.DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2, **kwargs)


def _rows(batch: dict[str, Any]) -> list[dict[str, int]]:
    keys = list(batch)
    return [dict(zip(keys, (int(batch[k][j]) for k in keys))) for j in range(len(batch["i"]))]


def _write(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)  # a kill never leaves half a file


RANK_TIMEOUT_S = float(os.environ.get("RANK_TEST_TIMEOUT", "75"))


def launch(world: int, mode: str, out: Path) -> None:
    """Start `world` ranks, wait for them (killing any still running after the timeout), and
    write their exit codes and output to OUT/world-MODE.json."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            GLOO_SOCKET_IFNAME="lo",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, mode, str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    codes, outputs = [], []
    for p in procs:
        try:
            output, _ = p.communicate(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            output, _ = p.communicate()
            output += f"\n[rank_main] killed after {RANK_TIMEOUT_S} s"
        codes.append(p.returncode)
        outputs.append(output)
    _write(out / f"world-{mode}.json", {"codes": codes, "outputs": outputs})


def main() -> None:
    if sys.argv[1] == "world":
        launch(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
        return
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    try:
        if mode == "cover":
            loader = _loader(Recorded())
            samples = [row for batch in loader for row in _rows(batch)]
            # every rank reads every index: the per-sample draws must agree, the workers'
            # global RNGs must not (rank mixed into their seeds)
            everything = st.DistributedSampler(Recorded(), num_replicas=1, rank=0, shuffle=False)
            alike = st.DataLoader(Recorded(), batch_size=BATCH, sampler=everything, num_workers=2)
            same_order = [row for batch in alike for row in _rows(batch)]
            streamed = [int(x) for batch in st.DataLoader(Stream(), batch_size=3, num_workers=2) for x in batch]
            _write(
                out / f"cover{rank}.json",
                {
                    "samples": samples,
                    "same_order": same_order,
                    "sampler_seed": loader.sampler.seed,
                    "streamed": streamed,
                },
            )
        elif mode == "uneven":
            own = [_loader(Recorded()) for _ in range(rank)]  # e.g. evaluation loaders of its own
            loader = _loader(Recorded())
            samples = [row["i"] for batch in loader for row in _rows(batch)]
            _write(
                out / f"uneven{rank}.json",
                {
                    "samples": samples,
                    "sampler_seed": loader.sampler.seed,
                    "own_seeds": [o.sampler.seed for o in own],
                },
            )
        elif mode == "train":
            kill_at = int(os.environ["KILL_AT"])
            loader = _loader(Recorded())
            seen: list[int] = []
            for step, batch in enumerate(loader, start=1):
                seen += [int(i) for i in batch["i"]]
                dist.barrier()
                _write(
                    out / f"state{rank}.json",
                    {
                        "state": loader.state_dict(),
                        "seen": seen,
                        "sampler_seed": loader.sampler.seed,
                    },
                )
                dist.barrier()
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "resume":
            source = os.environ["STATE_FROM"]  # "own": this rank's; else that rank's
            saved = json.loads((out / f"state{rank if source == 'own' else source}.json").read_text())
            loader = _loader(Recorded())
            loader.load_state_dict(saved["state"])
            samples = [row for batch in loader for row in _rows(batch)]
            _write(out / f"{os.environ['RESUMED_AS']}{rank}.json", {"samples": samples})
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
