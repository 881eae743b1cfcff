"""The streaming resume scenario of tests/shards/test_elastic.py, run inside a loopback-only
network namespace (torch's TCPStore listens on every interface).

`python elastic_main.py OUT` starts the S3 server (moto, on loopback), writes N samples as
shards to it, and runs, each rank a process (gloo on loopback) with stoker.torch workers and
one shared cache folder with a cap smaller than the dataset:

- reference: 4 ranks x 2 workers read the epoch;
- killed: 4 ranks x 2 workers read in lock-step (a barrier per step, as gradient all-reduce
  would), save `loader.state_dict()` after each step, and SIGKILL themselves after step KILL_AT;
- resumed: 2 ranks x 3 workers load the states the killed ranks saved and read the rest.

`python elastic_main.py rank MODE OUT` is one rank (with torchrun's variables). What each rank
read goes to OUT/<mode>-<rank>.json; the cache's peak usage, sampled the whole time, and the
shards downloaded go to OUT/report.json.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

N = 480
BATCH = 5
SHARD_SAMPLES = 20  # 24 shards
CAP_SHARDS = 8  # the cache holds a third of the dataset: eviction happens within the epoch
KILL_AT = 9
SEED = 7
TIMEOUT_S = 150


def sample(i: int) -> dict[str, object]:
    payload = bytes((i * 7 + k) % 251 for k in range(3000 + (i % 13) * 50))
    return {"__key__": f"{i:06d}", "cls": i, "bin": payload}


def rank(mode: str, out: Path) -> None:
    import torch.distributed as dist

    import stoker.torch as st
    from stoker.shards import ShardedDataset, ShardedSampler

    dist.init_process_group("gloo")
    me = dist.get_rank()
    setting = json.loads((out / "setting.json").read_text())
    data = ShardedDataset(setting["url"], cache_dir=str(out / "cache"), cache_bytes=setting["cap"])
    sampler = ShardedSampler(data, seed=SEED, window_shards=2, drop_last=True)
    workers = 3 if mode == "resumed" else 2
    loader = st.DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=workers)
    if mode == "resumed":
        loader.load_state_dict(json.loads((out / f"state-{me}.json").read_text()))
    read: list[list[int]] = []
    for step, batch in enumerate(loader):
        read.append([int(x) for x in batch["cls"]])
        assert [k.decode() if isinstance(k, bytes) else k for k in batch["__key__"]] == [f"{i:06d}" for i in read[-1]]
        (out / f"{mode}-{me}.json").write_text(json.dumps(read))
        if mode == "killed":
            (out / f"state-{me}.json").write_text(json.dumps(loader.state_dict()))
        dist.barrier()
        if mode == "killed" and step + 1 == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()


def world(mode: str, ranks: int, out: Path, env: dict[str, str]) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for r in range(ranks):
        rank_env = dict(
            env,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(subprocess.Popen([sys.executable, __file__, "rank", mode, str(out)], env=rank_env))
    codes = []
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{mode}: ranks did not finish in {TIMEOUT_S} s") from None
    return codes


def folder_bytes(folder: Path) -> int:
    """What the cache folders under `folder` hold, each counted under its cache's lock (a
    plain walk can count a shard twice while it is renamed from downloads into place)."""
    from stoker._shards.cache import measure_usage

    if not folder.is_dir():
        return 0
    return sum(measure_usage(str(sub), locked=True) for sub in folder.iterdir() if sub.is_dir())


def scenario(out: Path) -> None:
    from tests.support.s3server import S3Server, client_env

    from stoker.shards import write_shards

    with S3Server() as server:
        server.make_bucket("elastic")
        env = dict(os.environ, **client_env(server.endpoint))
        os.environ.update(env)
        url = "s3://elastic/data"
        index = write_shards([sample(i) for i in range(N)], url, shard_bytes=SHARD_SAMPLES * 3400, workers=1)
        sizes = sorted((s.size for s in index.shards), reverse=True)
        cap = sum(sizes[:CAP_SHARDS])
        (out / "setting.json").write_text(json.dumps({"url": url, "cap": cap, "shards": len(sizes)}))
        peak = [0]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], folder_bytes(out / "cache"))
                time.sleep(0.002)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        codes = {
            "reference": world("reference", 4, out, env),
            "killed": world("killed", 4, out, env),
            "resumed": world("resumed", 2, out, env),
        }
        stop.set()
        watcher.join()
        (out / "report.json").write_text(
            json.dumps({"codes": codes, "peak": peak[0], "cap": cap, "shards": len(sizes), "dataset_bytes": sum(sizes)})
        )


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank(sys.argv[2], Path(sys.argv[3]))
    else:
        scenario(Path(sys.argv[1]))
