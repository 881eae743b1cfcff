"""accelerate with `DataLoaderConfiguration(use_stateful_dataloader=True)` on two CPU ranks (gloo,
inside a network namespace with only the loopback interface; saved_accelerate_main.py): a
stoker.torch DataLoader given to `prepare` stays stoker's (stoker's StatefulDataLoader where
accelerate builds torchdata's), `save_state` carries stoker's own state, ranks killed (SIGKILL)
mid-epoch after it resume with `load_state` exactly where they were, through the next epoch, and
`skip_first_batches` (accelerate's way without a loader state) gives exactly the rest of the
epoch. A torch DataLoader prepared beside it (accelerate's torchdata StatefulDataLoader) is the
control, over the same datasets, the same seed and the same interruption point. Three
launches (full, train, resume), shared by the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("torchdata", minversion="0.11")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)

from tests.frameworks.saved_ranks import launch_world  # noqa: E402
from tests.support.namespaces import loopback_only  # noqa: E402

SCRIPT = Path(__file__).with_name("saved_accelerate_main.py")
# A bound on a hang, not on speed: a launch takes ~30-60 s on a quiet 2-core machine and
# several times that on a busy one.
LAUNCH_TIMEOUT_S = 600
N, BATCH, EPOCHS, STOP, AFTER = 48, 4, 2, 2, 2  # saved_accelerate_main.py's
KINDS = ["map", "stream"]
FLAVOURS = ["torchdata", "stoker"]
TORCHDATA = "torchdata.stateful_dataloader.stateful_dataloader.StatefulDataLoader"
TORCH = "torch.utils.data.dataloader.DataLoader"
EXPECTED_CODES = {"full": [0, 0], "train": [-9, -9], "resume": [0, 0]}

NO_NAMESPACE = loopback_only()
pytestmark = [
    pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE)),
    pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 30),  # the first test launches all three
]


def launch(mode: str, out: Path) -> list[dict[str, Any]]:
    """saved_accelerate_main.py's MODE on two ranks; each rank's record."""
    return launch_world(
        SCRIPT, mode, out, LAUNCH_TIMEOUT_S, f"accelerate {mode}", EXPECTED_CODES[mode], HF_HUB_OFFLINE="1"
    )


_runs: dict[str, Any] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """{"full", "train", "resume": [rank 0's record, rank 1's], "out": the folder}, launched once."""
    if not _runs:
        out = tmp_path_factory.mktemp("accelerate-stateful")
        for mode in ("full", "train", "resume"):
            _runs[mode] = launch(mode, out)
        _runs["out"] = out
    yield _runs
    _runs.clear()


def _of(runs: Any, rank: int, name: str) -> tuple[Any, Any, Any, Any]:
    full, train, resume = (runs[mode][rank] for mode in ("full", "train", "resume"))
    return full[name], train[name], resume[name], resume["skipped"][name]


@pytest.mark.parametrize("kind", KINDS)
def test_stoker_resumes_exactly_after_save_state_kill_and_load_state(kind: str, runs: Any) -> None:
    for rank in range(2):
        full, train, resumed, _ = _of(runs, rank, f"{kind}-stoker")
        assert [len(epoch) for epoch in full] == [N // 2 // BATCH] * EPOCHS
        assert train["head"] == full[0][:STOP] and train["after"] == full[0][STOP : STOP + AFTER], rank
        assert resumed == [full[0][STOP:], *full[1:]], rank


@pytest.mark.parametrize("kind", KINDS)
def test_stoker_skip_first_batches_gives_the_rest_of_the_epoch(kind: str, runs: Any) -> None:
    for rank in range(2):
        full, _, _, skipped = _of(runs, rank, f"{kind}-stoker")
        assert skipped == full[0][STOP:], rank


def test_the_control_resumes_its_stream_exactly(runs: Any) -> None:
    for rank in range(2):
        full, train, resumed, skipped = _of(runs, rank, "stream-torchdata")
        assert train["head"] == full[0][:STOP] and train["after"] == full[0][STOP : STOP + AFTER], rank
        assert resumed == [full[0][STOP:], *full[1:]] and skipped == full[0][STOP:], rank


@pytest.mark.parametrize("kind", KINDS)
def test_stoker_gives_each_rank_what_the_control_gives_it(kind: str, runs: Any) -> None:
    """The same batches on each rank, uninterrupted, resumed and skipped. One exception, the
    control's own: with workers, torchdata's `state_dict()` (which accelerate calls while it
    builds the loader) starts an iterator that draws its first epoch from torch's
    RandomSampler, before accelerate puts its seedable sampler in; the control's uninterrupted
    epoch 0 is then not the seedable sampler's, while its resumed epoch 0 is (accelerate 1.15,
    torchdata 0.11). Stoker's loader draws from the sampler accelerate put in, every time."""
    for rank in range(2):
        ours, theirs = _of(runs, rank, f"{kind}-stoker"), _of(runs, rank, f"{kind}-torchdata")
        if kind == "stream":
            assert ours[0] == theirs[0], rank
        else:
            assert ours[0][1:] == theirs[0][1:], rank  # the epoch after
        assert ours[2] == theirs[2] and ours[3] == theirs[3], rank  # resumed, skipped


def test_the_loaders_doing_the_work(runs: Any) -> None:
    for mode in ("full", "resume"):
        for rank in range(2):
            kinds = runs[mode][rank]["kinds"]
            for kind in KINDS:
                assert kinds[f"{kind}-torchdata"] == TORCHDATA
                module, _, name = kinds[f"{kind}-stoker"].rpartition(".")
                assert module.startswith("stoker.") and name == "StatefulDataLoader", kinds
    for rank in range(2):
        skipped = runs["resume"][rank]["skipped_kinds"]  # accelerate builds a plain loader here
        for kind in KINDS:
            assert skipped[f"{kind}-torchdata"] == TORCH
            assert skipped[f"{kind}-stoker"].startswith("stoker."), skipped


def test_save_state_wrote_each_loaders_state_for_a_weights_only_load(runs: Any) -> None:
    """accelerate writes one state file per prepared loader (in the order prepared: the control's
    two, then stoker's two) and reads it back with torch.load(weights_only=True)."""
    folder = runs["out"] / "state"
    names = ["dl_state_dict.bin", "dl_state_dict_1.bin", "dl_state_dict_2.bin", "dl_state_dict_3.bin"]
    assert sorted(p.name for p in folder.glob("dl_state_dict*.bin")) == names
    for name in names:
        state = torch.load(folder / name, weights_only=True)
        assert state["_iterator_finished"] is False  # accelerate's own key, on any loader's state
