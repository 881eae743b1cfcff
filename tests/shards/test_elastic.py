"""A streaming run SIGKILLed mid-epoch and resumed on another world size and worker count
continues with exactly the global sample sequence of the uninterrupted run, against a real S3
server, with a cache cap smaller than the dataset (so shards are evicted during the run)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not os.environ.get("STOKER_S3_SERVER_PYTHON"):  # the user tier runs moto from the test venv
    pytest.importorskip("moto")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)

from tests.support.namespaces import loopback_only, run_in_namespace  # noqa: E402

SCRIPT = Path(__file__).with_name("elastic_main.py")
NO_NAMESPACE = loopback_only()


def interleaved(per_rank: list[list[list[int]]]) -> list[int]:
    """The global sample sequence: rank r's j-th sample is position r + world * j."""
    streams = [[i for batch in batches for i in batch] for batches in per_rank]
    return [i for group in zip(*streams, strict=True) for i in group]


def read(out: Path, mode: str, ranks: int) -> list[list[list[int]]]:
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE))
@pytest.mark.timeout(400)
def test_killed_on_4x2_resumed_on_2x3_continues_the_global_sequence(tmp_path: Path) -> None:
    from elastic_main import KILL_AT, N

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run_in_namespace([str(SCRIPT), str(tmp_path)], tmp_path, env, 380, "the streaming resume scenario", grace_s=10)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["codes"] == {"reference": [0] * 4, "killed": [-9] * 4, "resumed": [0] * 2}
    reference = interleaved(read(tmp_path, "reference", 4))
    assert sorted(reference) == list(range(N))  # the uninterrupted epoch reads each sample once
    killed = interleaved(read(tmp_path, "killed", 4))
    assert len(killed) == KILL_AT * 4 * 5
    resumed = interleaved(read(tmp_path, "resumed", 2))
    assert killed + resumed == reference
    # the cache was smaller than the dataset and never went over its cap
    assert report["cap"] < report["dataset_bytes"]
    assert 0 < report["peak"] <= report["cap"]
