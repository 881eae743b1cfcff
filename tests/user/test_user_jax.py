"""What a JAX user who ran `pip install 'stoker[jax]' orbax-checkpoint` gets, in a venv holding
that and the test runner alone (no torch, Grain, Flax or TensorFlow: `make user-tier-jax`
builds build/user-jax-venv once per change of pyproject.toml and installs this checkout into it
as a wheel on every run, STOKER_USER_TIER=jax): `import stoker.jax` never tries to import torch,
in the main process or in a worker; every example of the JAX guide (docs/guide/jax.md) runs as
written; and its `jax.distributed` example runs as two processes of 4 CPU devices, whose rows
of the last global batch are that batch, split between them. Skipped anywhere else."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

if os.environ.get("STOKER_USER_TIER") != "jax":
    pytest.skip(
        "the JAX user tier runs in build/user-jax-venv only (make user-tier-jax sets STOKER_USER_TIER=jax)",
        allow_module_level=True,
    )

import numpy as np
from tests.support.docblocks import ROOT, Block, page_blocks, run_block
from tests.support.namespaces import loopback_only, run_in_namespace

import stoker

GUIDE = ROOT / "docs" / "guide" / "jax.md"
GUIDE_BLOCKS = page_blocks(GUIDE)
RUNNABLE = [b for b in GUIDE_BLOCKS if b.skip is None]
DISTRIBUTED = [b for b in GUIDE_BLOCKS if b.skip is not None and "jax.distributed.initialize(" in b.code]
RUNNER = Path(__file__).with_name("jax_examples.py")
WORLD_TIMEOUT_S = 240

# Run after the multi-process example's own code, in each process: the ids of this process's
# rows of the last global batch, and the last loss, for the test to compare.
RECORD_ROWS = """
if __name__ == "__main__":
    import json as _json

    _mine = [int(i) for s in batch["id"].addressable_shards for i in np.asarray(s.data)]
    with open(f"rows-{jax.process_index()}.json", "w") as _f:
        _json.dump({"ids": _mine, "loss": float(loss), "global_rows": batch["id"].shape[0]}, _f)
"""

# Records every attempt to import torch (a guarded `try: import torch` included), in the main
# process and, through the main module's import, in each worker; then runs a loader.
NO_TORCH = """
import sys


class _Watch:
    tried = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            _Watch.tried.append(name)
        return None


sys.meta_path.insert(0, _Watch())

import numpy as np

import stoker
import stoker.jax


class Probe(stoker.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return {"tried_torch": np.int32(len(_Watch.tried)), "torch_loaded": np.int32("torch" in sys.modules)}


if __name__ == "__main__":
    loader = stoker.jax.DataLoader(Probe(), batch_size=8, num_workers=2)
    batches = list(loader)
    assert len(batches) == 4
    assert all(int(np.asarray(b["tried_torch"]).max()) == 0 for b in batches), "a worker tried to import torch"
    assert all(int(np.asarray(b["torch_loaded"]).max()) == 0 for b in batches), "a worker holds torch"
    assert not _Watch.tried, f"the main process tried to import {_Watch.tried}"
    assert "torch" not in sys.modules
    print("no torch")
"""


def test_this_is_the_users_jax_install() -> None:
    present = {m for m in ("torch", "grain", "flax", "tensorflow", "array_record") if importlib.util.find_spec(m)}
    assert not present, f"the JAX user tier's venv holds {sorted(present)}: it should hold stoker[jax] and orbax alone"
    for needed in ("jax", "orbax.checkpoint"):
        assert importlib.util.find_spec(needed) is not None, needed
    assert "site-packages" in stoker.__file__, f"stoker should come from the installed wheel, not {stoker.__file__}"


def test_import_stoker_jax_imports_no_torch(tmp_path: Path) -> None:
    outcome = run_block(Block("no-torch", NO_TORCH), tmp_path / "no-torch", python=sys.executable)
    assert outcome.returncode == 0, outcome.output[-4000:]
    assert outcome.output.strip().endswith("no torch"), outcome.output[-2000:]
    assert not outcome.leftovers, outcome.leftovers


def test_the_guide_has_its_examples() -> None:
    assert len(RUNNABLE) >= 5, [b.where for b in GUIDE_BLOCKS]
    assert len(DISTRIBUTED) == 1, [b.where for b in GUIDE_BLOCKS]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_the_jax_guides_examples_run_as_written(block: Block, tmp_path: Path) -> None:
    outcome = run_block(block, tmp_path / "example", python=sys.executable)
    assert outcome.returncode == 0, f"{block.where} failed after {outcome.seconds:.1f} s:\n{outcome.output[-4000:]}"
    assert not outcome.leftovers, f"{block.where} left processes behind: {outcome.leftovers}"


@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
def test_the_distributed_example_runs_on_two_processes(tmp_path: Path) -> None:
    why_not = loopback_only()
    if why_not is not None:
        pytest.skip(f"a loopback-only network namespace is needed for the coordinator's port: {why_not}")
    (block,) = DISTRIBUTED
    (tmp_path / "train.py").write_text(block.code + RECORD_ROWS)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    run_in_namespace(
        [str(RUNNER), str(tmp_path / "train.py"), "2", str(WORLD_TIMEOUT_S)],
        tmp_path,
        env,
        WORLD_TIMEOUT_S + 30,
        "the guide's jax.distributed example on 2 processes",
        grace_s=10,
    )
    world = json.loads((tmp_path / "world.json").read_text())
    report = "\n".join(f"--- process {i} exited {c}:\n{o[-3000:]}" for i, (c, o) in enumerate(zip(*world.values())))
    assert world["codes"] == [0, 0], report
    records = [json.loads((tmp_path / f"rows-{i}.json").read_text()) for i in range(2)]
    # the last global batch of the epoch, as stoker.DataLoader draws it for the same arguments
    order = stoker.DataLoader(stoker.ArrayDataset(np.arange(4096)), batch_size=256, shuffle=True, generator=0)
    last = [int(i) for i in list(order)[-1]]
    assert [len(r["ids"]) for r in records] == [128, 128], report
    assert records[0]["ids"] + records[1]["ids"] == last  # process 0 holds the first rows, process 1 the rest
    assert records[0]["global_rows"] == records[1]["global_rows"] == 256
    assert records[0]["loss"] == records[1]["loss"]  # one global computation
    for i, output in enumerate(world["outputs"]):
        assert f"process {i}: last loss" in output, report
