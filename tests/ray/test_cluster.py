"""stoker.ray on a real two-node Ray cluster in a loopback-only network namespace.

The cluster runs once per session (see conftest.py, cluster_session.py); each test judges one
scenario's record against what stoker's own samplers and loader give in this process. Every test
that needs the cluster is in this file: `make test` hands each file whole to one pytest-xdist
worker, so the session starts once.

The docs' Ray section (docs/guide/ranks-and-ray.md, "Ray: `stoker.ray`") is judged here too: the
example it shows is examples/ray_resume.py, included into the page as it is, and it runs as
written (against the test cluster, as a second driver: cluster_session.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ray_datasets import BatchSeeded, Indexed, Seeded

import stoker

pytestmark = pytest.mark.timeout(300)  # the first test also waits for the cluster session
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ray_resume.py"
PAGE = ROOT / "docs" / "guide" / "ranks-and-ray.md"


def listify(batch):
    if isinstance(batch, (list, tuple)):
        return [listify(b) for b in batch]
    tolist = getattr(batch, "tolist", None)
    return tolist() if tolist is not None else batch


def sampler_batches(n, batch_size, *, shuffle, seed, epoch, rank, world, drop_last=False, elastic=None):
    sampler = stoker.DistributedSampler(
        Indexed(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    sampler.set_epoch(epoch)
    if elastic is not None:
        sampler.resume_elastic(*elastic)
    return [list(b) for b in stoker.BatchSampler(sampler, batch_size, drop_last)]


def test_the_cluster_listens_on_loopback_only(cluster_run):
    assert cluster_run["addresses"] == ["127.0.0.1"]


@pytest.mark.scenario("nodes")
def test_read_tasks_ran_on_both_nodes(scenario):
    assert scenario["indices"] == list(range(64))
    assert len(scenario["cluster_nodes"]) == 2
    assert scenario["read_nodes"] == scenario["cluster_nodes"]


@pytest.mark.scenario("exact")
def test_samples_come_back_as_the_very_objects(scenario):
    assert scenario["keys"] == list(range(12))
    assert scenario["same"] is True
    assert scenario["types"][:4] == ["dict", "tuple", "ndarray", "dict"]


@pytest.mark.scenario("ranks")
def test_each_rank_reads_its_sampler_shard(scenario):
    for rank in range(2):
        want = [sampler_batches(50, 4, shuffle=True, seed=7, epoch=epoch, rank=rank, world=2) for epoch in range(2)]
        assert scenario[str(rank)]["epochs"] == want
        assert scenario[str(rank)]["len"] == len(want[1])
    assert scenario["0"]["epochs"][0] != scenario["0"]["epochs"][1]  # set_epoch reshuffles


@pytest.mark.scenario("seeds")
@pytest.mark.parametrize("name, dataset_class", [("per_sample", Seeded), ("batched", BatchSeeded)])
def test_sample_rng_matches_stokers_local_workers(scenario, name, dataset_class):
    dataset = dataset_class(30)
    sampler = stoker.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=11)
    loader = stoker.DataLoader(
        dataset, batch_size=4, sampler=sampler, generator=11, num_workers=2, persistent_workers=True
    )
    local = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        local.append([listify(b) for b in loader])
    assert scenario[name] == local
    draws = [d for epoch in local for batch in epoch for d in batch[1]]
    assert len(set(draws)) > len(draws) * 0.9  # the draws are draws, not a constant


@pytest.mark.scenario("resume")
def test_a_resumed_rank_yields_exactly_the_remaining_batches(scenario):
    same = scenario["same"]
    want = sampler_batches(45, 3, shuffle=True, seed=5, epoch=1, rank=1, world=2)
    assert same["state"]["position"] == 2
    assert same["first"] == want[:2]
    assert same["rest"] == want[2:]


@pytest.mark.scenario("resume")
def test_an_elastic_resume_splits_what_no_old_rank_consumed(scenario):
    elastic = scenario["elastic"]
    old_total = stoker.DistributedSampler(Indexed(45), num_replicas=2, rank=0).total_size
    consumed = [i for batch in elastic["consumed"] for i in batch]
    rest = {}
    for rank in range(3):
        want = sampler_batches(45, 3, shuffle=True, seed=5, epoch=1, rank=rank, world=3, elastic=(6, 2, old_total))
        got = elastic["rest"][str(rank)]
        assert got["batches"] == want
        assert got["len"] == len(want)
        rest[rank] = [i for batch in got["batches"] for i in batch]
    new = [i for r in rest.values() for i in r]
    assert len(consumed) == 12
    assert not set(consumed) & set(new)
    assert set(consumed) | set(new) == set(range(45))
    assert len(new) == len(set(new)) == 33
    full = len(stoker.BatchSampler(stoker.DistributedSampler(Indexed(45), num_replicas=3, rank=0), 3))
    assert elastic["rest"]["0"]["next_epoch_len"] == full  # the epoch after is an ordinary one


@pytest.mark.scenario("failing")
def test_an_error_in_a_read_task_names_the_sample(scenario):
    assert scenario["type"] == "stoker.ray.ReadError"
    assert "sample index 13" in scenario["message"]
    assert "KeyError" in scenario["message"] and "no sample 13 here" in scenario["message"]
    assert scenario["exc_type"] == "KeyError"


@pytest.mark.scenario("unpicklable")
def test_an_unpicklable_dataset_is_named(scenario):
    assert scenario["type"] == "stoker.ray.ShippingError"
    message = scenario["message"]
    assert "HoldsLock" in message and "ray_datasets" in message
    assert "pickle" in message and "runtime_env" in message


@pytest.mark.scenario("unimportable")
def test_a_dataset_the_workers_cannot_import_is_named(scenario):
    assert scenario["type"] == "stoker.ray.ShippingError"
    message = scenario["message"]
    assert "Elsewhere" in message and "elsewhere_dataset" in message
    assert "runtime_env" in message and "py_modules" in message


@pytest.mark.scenario("split")
def test_streaming_split_yields_every_sample_once(scenario):
    assert scenario["errors"] == [] and scenario["alive"] == [False, False]
    indices = [i for split in scenario["splits"] for batch in split for i in batch]
    assert sorted(indices) == list(range(40))
    assert all(split for split in scenario["splits"])  # both splits took batches
    assert "not resumable" in scenario["refused"]


@pytest.mark.scenario("torch")
def test_collate_fn_chooses_numpy_or_torch(scenario):
    assert scenario["torch_types"] == ["torch.Tensor", "torch.Tensor"]
    assert scenario["numpy_types"] == ["numpy.ndarray", "numpy.ndarray"]
    assert scenario["shapes"] == [[4, 3, 8, 8], [4, 3, 8, 8]]
    assert scenario["firsts"] == [0, 4]


def test_nothing_is_left_after_shutdown(cluster_run):
    assert cluster_run["left_after_shutdown"] == []
    assert cluster_run["left_on_host"] == []


# ------------------------------------------------------------ the docs' example
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
