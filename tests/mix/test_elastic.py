"""A 4-rank run over three sources mixed under a weight schedule and packed into rows,
SIGKILLed mid-epoch and resumed on 2 ranks (and on 1), continues with exactly the packed rows
of the uninterrupted run; a state saved over another mix is refused, naming what differs."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import stoker
from stoker.mix import StreamSampler, collate_packed

from .elastic_main import BATCH, KILL_AT, SCHEDULE, WORLDS, build, fingerprint

SCRIPT = Path(__file__).with_name("elastic_main.py")


def interleaved(per_rank: list[list[list[str]]]) -> list[str]:
    """The global row sequence: rank r's j-th row is position r + world * j."""
    streams = [[row for batch in batches for row in batch] for batches in per_rank]
    return [row for group in zip(*streams, strict=True) for row in group]


def read(out: Path, mode: str) -> list[str]:
    return interleaved([json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(WORLDS[mode][0])])


def torch_and_namespace() -> str | None:
    """Why the multi-process scenario cannot run here, or None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    from tests.support.namespaces import loopback_only

    return loopback_only()


CANNOT_RUN = torch_and_namespace()


@pytest.mark.skipif(CANNOT_RUN is not None, reason=str(CANNOT_RUN))
@pytest.mark.timeout(300)
def test_killed_on_4_ranks_resumed_on_2_and_on_1_continues_the_packed_rows(tmp_path: Path) -> None:
    from tests.support.namespaces import run_in_namespace

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run_in_namespace(
        [str(SCRIPT), str(tmp_path)], tmp_path, env, 270, "the mixed-and-packed resume scenario", grace_s=10
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["codes"] == {"reference": [0] * 4, "killed": [-9] * 4, "resumed-2": [0] * 2, "resumed-1": [0]}

    rows = build()
    total = len(rows) // 4 * 4  # drop_last: the 4-rank epoch
    expected = [fingerprint(rows[g]) for g in range(total)]
    # no stream position is packed twice; rows can still repeat: the smaller sources are read
    # through (and reshuffled) within the epoch, so some documents come twice, and the same
    # documents can be packed the same way again
    placed = Counter((position, start) for g in range(total) for position, start, _ in rows.pieces(g))
    assert max(placed.values()) == 1
    count = Counter(expected)
    assert len(count) > 0.8 * total
    # the packed stream is the same on 4 ranks x 2 workers as made directly in one process
    assert read(tmp_path, "reference") == expected
    killed = read(tmp_path, "killed")
    assert len(killed) == KILL_AT * 4 * BATCH < total
    # the kill falls within the window whose documents the second weights take over in
    window = rows.locate(len(killed))[0]
    assert rows._first_doc(window) < SCHEDULE[1][0] < rows._first_doc(window + 1)
    state = json.loads((tmp_path / "state-0.json").read_text())
    assert state["position"] == KILL_AT  # the state saved after the last step, not one before
    assert killed + read(tmp_path, "resumed-2") == expected
    assert killed + read(tmp_path, "resumed-1") == expected

    # the state the killed rank saved is refused by a loader over another schedule
    import stoker.torch as st

    rows_other = build([SCHEDULE[0], (350, SCHEDULE[1][1]), SCHEDULE[2]])
    loader = st.DataLoader(
        rows_other, batch_size=BATCH, sampler=StreamSampler(rows_other, 1, 0, drop_last=True), collate_fn=collate_packed
    )
    with pytest.raises(
        ValueError, match=re.escape("stream.mix.schedule_starts: saved [0, 300, 600], this loader [0, 350, 600]")
    ):
        loader.load_state_dict(state)


# -- a state over another mix, in one process -------------------------------------------------


def loader_over(schedule: list[tuple[int, list[float]]] = SCHEDULE) -> stoker.DataLoader:
    rows = build(schedule)
    sampler = StreamSampler(rows, num_replicas=1, rank=0, drop_last=True)
    return stoker.DataLoader(rows, batch_size=BATCH, sampler=sampler, collate_fn=collate_packed)


def row_prints(batch: dict[str, Any]) -> list[str]:
    return [
        fingerprint({k: v[i] for k, v in batch.items() if k != "cu_seqlens" and k != "max_seqlen"})
        for i in range(len(batch["input_ids"]))
    ]


@pytest.fixture(scope="module")
def saved_state() -> dict[str, Any]:
    loader = loader_over()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state: dict[str, Any] = json.loads(json.dumps(loader.state_dict()))
    del it
    return state


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (
            [SCHEDULE[0], (350, SCHEDULE[1][1]), SCHEDULE[2]],
            "stream.mix.schedule_starts: saved [0, 300, 600], this loader [0, 350, 600]",
        ),
        (
            [SCHEDULE[0], (300, [0.2, 0.4, 0.4]), SCHEDULE[2]],
            "stream.mix.weights: saved [[0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.3, 0.4, 0.3]], "
            "this loader [[0.5, 0.3, 0.2], [0.2, 0.4, 0.4], [0.3, 0.4, 0.3]]",
        ),
        (SCHEDULE[:2], "stream.mix.schedule_starts: saved [0, 300, 600], this loader [0, 300]"),
    ],
    ids=["second-start", "second-weights", "one-piece-fewer"],
)
def test_a_state_of_another_mix_is_refused_naming_the_key(
    saved_state: dict[str, Any], schedule: list[tuple[int, list[float]]], message: str
) -> None:
    other = loader_over(schedule)
    with pytest.raises(
        ValueError,
        match=r"^this DataLoader state comes from another configuration and was not "
        r"applied; .*" + re.escape(message),
    ):
        other.load_state_dict(saved_state)
    # nothing was applied: the other loader starts at its beginning
    assert row_prints(next(iter(other))) == [fingerprint(other.dataset[g]) for g in range(BATCH)]


def test_the_same_mix_takes_the_state_and_goes_on(saved_state: dict[str, Any]) -> None:
    loader = loader_over()
    loader.load_state_dict(saved_state)
    assert row_prints(next(iter(loader))) == [fingerprint(loader.dataset[g]) for g in range(3 * BATCH, 4 * BATCH)]
