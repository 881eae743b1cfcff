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
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from tests.support.docblocks import (
    BLOCK_TIMEOUT_S,
    PYTHON_FENCE,
    ROOT,
    Block,
    Outcome,
    page_blocks,
    run_block,
)

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
# `make test` runs these pages' blocks in the user tiers, as written, in the documented install
# (tests/user/test_user_install.py, tests/user/test_user_jax.py) and says so with this variable:
# they are run there and not twice. Without it (pytest alone) they run here.
RUN_BY_USER_TIERS = ("docs/guide/shards.md", "docs/guide/mixing-and-packing.md", "docs/guide/jax.md")
USER_TIERS_RUN = os.environ.get("STOKER_USER_TIERS_RUN_GUIDES") == "1"
PARALLEL = 3
README_MAX_LINES = 150


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
            documented += [(f"{module_name}.{name}.{k}", v) for k, v in vars(obj).items() if not k.startswith("_")]
    blocks = []
    for where, obj in documented:
        doc = obj.__doc__ if isinstance(obj, property) else getattr(obj, "__doc__", None)
        if isinstance(doc, str):
            blocks += [
                Block(where, inspect.cleandoc(code) + "\n") for code in PYTHON_FENCE.findall(inspect.cleandoc(doc))
            ]
    return blocks


def all_blocks() -> list[Block]:
    blocks = [b for page in PAGES for b in page_blocks(page)]
    for module in reference_modules():
        blocks += docstring_blocks(module)
    return blocks


BLOCKS = all_blocks()


def _left_to_user_tiers(block: Block) -> bool:
    return USER_TIERS_RUN and block.where.split(":")[0] in RUN_BY_USER_TIERS


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Starts every selected runnable block in the background (PARALLEL at a time); a test
    waits for its own. All have finished when the module's tests are done."""
    selected = {
        item.callspec.params["block"].where
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_example_runs" and hasattr(item, "callspec")
    }
    base = tmp_path_factory.mktemp("docs-examples")
    with ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="docs-example") as pool:
        futures: dict[str, Future[Outcome]] = {
            block.where: pool.submit(run_block, block, base / f"{n:02d}")
            for n, block in enumerate(BLOCKS)
            if block.skip is None and block.where in selected and not _left_to_user_tiers(block)
        }
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.timeout(BLOCK_TIMEOUT_S * (len(BLOCKS) // PARALLEL + 2))
@pytest.mark.leaks_allowed(
    "processes",
    "fds",
    "shm",
    reason="the blocks run PARALLEL at a time in the background while each test waits for its own: "
    "the processes, pipes and /dev/shm entries of the others come and go meanwhile (Grain's workers, "
    "on the From Grain page, make named semaphores that its resource tracker removes later); each "
    "block's own leftovers (its session's processes) are asserted below",
)
@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_example_runs(block: Block, outcomes: dict[str, Future[Outcome]]) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    if _left_to_user_tiers(block):
        pytest.skip("run as written by make test's user tiers, in the documented install")
    outcome = outcomes[block.where].result()
    code = "".join(f"{n:4d}  {line}" for n, line in enumerate(block.code.splitlines(keepends=True), 1))
    if outcome.returncode is None:
        pytest.fail(f"{block.where} ran past {BLOCK_TIMEOUT_S} s\n{code}\n{outcome.output[-4000:]}")
    assert outcome.returncode == 0, f"{block.where} failed\n{code}\n{outcome.output[-6000:]}"
    assert not outcome.leftovers, f"{block.where} left processes behind: {outcome.leftovers}"


def test_every_page_has_its_examples_found() -> None:
    # the pages that teach with code have blocks (a broken fence would hide them from the run)
    where = {b.where.split(":")[0] for b in BLOCKS}
    for page in (
        "README.md",
        "docs/getting-started.md",
        "docs/guide/frameworks.md",
        "docs/guide/randomness-and-resume.md",
        "docs/guide/feeding-a-gpu.md",
        "docs/guide/vision.md",
        "docs/guide/shards.md",
        "docs/guide/mixing-and-packing.md",
        "docs/guide/jax.md",
        "docs/guide/from-grain.md",
        "stoker.testing",
    ):
        assert page in where, page
    assert set(reference_modules()) == {
        "stoker",
        "stoker.torch",
        "stoker.vision",
        "stoker.shards",
        "stoker.mix",
        "stoker.jax",
        "stoker.ray",
        "stoker.testing",
    }


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
