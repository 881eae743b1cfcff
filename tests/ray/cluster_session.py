"""The cluster side of the Ray tests: run by `cluster.py` inside a network namespace that has
only the loopback interface (and its own process namespace, so that everything it starts can
be killed at once).

It starts a two-node Ray cluster (head + one more node, one CPU each, object stores of
~100 MB, a short temp dir), runs every scenario against it, shuts the cluster down, checks
that no Ray process is left, and writes what it saw as JSON for the tests to judge. A
scenario that raises records its error text instead of a result, so that one failure does
not hide the others.

    python cluster_session.py OUT_JSON TEMP_DIR ELSEWHERE_DIR
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("RAY_NODE_IP_ADDRESS", "127.0.0.1")

import psutil
import ray
from ray.cluster_utils import Cluster
from ray_datasets import (
    BatchSeeded,
    Failing,
    HoldsLock,
    Images,
    Indexed,
    Mixed,
    NodeReporting,
    Seeded,
)

import stoker.ray as sray

OBJECT_STORE_BYTES = 100 * 1024 * 1024
RAY_PROCESS_NAMES = ("raylet", "gcs_server", "plasma_store", "dashboard", "log_monitor", "ray::")


def node_args(temp_dir: str) -> dict[str, Any]:
    return {
        "num_cpus": 1,
        "object_store_memory": OBJECT_STORE_BYTES,
        "node_ip_address": "127.0.0.1",
        "include_dashboard": False,
        "temp_dir": temp_dir,
    }


def listify(batch: Any) -> Any:
    """A numpy batch of ints (or a list of such) as plain lists."""
    if isinstance(batch, (list, tuple)):
        return [listify(b) for b in batch]
    tolist = getattr(batch, "tolist", None)
    return tolist() if tolist is not None else batch


def scenario_nodes() -> dict[str, Any]:
    rows = sray.to_ray_dataset(NodeReporting(64), read_tasks=8).take_all()
    samples = [sray.decode(row) for row in rows]
    return {
        "indices": [s[0] for s in samples],
        "read_nodes": sorted({s[1] for s in samples}),
        "cluster_nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
    }


def scenario_exact() -> dict[str, Any]:
    import pickle

    dataset = Mixed(12)
    rows = sray.to_ray_dataset(dataset).take_all()
    # compared as pickles: numpy arrays have no plain ==; a pickle holds every type and value
    got = [pickle.dumps(sray.decode(row), protocol=5) for row in rows]
    want = [pickle.dumps(dataset[i], protocol=5) for i in range(len(dataset))]
    types = [type(sray.decode(row)).__name__ for row in rows]
    return {"same": got == want, "keys": [row["key"] for row in rows], "types": types}


def scenario_ranks() -> dict[str, Any]:
    out = {}
    for rank in range(2):
        loader = sray.DataLoader(Indexed(50), batch_size=4, shuffle=True, seed=7, rank=rank, world_size=2, read_tasks=3)
        epochs = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs.append([listify(b) for b in loader])
        out[str(rank)] = {"epochs": epochs, "len": len(loader)}
    return out


def scenario_seeds() -> dict[str, Any]:
    out = {}
    for name, dataset in (("per_sample", Seeded(30)), ("batched", BatchSeeded(30))):
        loader = sray.DataLoader(dataset, batch_size=4, shuffle=True, seed=11, world_size=1, read_tasks=2)
        epochs = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs.append([listify(b) for b in loader])
        out[name] = epochs
    return out


def scenario_resume() -> dict[str, Any]:
    def make(rank: int, world: int) -> sray.DataLoader:
        return sray.DataLoader(
            Indexed(45), batch_size=3, shuffle=True, seed=5, rank=rank, world_size=world, read_tasks=2
        )

    out: dict[str, Any] = {}
    # same world size: rank 1 of 2 stops after 2 batches of epoch 1
    loader = make(1, 2)
    loader.set_epoch(1)
    first = []
    for batch in loader:
        first.append(listify(batch))
        if len(first) == 2:
            break
    state = loader.state_dict()
    again = make(1, 2)
    again.load_state_dict(json.loads(json.dumps(state)))  # a state survives JSON
    out["same"] = {"first": first, "rest": [listify(b) for b in again], "state": state}
    # elastic: both ranks of 2 took 2 batches of epoch 1; 3 ranks go on
    states = []
    consumed = []
    for rank in range(2):
        old = make(rank, 2)
        old.set_epoch(1)
        it = iter(old)
        consumed += [listify(next(it)) for _ in range(2)]
        states.append(old.state_dict())
        it.close()
    rest = {}
    for rank in range(3):
        new = make(rank, 3)
        new.load_state_dict(states[0])
        rest[str(rank)] = {"len": len(new), "batches": [listify(b) for b in new]}
        new.set_epoch(2)
        rest[str(rank)]["next_epoch_len"] = len(new)
    out["elastic"] = {"consumed": consumed, "rest": rest}
    return out


def scenario_torch() -> dict[str, Any]:
    import stoker.torch

    loader = sray.DataLoader(Images(8), batch_size=4, collate_fn=stoker.torch.default_collate, read_tasks=1)
    batches = list(loader)
    numpy_batches = list(sray.DataLoader(Images(8), batch_size=4, read_tasks=1))
    return {
        "torch_types": [type(b).__module__ + "." + type(b).__name__ for b in batches],
        "numpy_types": [type(b).__module__ + "." + type(b).__name__ for b in numpy_batches],
        "shapes": [list(b.shape) for b in batches],
        "firsts": [int(b[0, 0, 0, 0]) for b in batches],
    }


def scenario_failing() -> dict[str, Any]:
    loader = sray.DataLoader(Failing(20, bad=13), batch_size=4, read_tasks=2)
    try:
        list(loader)
    except Exception as exc:
        return {
            "type": type(exc).__module__ + "." + type(exc).__name__,
            "message": str(exc),
            "exc_type": getattr(exc, "exc_type", None),
        }
    return {"type": None}


def scenario_unpicklable() -> dict[str, Any]:
    try:
        list(sray.DataLoader(HoldsLock(8), batch_size=4))
    except Exception as exc:
        return {"type": type(exc).__module__ + "." + type(exc).__name__, "message": str(exc)}
    return {"type": None}


def scenario_unimportable(elsewhere: str) -> dict[str, Any]:
    sys.path.insert(0, elsewhere)  # the driver can import it; the cluster's workers cannot
    try:
        from elsewhere_dataset import Elsewhere

        try:
            list(sray.DataLoader(Elsewhere(8), batch_size=4))
        except Exception as exc:
            return {"type": type(exc).__module__ + "." + type(exc).__name__, "message": str(exc)}
        return {"type": None}
    finally:
        sys.path.remove(elsewhere)


def scenario_split() -> dict[str, Any]:
    splits = sray.streaming_split(Indexed(40), 2, batch_size=3, shuffle=True, seed=3, read_tasks=4)
    got: dict[int, list[Any]] = {0: [], 1: []}
    errors: list[str] = []

    def consume(k: int) -> None:
        try:
            got[k] = [listify(b) for b in splits[k]]
        except Exception:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        splits[0].state_dict()
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"splits": [got[0], got[1]], "errors": errors, "alive": [t.is_alive() for t in threads], "refused": refused}


def ray_processes(temp_dir: str) -> list[str]:
    """This namespace's Ray processes (other than this one)."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        if proc.info["pid"] == os.getpid():
            continue
        text = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
        if temp_dir in text or any(name in text for name in RAY_PROCESS_NAMES):
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                continue
            found.append(f"{proc.info['pid']} {text.strip()[:160]}")
    return found


def scenario_example(address: str) -> dict[str, Any]:
    """examples/ray_resume.py (the one docs/guide/ranks-and-ray.md shows), run as written against this cluster."""
    import subprocess
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "ray_resume.py"
    done = subprocess.run(
        [sys.executable, str(example)],
        env=dict(os.environ, RAY_ADDRESS=address),
        capture_output=True,
        text=True,
        timeout=90,
    )
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-4000:]}


def main() -> int:
    out_path, temp_dir, elsewhere = sys.argv[1:4]
    results: dict[str, Any] = {"scenarios": {}, "timings": {}}
    # Ray writes the cluster's address under $RAY_TMPDIR/ray (default /tmp/ray): keep it in ours
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    started = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args=node_args(temp_dir))
    cluster.add_node(**node_args(temp_dir))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    results["timings"]["cluster_start_s"] = time.perf_counter() - started
    results["addresses"] = sorted({n["NodeManagerAddress"] for n in ray.nodes()})
    scenarios = {
        "nodes": scenario_nodes,
        "exact": scenario_exact,
        "ranks": scenario_ranks,
        "seeds": scenario_seeds,
        "resume": scenario_resume,
        "failing": scenario_failing,
        "unpicklable": scenario_unpicklable,
        "unimportable": lambda: scenario_unimportable(elsewhere),
        "split": scenario_split,
        "torch": scenario_torch,
        "example": lambda: scenario_example(cluster.address),
    }
    only = os.environ.get("STOKER_RAY_SCENARIOS")
    for name, run in scenarios.items():
        if only and name not in only.split(","):
            continue
        begun = time.perf_counter()
        try:
            results["scenarios"][name] = {"ok": True, "result": run()}
        except Exception:
            results["scenarios"][name] = {"ok": False, "error": traceback.format_exc()}
        results["timings"][name] = time.perf_counter() - begun
    begun = time.perf_counter()
    ray.shutdown()
    cluster.shutdown()
    deadline = time.monotonic() + 15
    left = ray_processes(temp_dir)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = ray_processes(temp_dir)
    results["left_after_shutdown"] = left
    results["timings"]["shutdown_s"] = time.perf_counter() - begun
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
