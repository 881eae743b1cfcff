"""Ranks that agree: real `torch.distributed` process groups (gloo) of 2 and 3 ranks, each
with stoker.torch worker processes, inside a network namespace with only the loopback
interface (torch's TCPStore listens on every interface). The union of the ranks' samples is
the dataset with no overlap; resuming after every rank was SIGKILLed gives the rest exactly
once, with the same world size and with another one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)

import psutil  # noqa: E402
from tests.support.namespaces import LOOPBACK_UP, loopback_only  # noqa: E402

SCRIPT = Path(__file__).with_name("rank_main.py")
N = 48  # divisible by 2, 3 and the batch size 4
TIMEOUT_S = 90


NO_NAMESPACE = loopback_only()
pytestmark = pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE))


def _run_world(world: int, mode: str, out: Path, **env: str) -> list[int]:
    """Run `world` ranks of rank_main.py in a loopback-only namespace; their exit codes (a
    rank that exits otherwise than 0 or by SIGKILL fails the test with its output)."""
    run_env = dict(os.environ, RANK_TEST_N=str(N), PYTHONPATH=os.pathsep.join(sys.path), **env)
    command = [
        "unshare",
        "-n",
        "--",
        "sh",
        "-c",
        LOOPBACK_UP,
        sys.executable,
        str(SCRIPT),
        "world",
        str(world),
        mode,
        str(out),
    ]
    try:
        launched = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_left(out)
        pytest.fail(f"{mode} with {world} ranks did not finish in {TIMEOUT_S} s")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    report = json.loads((out / f"world-{mode}.json").read_text())
    for code, output in zip(report["codes"], report["outputs"]):
        if code not in (0, -9):
            pytest.fail(f"a rank of {mode} exited with {code}:\n{output}")
    return list(report["codes"])


def _kill_left(out: Path) -> None:
    for p in _rank_processes(out):
        _kill_tree(p.pid)


def _kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for p in [*parent.children(recursive=True), parent]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _rank_processes(out: Path) -> list[psutil.Process]:
    """Processes (ranks, their workers) with the test's folder on their command line or in
    their environment."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(out) in " ".join(p.info["cmdline"] or []) or p.environ().get("RANK_TEST_OUT") == str(out):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _no_rank_processes_left(out: Path) -> None:
    _, alive = psutil.wait_procs(_rank_processes(out), timeout=10)
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"


def _read(out: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}{rank}.json").read_text()) for rank in range(world)]


def test_three_ranks_share_out_the_dataset_and_agree_on_seeds(tmp_path: Path) -> None:
    world = 3
    codes = _run_world(world, "cover", tmp_path, RANK_TEST_OUT=str(tmp_path))
    assert codes == [0] * world
    ranks = _read(tmp_path, "cover", world)

    # DistributedSampler(seed=None): the default seed on every rank, and disjoint shards
    assert len({r["sampler_seed"] for r in ranks}) == 1
    shards = [[s["i"] for s in r["samples"]] for r in ranks]
    assert sorted(i for shard in shards for i in shard) == list(range(N))
    assert all(len(shard) == N // world for shard in shards)
    for rank, r in enumerate(ranks):  # what get_worker_info() told each sample
        assert {(s["rank"], s["world_size"], s["local_rank"]) for s in r["samples"]} == {(rank, world, rank)}
        assert {s["worker"] for s in r["samples"]} == {0, 1}

    # every rank read every index: the per-sample draws agree (the ranks seeded their global
    # RNGs alike, and the base seeds come from them), the workers' global RNGs differ (the
    # rank is mixed into their seeds)
    orders = [[s["i"] for s in r["same_order"]] for r in ranks]
    assert orders == [list(range(N))] * world
    draws = [[s["draw"] for s in r["same_order"]] for r in ranks]
    assert all(d == draws[0] for d in draws)
    assert len(set(draws[0])) == N
    torch_draws = [tuple(s["torch_draw"] for s in r["same_order"]) for r in ranks]
    assert len(set(torch_draws)) == world

    # an IterableDataset sharded over ranks x workers with stoker.shard_for
    streamed = [r["streamed"] for r in ranks]
    assert sorted(x for s in streamed for x in s) == list(range(50))
    _no_rank_processes_left(tmp_path)


def test_ranks_that_build_different_loaders_neither_wait_nor_overlap(tmp_path: Path) -> None:
    """Rank 1 builds a loader of its own before the shared one; no constructor communicates,
    so neither rank waits for the other (this hung when seed=None was broadcast), and the
    shared loader's shards are disjoint and cover the dataset."""
    world = 2
    codes = _run_world(world, "uneven", tmp_path, RANK_TEST_OUT=str(tmp_path), RANK_TEST_TIMEOUT="30")
    assert codes == [0] * world, "a rank was killed after waiting 30 s"
    ranks = _read(tmp_path, "uneven", world)
    assert [r["sampler_seed"] for r in ranks] == [0, 0] and ranks[1]["own_seeds"] == [0]
    shards = [r["samples"] for r in ranks]
    assert sorted(shards[0] + shards[1]) == list(range(N)) and len(shards[0]) == N // world
    _no_rank_processes_left(tmp_path)


def test_two_ranks_killed_then_resumed_by_two_and_by_three(tmp_path: Path) -> None:
    kill_at = 3  # of 6 batches per rank with 2 ranks
    codes = _run_world(2, "train", tmp_path, KILL_AT=str(kill_at), RANK_TEST_OUT=str(tmp_path))
    assert codes == [-9, -9]
    _no_rank_processes_left(tmp_path)  # the workers went with their rank
    saved = _read(tmp_path, "state", 2)
    assert saved[0]["sampler_seed"] == saved[1]["sampler_seed"] == 0  # seed=None: the default
    consumed = [i for s in saved for i in s["seen"]]
    assert len(consumed) == len(set(consumed)) == 2 * kill_at * 4  # disjoint shards

    # the same world size resumes each rank from its own state; another one from any rank's
    # (rank 0's here): the samples no old rank consumed, split over the new ranks
    for new_world, state_from in ((2, "own"), (3, "0")):
        name = f"resumed-by-{new_world}-"
        _run_world(new_world, "resume", tmp_path, STATE_FROM=state_from, RESUMED_AS=name, RANK_TEST_OUT=str(tmp_path))
        rest = [[s["i"] for s in r["samples"]] for r in _read(tmp_path, name, new_world)]
        assert sorted(consumed + [i for part in rest for i in part]) == list(range(N)), new_world
        assert all(len(part) == (N - len(consumed)) // new_world for part in rest)
        _no_rank_processes_left(tmp_path)


def test_the_documented_torchrun_example_runs(tmp_path: Path) -> None:
    """docs/guide/ranks-and-ray.md's torchrun command, as written, with torch's own launcher."""
    repo = SCRIPT.parents[2]
    page = (repo / "docs" / "guide" / "ranks-and-ray.md").read_text()
    assert "torchrun --standalone --nproc-per-node=2 examples/ranks.py\n" in page
    command = [
        "unshare",
        "-n",
        "--",
        "sh",
        "-c",
        LOOPBACK_UP,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "examples/ranks.py",
    ]
    try:
        done = subprocess.run(
            command,
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=dict(os.environ, RANK_TEST_OUT=str(tmp_path)),
        )
    except subprocess.TimeoutExpired:
        _kill_left(tmp_path)
        pytest.fail(f"examples/ranks.py did not finish in {TIMEOUT_S} s")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "epoch 0: 240 samples over 2 ranks (the dataset has 240)" in done.stdout
    assert "epoch 1: 240 samples over 2 ranks (the dataset has 240)" in done.stdout
    _no_rank_processes_left(tmp_path)
