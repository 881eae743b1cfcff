"""The runnable examples of the documentation: the ```python blocks of a page, each with what
its marker asks for (see tests/test_docs.py), and how one block runs: as a script of its own,
in a fresh interpreter (this one, or another install's), in a temporary directory and a
session of its own, so that nothing it starts can outlive it unnoticed. tests/test_docs.py runs
every page's blocks in the test environment; tests/user/ runs the shards and mixing guides'
blocks in a user's install."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
BLOCK_TIMEOUT_S = 150

# Names the prose around a block assumes, made small. Each is the whole preamble of the blocks
# that name it.
SETUPS = {
    # a map-style dataset of 2,048 small dict samples, and no-op stand-ins for a training step
    "dataset": """
import numpy as np
import stoker

class _Samples(stoker.Dataset):
    def __len__(self):
        return 2048

    def __getitem__(self, i):
        return {"x": np.full(4, i, np.float32), "y": i}

dataset = _Samples()

def train(batch):
    pass

train_step = log = train
""",
    # resume.md's loop: a checkpoint kept in memory, a model and RNGs to save with it
    "checkpoint": """
import random

import numpy as np
import torch
import stoker

class _Samples(stoker.Dataset):
    def __len__(self):
        return 640

    def __getitem__(self, i):
        return np.full(4, i, np.float32)

dataset = _Samples()
model = torch.nn.Linear(4, 1)
start_epoch, epochs = 0, 2
_saved = {}

def train(batch):
    pass

def save(checkpoint):
    _saved.update(checkpoint)

def load():
    return _saved
""",
    # the elastic resume: rank 0 of an old world of 4 ranks read 3 batches and saved its state;
    # the block is rank 0 of the new world of 3
    "elastic": """
import numpy as np
import stoker

dataset = stoker.ArrayDataset(np.arange(1000))
_old = stoker.DataLoader(dataset, batch_size=32,
                         sampler=stoker.DistributedSampler(dataset, num_replicas=4, rank=0, seed=0))
_it = iter(_old)
for _ in range(3):
    next(_it)
state_saved_by_old_rank_0 = _old.state_dict()
new_world, new_rank = 3, 0
""",
    # a few small JPEGs in torchvision's folder layout: imagenet/train/<class>/<file>.jpg
    "jpegs": """
from pathlib import Path

import numpy as np
from PIL import Image

for _c, _name in enumerate(["n01440764", "n01443537"]):
    _folder = Path("imagenet/train") / _name
    _folder.mkdir(parents=True)
    for _k in range(6):
        _pixels = np.random.default_rng(10 * _c + _k).integers(0, 256, (300, 400, 3), np.uint8)
        Image.fromarray(_pixels).save(_folder / f"{_k}.jpg", quality=90)
""",
    # a list of a million paths and labels, and a file reader
    "files": """
paths = [f"/data/images/{i:07d}.jpg" for i in range(100_000)]
labels = [i % 1000 for i in range(100_000)]

def load(path):
    return len(path)
""",
    # shards.md: a real S3 server on loopback (moto, as the shard tests start it) with a bucket
    # "my-bucket", the environment pointed at it, and small stand-ins for the page's names
    "s3": """
import os

import torch
from tests.support.s3server import S3Server, client_env

_server = S3Server().start()
_server.make_bucket("my-bucket")
os.environ.update(client_env(_server.endpoint))
n, epochs = 96, 2
model = torch.nn.Linear(4, 1)
path = "checkpoint.pt"

def jpeg_bytes(i):
    return bytes([i % 256]) * 1000

def label(i):
    return i % 10

def decode(sample):
    return {"x": len(sample["jpg"]), "y": sample["cls"]}
""",
    # a stream of records for an IterableDataset to read
    "records": """
import stoker

def read_records(path):
    return iter(range(100))
""",
}

# Code run after the block, to check that what it defines works as the page says.
CHECKS = {
    # two workers read the stream once between them
    "records": """
Records.path = "records.bin"
_loader = stoker.DataLoader(Records(), batch_size=10, num_workers=2)
assert sorted(int(i) for batch in _loader for i in batch) == list(range(100))
""",
}

# Blocks not run here, each with the reason and where it is run instead.
SKIPS = {
    "jax-distributed": "a jax.distributed program started once per process (a coordinator on a port): "
    "tests/user/test_user_jax.py runs it as written on 2 processes x 4 CPU devices in a loopback-only "
    "network namespace (make user-tier-jax)",
    "ray-cluster": "examples/ray_resume.py starts a Ray of its own (several seconds and processes "
    "outside this test's session); tests/ray/test_cluster.py runs it as written against the test "
    "suite's Ray cluster and checks its output",
}

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!-- test: (?P<kind>setup|continue|skip)(?: (?P<name>[\w-]+))? -->\s*$")
SNIPPET = re.compile(r"""^\s*--8<--\s+["'](?P<path>[^"']+)["']\s*$""")
PYTHON_FENCE = re.compile(r"```python\n(.*?)```", re.S)


@dataclass(frozen=True)
class Block:
    where: str  # page:line, or module:object for a docstring
    code: str
    skip: str | None = None


def _include_snippets(code: str) -> str:
    lines = []
    for line in code.splitlines(keepends=True):
        found = SNIPPET.match(line)
        lines.append((ROOT / found["path"]).read_text() if found else line)
    return "".join(lines)


def page_blocks(page: Path) -> list[Block]:
    """The ```python blocks of one page, each with what its marker asks for."""
    lines = page.read_text().splitlines(keepends=True)
    where = page.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    previous_code = ""
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang, start = fence["indent"], fence["lang"], i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1  # the closing fence
        if lang != "python":
            continue
        code = _include_snippets("".join(body))
        before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(before)
        kind, name = (marker["kind"], marker["name"]) if marker else (None, None)
        label = f"{where}:{start + 1}"
        if kind == "setup":
            assert name in SETUPS, f"{label}: unknown setup {name!r}"
            code = SETUPS[name] + "\n" + code + CHECKS.get(name, "")
        elif kind == "continue":
            assert previous_code, f"{label}: 'continue' with no block before it on the page"
            code = previous_code + "\n" + code
        elif kind == "skip":
            assert name in SKIPS, f"{label}: unknown skip {name!r} (give its reason in SKIPS)"
            blocks.append(Block(label, code, SKIPS[name]))
            continue
        previous_code = code
        blocks.append(Block(label, code))
    return blocks


@dataclass
class Outcome:
    returncode: int | None
    output: str
    seconds: float
    leftovers: list[str]


def _session_members(sid: int) -> list[psutil.Process]:
    members = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == sid:
                members.append(process)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return members


def run_block(block: Block, workdir: Path, python: str = sys.executable, env: dict[str, str] | None = None) -> Outcome:
    workdir.mkdir(parents=True)
    script = workdir / "example.py"
    script.write_text(block.code)
    env = dict(os.environ if env is None else env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONFAULTHANDLER="1")
    # the repo root, for the setups that start tests.support's S3 server
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    started = time.monotonic()
    child = subprocess.Popen(
        [python, script.name],
        cwd=workdir,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = child.communicate(timeout=BLOCK_TIMEOUT_S)
        returncode: int | None = child.returncode
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)
        output, _ = child.communicate()
        returncode = None
    seconds = time.monotonic() - started
    # what the block started should be gone with it (stoker's workers go within tens of ms)
    deadline = time.monotonic() + 30
    left = _session_members(child.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _session_members(child.pid)
    leftovers = []
    for process in left:
        try:
            leftovers.append(f"pid {process.pid}: {' '.join(process.cmdline())[:200]}")
            process.kill()
        except psutil.Error:
            pass
    return Outcome(returncode, output, seconds, leftovers)
