"""A loader state names its sharded stream: each constructor argument of `ShardedDataset` and
`ShardedSampler` is changed in turn (enumerated from the signature), over shards that
`write_shards` wrote to a local folder, and a state is refused naming the differing key exactly
when the rows differ (other data, decode, transform, order), accepted when they are equal (the
same data elsewhere, other cache or download settings). A mix over a sharded source records the
source's index and its shard windows."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.support.identity_cases import ELASTIC, check_case, check_signature, listed

import stoker
from stoker.mix import MixedDataset, StreamSampler, TokenDataset
from stoker.shards import ShardedDataset, ShardedSampler, write_shards

SAMPLES = 50


def tokens(i: int, salt: int = 0) -> np.ndarray:
    return (np.arange(5 + i % 17, dtype=np.int32) * (i + 1) + salt) % 30_000 + 1


def write(url: Path, salt: int = 0) -> str:
    docs = [{"__key__": f"{i:05d}", "tokens.npy": tokens(i, salt)} for i in range(SAMPLES)]
    index = write_shards(docs, str(url), shard_bytes=2500, workers=1)
    assert len(index.shards) >= 6
    return str(url)


def add_one(sample: dict[str, Any]) -> dict[str, Any]:
    return dict(sample, extra=1)


def add_two(sample: dict[str, Any]) -> dict[str, Any]:
    return dict(sample, extra=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shards")
    base = write(root / "base")
    shutil.copytree(base, root / "copy")  # the same shards at another prefix
    return {
        "base": base,
        "copy": str(root / "copy"),
        "other": write(root / "other", salt=7),  # other contents, the same sizes and counts
        "cache": str(root / "cache"),
        "cache2": str(root / "cache2"),
    }


def dataset(data: dict[str, str], kwargs: Mapping[str, Any]) -> ShardedDataset:
    kwargs = dict(kwargs)
    url = data[kwargs.pop("url", "base")]
    cache = data[kwargs.pop("cache_dir", "cache")]
    return ShardedDataset(url, cache_dir=cache, **kwargs)


def shard_loader(
    data: dict[str, str], kwargs: Mapping[str, Any], sampler: Mapping[str, Any] | None = None
) -> Callable[[], stoker.DataLoader[Any]]:
    def make() -> stoker.DataLoader[Any]:
        ds = dataset(data, kwargs)
        return stoker.DataLoader(ds, batch_size=4, sampler=ShardedSampler(ds, **(sampler or {})), collate_fn=listed)

    return make


# argument -> [(the loading run's arguments, the key a refusal names or None)]; the saved run
# is over data["base"] with the defaults
DATASET_CASES: dict[str, list[tuple[dict[str, Any], str | None]]] = {
    "url": [({"url": "other"}, "stream.index_digest"), ({"url": "copy"}, None)],
    "cache_dir": [({"cache_dir": "cache2"}, None)],
    "cache_bytes": [({"cache_bytes": 1 << 20}, None)],
    "decode": [({"decode": None}, "stream.decode")],
    "transform": [({"transform": add_one}, "stream.transform")],
    "storage_options": [({"storage_options": {}}, None)],
    "client": [({"client": "fsspec"}, None)],
    "prefetch_shards": [({"prefetch_shards": 0}, None)],
    "download_threads": [({"download_threads": 1}, None)],
    "timeout_s": [({"timeout_s": 60.0}, None)],
    "store_retries": [({"store_retries": 1}, None)],
    "store_timeout_s": [({"store_timeout_s": 5.0}, None)],
    "part_bytes": [({"part_bytes": None}, None)],
    # refusing a pickle field raises instead of giving a row: a saved stream never holds one it refused
    "allow_pickle": [({"allow_pickle": True}, None)],
}


def test_every_sharded_dataset_argument_has_a_case() -> None:
    check_signature(ShardedDataset, DATASET_CASES)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("argument", "n"), [(a, n) for a, cases in DATASET_CASES.items() for n in range(len(cases))])
def test_a_sharded_state_is_refused_exactly_when_the_rows_differ(data: dict[str, str], argument: str, n: int) -> None:
    loading, key = DATASET_CASES[argument][n]
    check_case(shard_loader(data, {}), shard_loader(data, loading), key)


def test_transforms_are_told_apart_by_name(data: dict[str, str]) -> None:
    one = dataset(data, {"transform": add_one}).stoker_describe()
    assert one["transform"] == "add_one"
    assert dataset(data, {"transform": add_two}).stoker_describe()["transform"] == "add_two"
    partial = dataset(data, {"transform": functools.partial(add_one)}).stoker_describe()
    assert partial["transform"] == "partial(add_one)"
    assert dataset(data, {}).stoker_describe()["decode"] == "auto"


WORLD = {"num_replicas": 3, "rank": 0}
# argument -> [(the saved run's sampler arguments, the loading run's, the key or None)]
SAMPLER_CASES: dict[str, list[tuple[dict[str, Any], dict[str, Any], str | None]]] = {
    "dataset": [({}, {"url": "other"}, "stream.index_digest")],  # the loading run's dataset
    "num_replicas": [(WORLD, dict(WORLD, num_replicas=2), ELASTIC)],
    "rank": [(WORLD, dict(WORLD, rank=1), ELASTIC)],
    "shuffle": [({}, {"shuffle": False}, "sampler_shuffle")],
    "seed": [({}, {"seed": 1}, "sampler_seed")],
    "drop_last": [(WORLD, dict(WORLD, drop_last=True), "sampler_drop_last")],
    "window_shards": [
        ({}, {"window_shards": 2}, "sampler.window_shards"),
        ({"shuffle": False}, {"shuffle": False, "window_shards": 2}, None),  # unshuffled: no windows
    ],
}


def test_every_sharded_sampler_argument_has_a_case() -> None:
    check_signature(ShardedSampler, SAMPLER_CASES)
    assert SAMPLES % 3, "the drop_last case needs samples that 3 ranks do not divide"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("argument", "n"), [(a, n) for a, cases in SAMPLER_CASES.items() for n in range(len(cases))])
def test_a_sharded_sampler_state_is_refused_exactly_when_the_rows_differ(
    data: dict[str, str], argument: str, n: int
) -> None:
    saved, loading, key = SAMPLER_CASES[argument][n]
    if argument == "dataset":
        check_case(shard_loader(data, {}), shard_loader(data, loading), key)
    else:
        check_case(shard_loader(data, {}, saved), shard_loader(data, {}, loading), key)


def mix_loader(data: dict[str, str], url: str, window_shards: int) -> Callable[[], stoker.DataLoader[Any]]:
    def make() -> stoker.DataLoader[Any]:
        sharded = dataset(data, {"url": url})
        local = TokenDataset.from_documents([tokens(i, 3) for i in range(30)])
        mix = MixedDataset([sharded, local], [2, 1], field="tokens.npy", window_shards=window_shards, seed=1)
        return stoker.DataLoader(mix, batch_size=4, sampler=StreamSampler(mix), collate_fn=listed)

    return make


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("url", "window_shards", "key"),
    [("other", 4, "stream.source.0.index_digest"), ("base", 2, "stream.window_shards"), ("copy", 4, None)],
    ids=["other-data", "other-windows", "same-data-elsewhere"],
)
def test_a_mix_over_a_sharded_source_records_its_index_and_windows(
    data: dict[str, str], url: str, window_shards: int, key: str | None
) -> None:
    check_case(mix_loader(data, "base", 4), mix_loader(data, url, window_shards), key)
