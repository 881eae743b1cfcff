"""stoker's own samplers of a rank's share (`ShardedSampler`, `StreamSampler`) as the frameworks
see them, in one process: of torch's DistributedSampler kind once torch is imported (and only
then: `stoker.shards` and `stoker.mix` never import it), pickled and copied as such, resumed on
another rank of the same world exactly as the uninterrupted epoch (Lightning and accelerate
save one rank's loader state for all), and accelerate's shard of them left open in a torch
loader too. The runs on two real ranks are in test_lightning.py, test_accelerate.py and
test_transformers.py."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import own_samplers  # noqa: E402
import torch.utils.data as tud  # noqa: E402

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("own") / "shards")
    own_samplers.write(folder)
    return folder


def _python(code: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-c", code, *arguments], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )


WITHOUT_TORCH = """
import sys
import numpy as np
from stoker.mix import PackedDataset, StreamSampler, TokenDataset
from stoker.shards import ShardedDataset, ShardedSampler
rows = PackedDataset(TokenDataset.from_documents([np.arange(1, 9)] * 5), seq_len=8, window_size=4)
sampler = StreamSampler(rows, num_replicas=2, rank=1)
assert type(sampler) is StreamSampler and list(sampler) == list(range(len(rows)))[1::2], list(sampler)
assert "torch" not in sys.modules, "stoker.shards or stoker.mix imported torch"
print("ok")
"""


def test_without_torch_they_are_stokers_classes_and_torch_stays_unimported() -> None:
    done = _python(WITHOUT_TORCH)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]


@pytest.mark.parametrize("kind", own_samplers.KINDS)
def test_made_with_torch_imported_they_are_torch_distributed_samplers(kind: str, shards: str) -> None:
    from stoker.mix import StreamSampler
    from stoker.shards import ShardedSampler

    cls = ShardedSampler if kind == "sharded" else StreamSampler
    data = own_samplers.dataset(kind, shards)
    sampler = own_samplers.sampler(kind, data, num_replicas=2, rank=1)
    assert isinstance(sampler, tud.DistributedSampler) and isinstance(sampler, cls)
    assert (type(sampler).__name__, type(sampler).__module__) == (cls.__name__, cls.__module__)
    assert type(own_samplers.sampler(kind, data, num_replicas=2, rank=0)) is type(sampler)  # made once
    sampler.set_epoch(1)
    for again in (pickle.loads(pickle.dumps(sampler)), copy.deepcopy(sampler), copy.copy(sampler)):
        assert type(again) is type(sampler) and again.epoch == 1 and list(again) == list(sampler)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kind", own_samplers.KINDS)
def test_another_ranks_state_resumes_this_ranks_uninterrupted_share(kind: str, drop_last: bool, shards: str) -> None:
    """Lightning checkpoints rank 0's loader state and every rank loads it; accelerate's
    save_state keeps the one its ranks last wrote. On the same world size each rank goes on
    with its own uninterrupted share, the padding of an odd epoch included."""
    stopped = own_samplers.loader(kind, shards, num_replicas=2, rank=0, drop_last=drop_last)
    iterator = iter(stopped)
    for _ in range(3):
        next(iterator)
    state = stopped.state_dict()
    del iterator
    for rank in range(2):
        whole = own_samplers.loader(kind, shards, num_replicas=2, rank=rank, drop_last=drop_last)
        expected = [i for batch in whole for i in own_samplers.identities(kind, batch)]
        resumed = own_samplers.loader(kind, shards, num_replicas=2, rank=rank, drop_last=drop_last)
        resumed.load_state_dict(state)
        rest = [i for batch in resumed for i in own_samplers.identities(kind, batch)]
        assert rest == expected[3 * own_samplers.BATCH :], rank


TORCH_LOADER_UNDER_ACCELERATE = """
import sys, warnings
import torch
import own_samplers
import stoker.torch  # wraps accelerate's prepare when it is imported
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from stoker._frameworks.accelerate import keep_share

folder = sys.argv[1]
data = own_samplers.dataset("stream", folder)
for rank in range(2):
    sampler = own_samplers.sampler("stream", data, num_replicas=2, rank=rank)
    given = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, collate_fn=own_samplers.collate("stream"))
    # what Accelerator.prepare makes of it on rank `rank` of 2, then stoker's wrapping
    prepared = prepare_data_loader(given, num_processes=2, process_index=rank, put_on_device=False)
    keep_share(prepared)
    assert type(prepared.base_dataloader) is torch.utils.data.DataLoader  # a torch loader stays torch's
    for epoch in range(2):
        seen = [i for batch in prepared for i in own_samplers.identities("stream", batch)]
        assert seen == own_samplers.plain("stream", folder, rank)[epoch], (rank, epoch)
    skipped = Accelerator(cpu=True).skip_first_batches(prepared, 2)
    assert [i for b in skipped for i in own_samplers.identities("stream", b)] == own_samplers.plain("stream", folder, rank, 3)[2][8:]
    split = prepare_data_loader(given, num_processes=2, process_index=rank, split_batches=True, put_on_device=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keep_share(split)
    assert any("split_batches=False" in str(w.message) for w in caught), [str(w.message) for w in caught]
print("ok")
"""


def test_a_torch_loader_with_an_own_sampler_keeps_its_share_under_accelerate(shards: str) -> None:
    """The same for torch's DataLoader once stoker.torch is imported: accelerate's shard of a
    StreamSampler's batches is left open (the loader stays torch's); skip_first_batches gives
    the rest; split_batches, which stoker cannot leave open, warns with the setting to change."""
    done = _python(TORCH_LOADER_UNDER_ACCELERATE, shards)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]


def test_lightning_keeps_them(shards: str) -> None:
    """Lightning's check for a loader that needs its DistributedSampler: not one of these."""
    pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.trainer.connectors.data_connector import _DataConnector

    class _Trainer:  # what _DataConnector reads of its trainer to decide on a sampler
        _accelerator_connector = type("Connector", (), {"use_distributed_sampler": True, "is_distributed": True})()

    connector = _DataConnector(_Trainer())  # type: ignore[arg-type]
    for kind in own_samplers.KINDS:
        loader = own_samplers.loader(kind, shards, num_replicas=2, rank=0)
        assert not connector._requires_distributed_sampler(loader), kind
        # the control: the same loader without the sampler gets Lightning's
        assert connector._requires_distributed_sampler(type(loader)(loader.dataset, batch_size=4)), kind
