"""The docs' Ray section (docs/guide/ranks-and-ray.md, "Ray: `stoker.ray`"): the example it
shows is examples/ray_resume.py, included into the page as it is, and it runs as written (against
the test cluster, as a second driver: cluster_session.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ray_resume.py"
PAGE = ROOT / "docs" / "guide" / "ranks-and-ray.md"


def page_ray_block() -> str:
    page = PAGE.read_text()
    section = page[page.index("## Ray: `stoker.ray`") :]
    found = re.search(r"```python\n(.*?)```\n", section, re.S)
    assert found is not None, "the page's Ray section has no python block"
    return found.group(1)


def test_the_page_shows_the_example_file():
    # pymdownx.snippets puts the file's text in place of this line when the site is built
    assert page_ray_block() == '--8<-- "examples/ray_resume.py"\n'
    assert EXAMPLE.is_file()


@pytest.mark.scenario("example")
def test_the_example_runs_as_written(scenario):
    assert scenario["returncode"] == 0, scenario["stderr"]
    # 1,000 samples in batches of 64 with drop_last: 15 an epoch; epoch 0 whole, 6 of epoch 1
    assert scenario["stdout"].strip().splitlines()[-1] == "1344 samples read; 9 batches left of epoch 1"
