"""Parquet shards (the Hub's format) through ShardedDataset: a row is a sample, the row group
the unit of random access; written by write_shards and by pyarrow directly, read over S3."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from stoker import DataLoader
from stoker.shards import ShardedDataset, ShardedSampler, build_index, write_shards

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 300


def test_parquet_shards_written_by_write_shards_read_back_in_the_sampler_order(s3_url: str, tmp_path: Path) -> None:
    rows = [{"__key__": f"{i:05d}", "label": i, "text": f"document {i}"} for i in range(N)]
    index = write_shards(rows, s3_url, format="parquet", shard_bytes=2_000, row_group_size=16, workers=1)
    assert index.format == "parquet" and len(index.shards) > 2
    assert all(s.row_groups is not None and len(s.row_groups) > 1 for s in index.shards[:-1])
    data = ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"))
    sampler = ShardedSampler(data, num_replicas=1, rank=0, seed=4, window_shards=2)
    loader = DataLoader(data, batch_size=25, sampler=sampler, num_workers=2, multiprocessing_context="fork")
    read = [(int(label), text) for batch in loader for label, text in zip(batch["label"], batch["text"])]
    assert [label for label, _ in read] == list(sampler)
    assert all(text == f"document {label}" for label, text in read)


def test_parquet_written_by_pyarrow_is_indexed_and_read(s3_url: str, s3_server, tmp_path: Path) -> None:
    from stoker._shards.store import Store

    store = Store(s3_url)
    for part in range(3):
        table = pa.table({"id": list(range(part * 50, part * 50 + 50)), "y": [float(i) / 2 for i in range(50)]})
        buffer = io.BytesIO()
        pq.write_table(table, buffer, row_group_size=20)
        store.write(f"train-{part:05d}.parquet", buffer.getvalue())
    build_index(s3_url)
    data = ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"))
    assert len(data) == 150
    assert [int(data[i]["id"]) for i in (0, 19, 20, 49, 50, 149)] == [0, 19, 20, 49, 50, 149]
    assert data[73]["y"] == 23 / 2
