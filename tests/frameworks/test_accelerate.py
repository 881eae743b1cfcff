"""A user's accelerate script on two CPU ranks (gloo, `torch.distributed.run`, inside a network
namespace with only the loopback interface), once with torch.utils.data (the control) and once
with stoker.torch, the import the only difference (accelerate_main.py): each rank gets its
shard, batches arrive on the accelerator's device, gradient accumulation ends at every epoch's
end, gather_for_metrics drops the padding, skip_first_batches yields the rest, the shuffle
sampler gets accelerate's generator, and a run stopped mid-epoch continues with exactly the rest
of each rank's shard — and with stoker.torch, the loader doing the work is stoker's. Two
launches per flavour (a first run and a new process group that resumes it), shared by the
tests; nothing is left running afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)


import own_samplers  # noqa: E402
from tests.support.namespaces import loopback_only, run_in_namespace  # noqa: E402

SCRIPT = Path(__file__).with_name("accelerate_main.py")
# A bound on a hang, not on speed: a launch takes ~30-60 s on a quiet 2-core machine and
# several times that on a busy one.
LAUNCH_TIMEOUT_S = 600  # the stoker flavour runs its own samplers too
FLAVOURS = ["torch", "stoker"]
STOP_AFTER_OWN = 3  # accelerate_main.py's STOP_AFTER
LOADER = {"torch": "torch.utils.data.dataloader.DataLoader", "stoker": "stoker._core.torch_loader.DataLoader"}

NO_NAMESPACE = loopback_only()
on_two_ranks = pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE))
pytestmark = pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 20)  # a flavour's first test launches twice


def launch(flavour: str, phase: str, out: Path) -> list[dict[str, Any]]:
    """accelerate_main.py on two ranks; each rank's record."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(sys.path),
        HF_HUB_OFFLINE="1",
        PYTHONWARNINGS="ignore",
        STACKS_AFTER_S=str(LAUNCH_TIMEOUT_S - 10),
    )
    program = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "29500",
        str(SCRIPT),
        flavour,
        str(out),
        phase,
    ]
    run_in_namespace(program, out, env, LAUNCH_TIMEOUT_S, f"{flavour} {phase}")
    return [json.loads((out / f"{flavour}-{phase}-{rank}.json").read_text()) for rank in range(2)]


_runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
_folders: dict[str, Path] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """runs(flavour) -> {"first": [rank 0, rank 1], "second": [...]}, launched once per flavour."""

    def get(flavour: str) -> dict[str, list[dict[str, Any]]]:
        if flavour not in _runs:
            out = tmp_path_factory.mktemp(f"accelerate-{flavour}")
            _folders[flavour] = out
            if flavour == "stoker":  # the shards the own samplers read
                own_samplers.write(str(out / "own-shards"))
            _runs[flavour] = {phase: launch(flavour, phase, out) for phase in ("first", "second")}
        return _runs[flavour]

    yield get
    _runs.clear()


def assert_disjoint_cover(shards: list[list[int]], n: int) -> None:
    assert [len(shard) for shard in shards] == [n // 2, n // 2]
    assert not set(shards[0]) & set(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(range(n))


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


@on_two_ranks
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_each_rank_gets_its_shard_on_the_device_from_the_loader_it_imported(flavour: str, runs: Any) -> None:
    first = runs(flavour)["first"]
    for epoch in range(2):
        assert_disjoint_cover([rank["epochs"][epoch] for rank in first], 64)
    assert first[0]["epochs"][0] != first[0]["epochs"][1]  # shuffled anew each epoch
    for rank in first:
        # accelerate names the CPU "cpu:0", a tensor's device "cpu": the same type, no index
        assert rank["devices"] == [rank["device"].split(":")[0]]
        assert set(rank["kinds"].values()) == {LOADER[flavour]}  # what ran the workers
        assert rank["made_by_stoker"] == [flavour == "stoker"]


@on_two_ranks
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_gradient_accumulation_steps_at_every_epochs_end(flavour: str, runs: Any) -> None:
    for rank in runs(flavour)["first"]:
        for syncs, steps in zip(rank["syncs"], rank["steps"]):
            # 9 batches, accumulation 2: steps at batches 2, 4, 6, 8 and at the epoch's end
            assert syncs == [False, True] * 4 + [True]
            assert steps == 5


@on_two_ranks
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_gather_for_metrics_drops_the_padding(flavour: str, runs: Any) -> None:
    for rank in runs(flavour)["first"]:
        assert sorted(rank["gathered"]) == list(range(17))  # 17, not the 18 the ranks read


@on_two_ranks
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_skip_first_batches_yields_the_rest_of_the_epoch(flavour: str, runs: Any) -> None:
    for rank in runs(flavour)["first"]:
        assert len(rank["epoch3"]) == 32
        assert rank["skipped"] == rank["epoch3"][16:]  # 2 batches of 8 skipped, the rest in order
        assert rank["kinds"]["skipped"] == LOADER[flavour]


@on_two_ranks
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_shuffle_sampler_gets_accelerates_generator(flavour: str, runs: Any) -> None:
    for rank in runs(flavour)["first"]:
        assert rank["sampler"] == {
            "generator_before": False,
            "generator_after": True,
            "shard_wraps_it": True,
            "shard": "BatchSamplerShard",
        }


@on_two_ranks
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_new_process_group_continues_mid_epoch(flavour: str, runs: Any) -> None:
    first, second = runs(flavour)["first"], runs(flavour)["second"]
    assert_disjoint_cover([flat(rank["full"]) for rank in second], 64)
    for before, after in zip(first, second):
        assert len(after["full"]) == 8 and before["head"] == after["full"][:3]
        assert after["after_skip"] == after["full"][3:]  # accelerate's resume, either loader
        if flavour == "stoker":
            # the loader's own state: from state_dict(), or inside accelerator.save_state
            assert after["after_load_state_dict"] == after["full"][3:]
            assert after["after_load_state"] == after["full"][3:]
            assert before["resumable"] == after["resumed_kind"] == LOADER["stoker"]
        else:  # torch's loader has no position: load_state restarts its epoch
            assert after["after_load_state"] == after["full"]


@on_two_ranks
def test_stoker_gives_the_ranks_what_torch_gives_them(runs: Any) -> None:
    """Same seed, same shards in the same order, same accumulation and gathering."""
    torch_run, stoker_run = runs("torch"), runs("stoker")
    keys = ["epochs", "syncs", "steps", "gathered", "epoch3", "skipped", "head"]
    for theirs, ours in zip(torch_run["first"], stoker_run["first"]):
        assert {key: ours[key] for key in keys} == {key: theirs[key] for key in keys}
    for theirs, ours in zip(torch_run["second"], stoker_run["second"]):
        assert ours["full"] == theirs["full"] and ours["after_skip"] == theirs["after_skip"]


@on_two_ranks
def test_auto_workers_survive_prepare(runs: Any) -> None:
    """accelerate builds a torch DataLoader from the loader's attributes (torch compares
    num_workers, checks it against persistent_workers), then stoker's rebuild takes its
    arguments: the loader that runs still asks for "auto" and makes its own choice."""
    first = runs("stoker")["first"]
    assert_disjoint_cover([rank["auto"]["seen"] for rank in first], 64)
    for rank in first:
        chosen = rank["auto"]
        assert isinstance(chosen["given_num_workers"], int) and chosen["given_num_workers"] >= 1
        assert chosen["kind"] == LOADER["stoker"] and chosen["num_workers_is_int"]
        assert chosen["choice"].startswith("num_workers="), chosen


@on_two_ranks
@pytest.mark.parametrize("kind", own_samplers.KINDS)
def test_own_samplers_give_each_rank_its_share_as_without_accelerate(kind: str, runs: Any) -> None:
    """A ShardedSampler or StreamSampler already gives each rank its share; accelerate's
    BatchSamplerShard would keep every other batch of it. Prepared, the loader gives each rank
    exactly what the plain loader gives it without accelerate, in order, every epoch
    (accelerate sets the sampler's epoch); skip_first_batches, save_state/load_state and the
    loader's own state_dict resume it exactly; gather_for_metrics drops nothing."""
    result = runs("stoker")
    folder = str(_folders["stoker"] / "own-shards")
    batches = -(-own_samplers.share(kind) // own_samplers.BATCH)
    skip = 2 * own_samplers.BATCH
    head = STOP_AFTER_OWN * own_samplers.BATCH
    plain = [own_samplers.plain(kind, folder, rank, epochs=3) for rank in range(2)]
    for rank, (first, second) in enumerate(zip(result["first"], result["second"])):
        ours, resumed, expected = first["own"][kind], second["own"][kind], plain[rank]
        assert ours["epochs"] == expected[:2], rank
        assert len(ours["epochs"][0]) == own_samplers.share(kind) and ours["len"] == batches
        assert ours["skipped"] == expected[2][skip:], rank
        assert ours["head"] == expected[0][:head]
        assert resumed["after_load_state"] == expected[0][head:], rank
        assert resumed["after_load_state_dict"] == expected[0][head:], rank
        assert ours["kinds"] == [LOADER["stoker"]]
        assert ours["warnings"] == []
        if kind == "sharded":  # every rank's every sample, the sampler's padding included
            assert sorted(ours["gathered"]) == sorted(plain[0][0] + plain[1][0])


@on_two_ranks
@pytest.mark.parametrize("setting", ["split_batches", "dispatch_batches"])
def test_own_samplers_warn_where_accelerate_splits_batches_itself(setting: str, runs: Any) -> None:
    for rank in runs("stoker")["first"]:
        for kind in own_samplers.KINDS:
            (message,) = rank["own"][kind]["warned"][setting]
            assert f"{setting}=True" in message and f"{setting}=False" in message, message


# ------------------------------------------------------------ in one process, no ranks
ONE_PROCESS = """
import os, sys, warnings
import torch
import stoker.torch
from accelerate import Accelerator
from accelerate.utils import set_seed

class Numbers(stoker.torch.Dataset):
    def __len__(self): return 24
    def __getitem__(self, i): return i

class Stream(stoker.torch.IterableDataset):
    def __iter__(self): return iter(range(10))

accelerator = Accelerator(cpu=True)

# a stream that keeps no position: stoker runs it, and its state is a replay of each worker's
# stream (as torchdata's), saved like any other
stream = accelerator.prepare(stoker.torch.DataLoader(Stream(), batch_size=4, num_workers=1))
assert type(stream.base_dataloader) is stoker.torch.DataLoader
assert [b.tolist() for b in stream] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
assert stream.state_dict()["replicas"]["records"] == [None]  # its next epoch: new workers, afresh

# accelerator.save_state / load_state carry the loader's position (each run its own Accelerator)
def prepared():
    global accelerator
    set_seed(3)
    accelerator = Accelerator(cpu=True)
    return accelerator.prepare(stoker.torch.DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2))

full = [b.tolist() for b in prepared()]
loader = prepared()
iterator = iter(loader)
head = [next(iterator).tolist() for _ in range(2)]
accelerator.save_state(sys.argv[1])
iterator.close()
resumed = prepared()
accelerator.load_state(sys.argv[1])
assert head + [b.tolist() for b in resumed] == full, (head, full)

# an adopted accelerator's skip_first_batches turns an unprepared torch loader into stoker's
stoker.torch.adopt(accelerator, max_worker_restarts=2)
skipped = accelerator.skip_first_batches(torch.utils.data.DataLoader(Numbers(), batch_size=4), 4)
assert type(skipped) is stoker.torch.DataLoader and skipped.max_worker_restarts == 2
assert [b.tolist() for b in skipped] == [[16, 17, 18, 19], [20, 21, 22, 23]]
print("ok")
"""


def _python(code: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-c", code, *arguments], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env
    )


def test_streams_checkpoints_and_an_adopted_skip_in_one_process(tmp_path: Path) -> None:
    done = _python(ONE_PROCESS, str(tmp_path / "state"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]
    assert (tmp_path / "state" / "dl_state_dict.bin").exists()  # the loader's state, saved by accelerate


HOOK_FAILS = """
import warnings
import stoker.torch
from stoker._frameworks import accelerate as hook

def broken(module):
    raise KeyError("an accelerate internal that moved")

hook._patch = broken
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from accelerate import Accelerator  # still imports
import accelerate.accelerator
assert not getattr(accelerate.accelerator.Accelerator.prepare_data_loader, "_stoker_wrapped", False)
assert accelerate.accelerator.__spec__.loader.__class__.__name__ != "_PatchAfterExec"
messages = [str(w.message) for w in caught if "stoker" in str(w.message)]
assert len(messages) == 1 and "rebuilt as torch DataLoaders" in messages[0], messages
print("ok")
"""


def test_a_failing_wrap_never_fails_importing_accelerate() -> None:
    done = _python(HOOK_FAILS)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]


def test_an_unusable_accelerate_is_warned_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import ModuleType

    from stoker._frameworks import accelerate as hook

    monkeypatch.setattr(hook, "_warned", False)
    with pytest.warns(RuntimeWarning, match="rebuilt as torch DataLoaders") as caught:
        hook._patch(ModuleType("accelerate.accelerator"))
        hook._patch(ModuleType("accelerate.accelerator"))
    assert len([w for w in caught if "stoker" in str(w.message)]) == 1
