"""torchtitan's pattern on two gloo ranks (inside a network namespace with only the loopback
interface): a data loader that is also `torch.distributed.checkpoint`'s `Stateful`, storing
each data-parallel rank's state under its own key (pickled, as torchtitan's
ParallelAwareDataloader does), saved with `dcp.save` mid-epoch; the ranks go on past the
checkpoint and are SIGKILLed with their workers busy; new ranks `dcp.load` the checkpoint and
continue with exactly what the uninterrupted ranks read after that step, through the next
epoch. torchdata's StatefulDataLoader and stoker.torch's side by side in the same ranks, over a
map-style dataset with torch's DistributedSampler (the same seeded order for both) and over an
iterable that shards itself by rank and worker (saved_dcp_main.py). Two launches (train, with
the uninterrupted run first; resume), shared by the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchdata", minversion="0.11")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)

from tests.frameworks.saved_ranks import launch_world  # noqa: E402
from tests.support.namespaces import loopback_only  # noqa: E402

SCRIPT = Path(__file__).with_name("saved_dcp_main.py")
# A bound on a hang, not on speed: a launch takes ~30-60 s on a quiet 2-core machine and
# several times that on a busy one.
LAUNCH_TIMEOUT_S = 600  # the script's own per-rank limit is RANK_TIMEOUT_S, below it
N, BATCH, EPOCHS, STOP, AFTER = 24, 2, 2, 2, 2  # saved_dcp_main.py's
LIBRARIES = ["torchdata", "stoker"]
KINDS = ["map", "stream"]
LOADERS = [f"{kind}-{library}" for library in LIBRARIES for kind in KINDS]
EXPECTED_CODES = {"train": [-9, -9], "resume": [0, 0]}

NO_NAMESPACE = loopback_only()
pytestmark = [
    pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE)),
    pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30),  # the first test launches both
]


def launch(mode: str, out: Path) -> list[dict[str, Any]]:
    """saved_dcp_main.py's MODE on two ranks; each rank's record."""
    return launch_world(
        SCRIPT, mode, out, LAUNCH_TIMEOUT_S, f"DCP {mode}", EXPECTED_CODES[mode], LIBRARIES=",".join(LIBRARIES)
    )


_runs: dict[str, Any] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """{"train", "resume": [rank 0's record, rank 1's], "out": the folder}, launched once."""
    if not _runs:
        out = tmp_path_factory.mktemp("dcp")
        for mode in ("train", "resume"):
            _runs[mode] = launch(mode, out)
        _runs["out"] = out
    yield _runs
    _runs.clear()


@pytest.mark.parametrize("name", LOADERS)
def test_ranks_killed_after_a_checkpoint_resume_from_it_exactly(name: str, runs: Any) -> None:
    for rank in range(2):
        train, resumed = runs["train"][rank][name], runs["resume"][rank][name]["resumed"]
        full = train["full"]
        assert [len(epoch) for epoch in full] == [N // 2 // BATCH] * EPOCHS, (name, rank)
        assert train["head"] == full[0][:STOP], (name, rank)
        assert train["after"] == full[0][STOP : STOP + AFTER], (name, rank)  # killed past the checkpoint
        assert runs["resume"][rank]["epoch"] == 0
        assert resumed == [full[0][STOP:], *full[1:]], (name, rank)


@pytest.mark.parametrize("kind", KINDS)
def test_each_epoch_is_shared_out_over_the_ranks(kind: str, runs: Any) -> None:
    for library in LIBRARIES:
        for epoch in range(EPOCHS):
            shares = [
                [i for step in runs["train"][r][f"{kind}-{library}"]["full"][epoch] for i in step] for r in range(2)
            ]
            assert sorted(shares[0] + shares[1]) == list(range(N)), (library, epoch)


@pytest.mark.parametrize("kind", KINDS)
def test_stoker_gives_each_rank_what_torchdata_gives_it(kind: str, runs: Any) -> None:
    for mode in ("train", "resume"):
        for rank in range(2):
            ours, theirs = runs[mode][rank][f"{kind}-stoker"], runs[mode][rank][f"{kind}-torchdata"]
            assert ours == theirs, (mode, rank)


def test_each_rank_stored_its_state_under_its_own_key(runs: Any) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    stored = set(FileSystemReader(str(runs["out"] / "checkpoint")).read_metadata().state_dict_metadata)
    expected = {f"{name}.{key}" for name in LOADERS for key in ("dp_rank_0", "dp_rank_1", "world_size")}
    assert stored == expected | {"progress.epoch"}


def test_the_loaders_are_the_libraries_own(runs: Any) -> None:
    for rank in range(2):
        bases = runs["resume"][rank]["bases"]
        for kind in KINDS:
            assert bases[f"{kind}-torchdata"] == "torchdata.stateful_dataloader.stateful_dataloader.StatefulDataLoader"
            assert bases[f"{kind}-stoker"].startswith("stoker.")
            assert bases[f"{kind}-stoker"].endswith(".StatefulDataLoader")
