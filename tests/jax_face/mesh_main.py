"""One JAX program on PROCESSES processes x (8 / PROCESSES) CPU devices, for tests/jax_face/test_mesh.py.

`mesh_main.py world MODE OUT PROCESSES CKPT` starts the processes (jax.distributed on loopback;
the test runs this inside a loopback-only network namespace), waits for each (killing them all
after WORLD_TIMEOUT_S) and writes OUT/world-MODE.json with their exit codes and output.
`mesh_main.py MODE OUT PROCESSES CKPT INDEX` is one process:

- "train": a small Flax NNX model trained on a stoker.jax.DataLoader (2 process workers, shuffled,
  the default sharding over all 8 devices) for STEPS steps, into the second epoch; an Orbax
  CheckpointManager saves the model and the loader at step SAVE_AT; every step's loss and the
  sample ids of this process's addressable shards are recorded; after the last step the process
  SIGKILLs itself, its workers busy (exit code -9).
- "resume": the same model and loader restored from the checkpoint in CKPT (saved by any number
  of processes), then the steps after SAVE_AT recorded.

Records: OUT/MODE-PROCESSES-INDEX.json, written after each step (a kill never leaves half a file).
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

import numpy as np

N, BATCH, STEPS, SAVE_AT, WORKERS = 320, 32, 14, 6, 2  # an epoch is 10 steps
WORLD_TIMEOUT_S = float(os.environ.get("WORLD_TIMEOUT_S", "150"))
PORT = int(os.environ.get("MESH_PORT", "29611"))


class Regression:
    """Sample i: 8 features and a target, from i alone; `id` says which sample it is."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng(i)
        x = rng.standard_normal(8).astype(np.float32)
        return {"x": x, "y": np.float32(x.sum() * 0.5 + 1.0), "id": np.int32(i)}


def write(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def shards_of(array: Any) -> list[list[Any]]:
    """This process's addressable shards of a batch leaf: [first row, values], by first row."""
    rows = {}
    for shard in array.addressable_shards:
        start = shard.index[0].start or 0
        rows[start] = np.asarray(shard.data).tolist()
    return [[start, values] for start, values in sorted(rows.items())]


def run(mode: str, out: Path, processes: int, ckpt: Path, index: int) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // processes}"
    import jax

    if processes > 1:
        address = f"127.0.0.1:{PORT}"
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=processes,
            process_id=index,
            coordinator_bind_address=address,
            initialization_timeout=60,
        )
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    import stoker.jax

    assert jax.device_count() == 8 and jax.process_count() == processes
    loader = stoker.jax.DataLoader(Regression(), batch_size=BATCH, shuffle=True, generator=7, num_workers=WORKERS)
    model = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

    @nnx.jit
    def step(model: Any, optimizer: Any, batch: Any) -> Any:
        def loss_of(model: Any) -> Any:
            return ((model(batch["x"])[:, 0] - batch["y"]) ** 2).mean()

        loss, grads = nnx.value_and_grad(loss_of)(model)
        optimizer.update(model, grads)
        return loss

    manager = ocp.CheckpointManager(ckpt, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
    done = 0
    if mode == "resume":
        # restored replicated over the loader's mesh, as the step's inputs are laid out
        replicated = jax.sharding.NamedSharding(loader.sharding.mesh, jax.sharding.PartitionSpec())
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), nnx.state((model, optimizer))
        )
        restored = manager.restore(
            SAVE_AT,
            args=ocp.args.Composite(
                model=ocp.args.StandardRestore(abstract), loader=stoker.jax.CheckpointRestore(loader)
            ),
        )
        nnx.update((model, optimizer), restored["model"])
        done = SAVE_AT
    record: dict[str, Any] = {"steps": [], "devices": [d.id for d in jax.local_devices()]}
    # a sharding over another process's devices only: refused, naming sharding
    others = [d for d in jax.devices() if d.process_index != jax.process_index()]
    if others:
        mesh = jax.sharding.Mesh(np.array(others), ("data",))
        try:
            stoker.jax.DataLoader(
                Regression(),
                batch_size=BATCH,
                sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
            )
        except ValueError as error:
            record["refused"] = str(error)
    path = out / f"{mode}-{processes}-{index}.json"
    while done < STEPS:
        for batch in loader:
            loss = step(model, optimizer, batch)
            done += 1
            record["steps"].append({"step": done, "loss": float(loss), "ids": shards_of(batch["id"])})
            write(path, record)
            if mode == "train" and done == SAVE_AT:
                manager.save(
                    SAVE_AT,
                    args=ocp.args.Composite(
                        model=ocp.args.StandardSave(nnx.state((model, optimizer))),
                        loader=stoker.jax.CheckpointSave(loader),
                    ),
                )
                manager.wait_until_finished()
            if done == STEPS:
                break
    if mode == "train":
        os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch, the workers busy with the batches ahead


def launch(mode: str, out: Path, processes: int, ckpt: str) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, mode, str(out), str(processes), ckpt, str(index)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for index in range(processes)
    ]
    deadline = time.monotonic() + WORLD_TIMEOUT_S
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
            output += f"\n[mesh_main] killed after {WORLD_TIMEOUT_S} s"
        codes.append(p.returncode)
        outputs.append(output)
    write(out / f"world-{mode}-{processes}.json", {"codes": codes, "outputs": outputs})


if __name__ == "__main__":
    if sys.argv[1] == "world":
        launch(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        faulthandler.dump_traceback_later(max(WORLD_TIMEOUT_S - 10, 1), exit=True)
        run(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
