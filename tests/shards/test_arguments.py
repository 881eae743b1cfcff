"""The shards' arguments are checked before anything is read, in torch's wording: a wrong
type is a TypeError, a wrong value a ValueError, "<name> should be ..., but got <name>=...".
No store is needed: nothing is read when an argument is wrong."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from stoker._shards.store import Store
from stoker.shards import ShardedDataset, build_index


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"decode": "raw"}, ValueError, "decode should be 'auto', None or a callable, but got decode='raw'"),
        ({"transform": 3}, TypeError, "transform should be a callable or None, but got transform=3"),
        ({"prefetch_shards": -1}, ValueError, "prefetch_shards should be an int >= 0, but got prefetch_shards=-1"),
        ({"prefetch_shards": "4"}, TypeError, "prefetch_shards should be an int >= 0, but got prefetch_shards='4'"),
        ({"download_threads": 0}, ValueError, "download_threads should be an int >= 1, but got download_threads=0"),
        ({"cache_bytes": 0}, ValueError, "cache_bytes should be an int >= 1 (bytes) or None, but got cache_bytes=0"),
        ({"cache_bytes": 1.5e9}, TypeError, "cache_bytes should be an int >= 1 (bytes) or None"),
        ({"part_bytes": 0}, ValueError, "part_bytes should be an int >= 1 (bytes) or None, but got part_bytes=0"),
        ({"timeout_s": -1}, ValueError, "timeout_s should be a finite number >= 0 (seconds), but got timeout_s=-1"),
        ({"store_retries": -1}, ValueError, "store_retries should be an int >= 0, but got store_retries=-1"),
        ({"store_timeout_s": 0}, ValueError, "store_timeout_s should be a finite number > 0 (seconds)"),
        ({"allow_pickle": "no"}, TypeError, "allow_pickle should be True or False, but got allow_pickle='no'"),
    ],
)
def test_sharded_dataset_arguments(tmp_path: Path, kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        ShardedDataset(str(tmp_path / "nothing-here"), **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"client": "boto"}, ValueError, "client should be 'auto', 'obstore' or 'fsspec', but got client='boto'"),
        ({"retries": -1}, ValueError, "retries should be an int >= 0, but got retries=-1"),
        ({"retries": 2.0}, TypeError, "retries should be an int >= 0, but got retries=2.0"),
        ({"backoff_s": -0.1}, ValueError, "backoff_s should be a finite number >= 0 (seconds)"),
        ({"timeout_s": 0}, ValueError, "timeout_s should be a finite number > 0 (seconds), but got timeout_s=0"),
        ({"timeout_s": None}, TypeError, "timeout_s should be a finite number > 0 (seconds), but got timeout_s=None"),
    ],
)
def test_store_arguments(tmp_path: Path, kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        Store(str(tmp_path), **kwargs)


def test_a_url_that_is_not_a_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="url should be a non-empty string such as 's3://bucket/prefix'"):
        Store(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="url should be a non-empty string"):
        Store("")


def test_build_index_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="format should be 'tar', 'parquet' or None, but got format='zip'"):
        build_index(str(tmp_path), format="zip")
    with pytest.raises(ValueError, match="threads should be an int >= 1, but got threads=0"):
        build_index(str(tmp_path), threads=0)
