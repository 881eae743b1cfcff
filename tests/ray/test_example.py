"""README "More than one machine", Ray: the example it shows is examples/ray_resume.py, and it
runs as written (against the test cluster, as a second driver: cluster_session.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ray_resume.py"


def readme_ray_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Ray: `stoker.ray`") :]
    found = re.search(r"```python\n(.*?)```\n", section, re.S)
    assert found is not None, "the README's Ray section has no python block"
    return found.group(1)


def test_readme_shows_the_example_file():
    assert readme_ray_block() == EXAMPLE.read_text()


@pytest.mark.scenario("example")
def test_the_example_runs_as_written(scenario):
    assert scenario["returncode"] == 0, scenario["stderr"]
    # 1,000 samples in batches of 64 with drop_last: 15 an epoch; epoch 0 whole, 6 of epoch 1
    assert scenario["stdout"].strip().splitlines()[-1] == "1344 samples read; 9 batches left of epoch 1"
