"""Every Python example of the documentation runs: the ```python blocks of README.md and of every
page under docs/ (files pulled in with pymdownx.snippets' `--8<-- "path"` included), and those of
the docstrings the API reference renders (the `::: module` pages under docs/reference/).

Each block runs as a script of its own, in a fresh interpreter, in a temporary directory, in
a session of its own (so that nothing it starts can outlive it unnoticed): the test fails if it
exits non-zero, runs past its time, or leaves a process behind. Blocks run a few at a time
in the background, started when the first of these tests asks; each test waits for its own.

A page can put one marker on the line before a block (an HTML comment: not rendered):

    <!-- test: setup NAME -->     the block runs after SETUPS[NAME] (names the prose assumes,
                                   such as `dataset`, made small here), then CHECKS[NAME] if any
    <!-- test: continue -->       the block continues the page's previous block (same script)
    <!-- test: skip NAME -->      not run here; SKIPS[NAME] says why and where it is run

Unknown names fail. `make test` also builds the site with `mkdocs build --strict` (the
Makefile's docs-strict goal).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
BLOCK_TIMEOUT_S = 150
PARALLEL = 3
README_MAX_LINES = 150

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
from stoker_bench.s3server import S3Server, client_env

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
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
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


def reference_modules() -> list[str]:
    found = []
    for page in sorted((DOCS / "reference").glob("*.md")):
        found += re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), re.M)
    return found


def docstring_blocks(module_name: str) -> list[Block]:
    """The ```python blocks in the docstrings of a module's public objects (and their public
    methods and properties): what the reference renders."""
    module = importlib.import_module(module_name)
    documented = [(module_name, module)]
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        documented.append((f"{module_name}.{name}", obj))
        if inspect.isclass(obj):
            documented += [(f"{module_name}.{name}.{k}", v) for k, v in vars(obj).items()
                           if not k.startswith("_")]
    blocks = []
    for where, obj in documented:
        doc = obj.__doc__ if isinstance(obj, property) else getattr(obj, "__doc__", None)
        if isinstance(doc, str):
            blocks += [Block(where, inspect.cleandoc(code) + "\n")
                       for code in PYTHON_FENCE.findall(inspect.cleandoc(doc))]
    return blocks


def all_blocks() -> list[Block]:
    blocks = [b for page in PAGES for b in page_blocks(page)]
    for module in reference_modules():
        blocks += docstring_blocks(module)
    return blocks


BLOCKS = all_blocks()


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


def run_block(block: Block, workdir: Path) -> Outcome:
    workdir.mkdir(parents=True)
    script = workdir / "example.py"
    script.write_text(block.code)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONFAULTHANDLER="1")
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, script.name], cwd=workdir, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = child.communicate(timeout=BLOCK_TIMEOUT_S)
        returncode: int | None = child.returncode
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)
        output, _ = child.communicate()
        returncode = None
    seconds = time.monotonic() - started
    # what the block started should be gone with it (stoker's workers go within tens of ms)
    deadline = time.monotonic() + 5
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


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Starts every selected runnable block in the background (PARALLEL at a time); a test
    waits for its own. All have finished when the module's tests are done."""
    selected = {item.callspec.params["block"].where for item in request.session.items
                if getattr(item, "originalname", None) == "test_example_runs" and hasattr(item, "callspec")}
    base = tmp_path_factory.mktemp("docs-examples")
    with ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="docs-example") as pool:
        futures: dict[str, Future[Outcome]] = {
            block.where: pool.submit(run_block, block, base / f"{n:02d}")
            for n, block in enumerate(BLOCKS) if block.skip is None and block.where in selected
        }
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.timeout(BLOCK_TIMEOUT_S * (len(BLOCKS) // PARALLEL + 2))
@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_example_runs(block: Block, outcomes: dict[str, Future[Outcome]]) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    outcome = outcomes[block.where].result()
    code = "".join(f"{n:4d}  {line}" for n, line in enumerate(block.code.splitlines(keepends=True), 1))
    if outcome.returncode is None:
        pytest.fail(f"{block.where} ran past {BLOCK_TIMEOUT_S} s\n{code}\n{outcome.output[-4000:]}")
    assert outcome.returncode == 0, f"{block.where} failed\n{code}\n{outcome.output[-6000:]}"
    assert not outcome.leftovers, f"{block.where} left processes behind: {outcome.leftovers}"


def test_every_page_has_its_examples_found() -> None:
    # the pages that teach with code have blocks (a broken fence would hide them from the run)
    where = {b.where.split(":")[0] for b in BLOCKS}
    for page in ("README.md", "docs/getting-started.md", "docs/guide/frameworks.md",
                 "docs/guide/randomness-and-resume.md", "docs/guide/feeding-a-gpu.md",
                 "docs/guide/vision.md", "docs/guide/shards.md", "docs/guide/mixing-and-packing.md", "stoker.testing"):
        assert page in where, page
    assert set(reference_modules()) == {"stoker", "stoker.torch", "stoker.vision", "stoker.shards", "stoker.mix", "stoker.ray", "stoker.testing"}


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    first_block = re.search(r"```\w*\n(.*?)```", readme, re.S)
    assert first_block is not None
    assert [line.split()[:2] for line in first_block.group(1).splitlines()] == [["make", "bench"], ["make", "test"]]
    assert readme.index("```") < readme.index("\n## ")  # before any section


def test_readme_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
