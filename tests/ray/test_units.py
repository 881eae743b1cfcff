"""stoker.ray's pure parts, without a cluster: read-task slicing, the shard each rank reads,
state refusal, and that `import stoker` never imports Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ray_datasets import Indexed

import stoker
import stoker.ray as sray

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("count, parts", [(0, 3), (1, 3), (7, 3), (9, 3), (10, 4), (100, 7), (5, 5), (3, 1)])
def test_contiguous_slices_cover_in_order_evenly(count, parts):
    runs = sray.contiguous_slices(count, parts)
    assert len(runs) == min(count, parts)
    covered = [i for start, stop in runs for i in range(start, stop)]
    assert covered == list(range(count))
    sizes = [stop - start for start, stop in runs]
    assert all(size > 0 for size in sizes)
    if sizes:
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("count, tasks", [(200, 3), (64, 8), (5, 2), (130, 1)])
def test_sample_tasks_take_contiguous_slices_fetched_in_chunks(count, tasks):
    indices = list(range(100, 100 + count))[::-1]
    made = sray._sample_tasks(indices, tasks)
    assert len(made) == min(tasks, count)
    flat = [i for task in made for _, unit in task for i in unit]
    assert flat == indices
    for task in made:
        for position, unit in task:
            assert 0 < len(unit) <= sray.SAMPLES_PER_FETCH
            assert indices[position] == unit[0]


def test_batch_tasks_keep_batches_whole_and_in_order():
    units = list(enumerate([[i, i + 1] for i in range(0, 20, 2)]))
    made = sray._batch_tasks(units, 3)
    assert [len(t) for t in made] == [4, 3, 3]
    assert [u for t in made for u in t] == units


def test_read_task_count_rule():
    # a user's number wins, bounded by the units
    assert sray.read_task_count(10, 2, requested=3) == 3
    assert sray.read_task_count(2, 2, requested=8) == 2
    # default: one task per UNITS_PER_TASK units, at least one per CPU, at most one per unit
    per = sray.UNITS_PER_TASK
    assert sray.read_task_count(per * 100, 2) == 100
    assert sray.read_task_count(per * 100 + 1, 2) == 101
    assert sray.read_task_count(per * 4, 16) == 16
    assert sray.read_task_count(3, 16) == 3
    assert sray.read_task_count(1, 64) == 1
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"read_tasks should be an int >= 1 or None, but got read_tasks={bad}"):
            sray.read_task_count(10, 2, requested=bad)
    for bad_type in (2.5, True):
        with pytest.raises(TypeError, match=f"read_tasks should be an int >= 1 or None, but got read_tasks={bad_type}"):
            sray.read_task_count(10, 2, requested=bad_type)


@pytest.mark.parametrize(
    "n, batch, world, drop_last", [(50, 4, 2, False), (45, 3, 3, True), (7, 4, 4, False), (10, 3, 1, True)]
)
def test_rank_batches_are_the_samplers(n, batch, world, drop_last):
    for rank in range(world):
        for shuffle in (False, True):
            sampler = stoker.DistributedSampler(
                Indexed(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=9, drop_last=drop_last
            )
            sampler.set_epoch(3)
            want = list(stoker.BatchSampler(sampler, batch, drop_last))
            got = sray.rank_batches(
                n, batch, shuffle=shuffle, seed=9, epoch=3, rank=rank, world_size=world, drop_last=drop_last
            )
            assert got == want


def test_base_seed_is_the_local_loaders_first_draw():
    import numpy as np

    assert sray.base_seed_of(11) == int(np.random.default_rng(11).integers(0, 2**63 - 1))
    assert sray.base_seed_of(11) != sray.base_seed_of(12)


def make(**kwargs):
    args = {"batch_size": 4, "shuffle": True, "seed": 3, "rank": 0, "world_size": 2}
    args.update(kwargs)
    dataset = args.pop("dataset", Indexed(40))
    return sray.DataLoader(dataset, **args)


def test_a_state_of_another_configuration_is_refused_naming_what_differs():
    saved = make()
    saved.set_epoch(2)
    saved._position = 3  # as if three batches had been delivered
    state = json.loads(json.dumps(saved.state_dict()))
    loader = make(batch_size=8, seed=4)
    with pytest.raises(ValueError) as caught:
        loader.load_state_dict(state)
    message = str(caught.value)
    assert "batch_size: saved 4, this loader 8" in message
    assert "seed: saved 3, this loader 4" in message
    assert "not applied" in message
    assert (loader.epoch, loader._position) == (0, 0)  # nothing applied
    for change, words in [
        ({"dataset": Indexed(41)}, "dataset_length: saved 40, this loader 41"),
        ({"shuffle": False}, "shuffle: saved True, this loader False"),
        ({"drop_last": True}, "drop_last: saved False, this loader True"),
    ]:
        with pytest.raises(ValueError, match=words):
            make(**change).load_state_dict(state)
    with pytest.raises(ValueError, match=r"made by stoker\.ray\.DataLoader\.state_dict"):
        make().load_state_dict({"version": 1, "position": 0})


def test_a_state_of_the_same_configuration_is_applied():
    saved = make(rank=1)
    saved.set_epoch(2)
    saved._position = 3
    loader = make(rank=1)
    loader.load_state_dict(saved.state_dict())
    assert (loader.epoch, loader._position) == (2, 3)
    # another world size: an elastic resume of the rest of epoch 2
    elastic = make(world_size=3)
    elastic.load_state_dict(saved.state_dict())
    assert (elastic.epoch, elastic._position) == (2, 0)
    assert elastic._elastic == (12, 2, 40)
    rest = sray.rank_batches(
        40, 4, shuffle=True, seed=3, epoch=2, rank=0, world_size=3, drop_last=False, elastic=(12, 2, 40)
    )
    # the old ranks took 2 x 12 of 40 samples: 16 left, 6 (padded) for each of 3 ranks
    assert len(elastic) == len(rest) == 2


def test_a_second_elastic_resume_within_an_epoch_is_refused():
    saved = make()
    saved._position = 2
    three = make(world_size=3)
    three.load_state_dict(saved.state_dict())
    three._position = 1  # one batch of the elastic rest delivered
    with pytest.raises(ValueError, match="itself resumed from another world size"):
        make(world_size=4).load_state_dict(three.state_dict())
    again = make(world_size=3)
    again.load_state_dict(three.state_dict())  # the same world size goes on
    assert (again._elastic, again._position) == ((8, 2, 40), 1)


def test_in_order_false_refuses_state_dict():
    with pytest.raises(ValueError, match=r"in_order=False.*not exactly resumable"):
        make(in_order=False).state_dict()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch_size should be an int >= 1, but got batch_size=0"):
        make(batch_size=0)
    with pytest.raises(TypeError, match="batch_size should be an int >= 1, but got batch_size='2'"):
        make(batch_size="2")
    with pytest.raises(ValueError, match="Invalid rank 2"):
        make(rank=2)
    with pytest.raises(TypeError, match="shuffle should be True or False, but got shuffle='yes'"):
        make(shuffle="yes")
    with pytest.raises(TypeError, match=r"seed should be an int or None, but got seed=1\.5"):
        make(seed=1.5)
    with pytest.raises(TypeError, match="map-style"):
        sray.DataLoader(iter([]), batch_size=2)


def test_import_stoker_never_imports_ray():
    code = (
        "import sys, stoker, stoker.torch\n"
        "stoker.DataLoader(list(range(4)), batch_size=2)\n"
        "import stoker.ray\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def assert_same(got, want):
    """Equal, with the same types all the way down (and the same dtype and shape for arrays)."""
    import numpy as np

    assert type(got) is type(want)
    if isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert np.array_equal(got, want)
    elif type(want).__module__ == "torch":
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert bool((got == want).all())
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want


def test_batch_rows_rebuild_batches_exactly_even_split_over_blocks():
    pa = pytest.importorskip("pyarrow")
    import numpy as np

    large = sray.IN_BAND_BYTES
    batches = [
        {"image": np.arange(24, dtype=np.uint8).reshape(2, 3, 4), "label": np.array([1, 2]), "name": ["a", "b"]},
        # two large arrays (a row each) and a small one (inside the pickle)
        (np.ones((2, large), np.uint8), np.full(large, 7, np.int16), np.arange(3), "text", None),
        [np.zeros(0), np.arange(5)[::2], np.arange(2 * large)[::2]],  # empty, non-contiguous (in band)
    ]
    tables = [sray._batch_block(position, batch) for position, batch in enumerate(batches)]
    assert [t.num_rows for t in tables] == [1, 2, 1]
    assert len(tables[1].column("header").to_pylist()[0]) < 1024  # the large arrays are not in it
    whole = pa.concat_tables(tables)
    cut = 2  # between the second batch's two rows: Ray hands such a batch over as two blocks
    pieces = [whole.slice(0, cut), whole.slice(cut)]
    rows = sray._BatchRows()
    got = [made for piece in pieces for made in rows.feed(piece)] + list(rows.finish())
    assert [position for position, _ in got] == [0, 1, 2]
    for (_, batch), want in zip(got, batches):
        assert_same(batch, want)
    assert got[0][1]["image"].flags.writeable and got[1][1][0].flags.writeable and got[1][1][1].flags.writeable


def test_torch_batches_cross_out_of_band_and_come_back_as_tensors():
    pytest.importorskip("pyarrow")
    torch = pytest.importorskip("torch")

    image = torch.arange(3 * sray.IN_BAND_BYTES, dtype=torch.int32).reshape(3, -1)
    batch = {
        "image": image,
        "view": image[:, ::1024],  # not contiguous: copied into the pickle
        "label": torch.tensor([1, 2, 3]),
        "half": torch.ones(2, dtype=torch.bfloat16),  # no numpy dtype: torch's own pickling
    }
    table = sray._batch_block(0, batch)
    assert table.num_rows == 1  # one large buffer, the image's; the rest is inside the pickle
    header = table.column("header").to_pylist()[0]
    assert len(header) < 16384  # the view and the small tensors, not the image (786 kB)
    rows = sray._BatchRows()
    (position, got), *more = list(rows.feed(table)) + list(rows.finish())
    assert position == 0 and not more
    assert_same(got, batch)
    got["image"][0, 0] = -1  # writable, and its own memory
    assert int(batch["image"][0, 0]) == 0


def test_seed_none_is_the_default_seed_and_communicates_nothing():
    one = sray.DataLoader(Indexed(8), batch_size=2)
    assert one.seed == 0 == sray.DataLoader(Indexed(8), batch_size=2, seed=None).seed
    # two ranks, no torch.distributed: each knows the seed without asking the other
    ranks = [sray.DataLoader(Indexed(8), batch_size=2, world_size=2, rank=r) for r in range(2)]
    assert ranks[0].seed == ranks[1].seed == 0
    # the default is a seed like any other: a state saved with another one is refused
    saved = sray.DataLoader(Indexed(8), batch_size=2, seed=123)
    with pytest.raises(ValueError, match="seed: saved 123, this loader 0"):
        one.load_state_dict(saved.state_dict())
