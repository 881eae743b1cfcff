"""Two training ranks for tests/conformance/test_datapipes.py.

`python datapipe_ranks.py OUT` starts 2 ranks (spawned), each initialising torch.distributed
with the gloo backend through a file store in OUT (nothing listens on a network). Each rank
seeds torch's global RNG differently, as ranks without a shared seed would be, then reads two
epochs of the same DataPipe with 2 workers through torch's DataLoader and through
stoker.torch's, and writes both to OUT/<rank>.json.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

WORLD = 2
N = 60


def _read(loader_cls: type, rank: int) -> list[list[int]]:
    import torch
    from torch.utils.data.datapipes.iter import IterableWrapper

    torch.manual_seed(100 + rank)
    pipe = IterableWrapper(range(N)).shuffle(buffer_size=7).sharding_filter()
    loader = loader_cls(pipe, num_workers=2, batch_size=3, timeout=60)
    return [[int(x) for b in loader for x in b] for _ in range(2)]


def _rank(rank: int, out: str) -> None:
    import torch.distributed as dist
    import torch.utils.data as tud

    import stoker.torch as st

    dist.init_process_group("gloo", init_method=f"file://{out}/store", world_size=WORLD, rank=rank)
    try:
        result: dict[str, Any] = {
            "torch": _read(tud.DataLoader, rank),
            "stoker": _read(st.DataLoader, rank),
        }
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def main(out: str) -> int:
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank, args=(r, out)) for r in range(WORLD)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(240)
        if process.is_alive():
            process.kill()
            process.join()
    return max(abs(p.exitcode or 0) for p in ranks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
