"""The index: build_index over shards written by webdataset and by pyarrow gives offsets and
row groups that read every sample back; a missing index says how to build one; a malformed
one is refused saying what is wrong; `stoker index URL` builds it from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from stoker._cli import main
from stoker._shards.formats import CorruptShardError, read_parquet_row, read_tar_sample
from stoker._shards.index import (
    INDEX_NAME,
    Index,
    MalformedIndexError,
    MissingIndexError,
    ShardInfo,
    build_index,
)
from stoker._shards.store import Store


def _webdataset_shards(folder, counts=(7, 1, 12)) -> list[dict]:
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    samples = []
    n = 0
    for s, count in enumerate(counts):
        with wds.TarWriter(os.path.join(folder, f"part-{s:03d}.tar")) as sink:
            for _ in range(count):
                sample = {
                    "__key__": f"s{n:05d}",
                    "cls": n,
                    "txt": "x" * n,
                    "npy": np.full((2, n % 5), n, dtype=np.int32),
                }
                sink.write(sample)
                samples.append(sample)
                n += 1
    return samples


def _check_tar_samples(url: str, index: Index, samples: list[dict]) -> None:
    import webdataset as wds

    from stoker._shards.formats import decode_auto

    store = Store(url)
    assert len(index) == len(samples)
    for i, want in enumerate(samples):
        shard, k = index.locate(i)
        start, end = index.shards[shard].byte_range(k)
        got = decode_auto(read_tar_sample(store.read(index.shards[shard].name, start, end)))
        assert got["__key__"] == want["__key__"] and got["cls"] == want["cls"] and got["txt"] == want["txt"]
        np.testing.assert_array_equal(got["npy"], want["npy"])
    # the raw bytes equal what webdataset itself reads
    theirs = list(wds.WebDataset([store.url_of(s.name) for s in index.shards], shardshuffle=False))
    for i, sample in enumerate(theirs):
        shard, k = index.locate(i)
        raw = read_tar_sample(store.read(index.shards[shard].name, *index.shards[shard].byte_range(k)))
        assert raw == {f: v for f, v in sample.items() if f == "__key__" or not f.startswith("__")}


def test_build_index_over_webdatasets_shards(tmp_path) -> None:
    samples = _webdataset_shards(tmp_path / "data")
    (tmp_path / "data" / "notes.txt").write_text("not a shard")
    index = build_index(str(tmp_path / "data"))
    assert index.format == "tar" and [s.name for s in index.shards] == ["part-000.tar", "part-001.tar", "part-002.tar"]
    assert [s.samples for s in index.shards] == [7, 1, 12]
    assert index.starts.tolist() == [0, 7, 8, 20]
    for info in index.shards:
        assert info.size == os.path.getsize(tmp_path / "data" / info.name)
        assert info.offsets is not None and info.offsets[0] == 0
    _check_tar_samples(str(tmp_path / "data"), index, samples)
    loaded = Index.load(Store(f"file://{tmp_path / 'data'}"))
    assert loaded.to_json() == index.to_json()


def test_build_index_over_pyarrows_parquet(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "pq"
    folder.mkdir()
    rows = []
    for s, count in enumerate((30, 5)):
        part = [{"label": len(rows) + r, "text": f"row {len(rows) + r}", "blob": b"\x00" * r} for r in range(count)]
        pq.write_table(pa.Table.from_pylist(part), folder / f"{s}.parquet", row_group_size=8)
        rows.extend(part)
    index = build_index(f"file://{folder}")
    assert index.format == "parquet"
    assert [s.row_groups for s in index.shards] == [(8, 8, 8, 6), (5,)]
    for i, want in enumerate(rows):
        shard, k = index.locate(i)
        group, row = index.shards[shard].row_of(k)
        assert read_parquet_row(str(folder / index.shards[shard].name), group, row) == want


def test_locate_and_starts() -> None:
    index = Index("parquet", [ShardInfo(f"{n}.parquet", 1, "0", n, None, (n,)) for n in (3, 0, 2)])
    assert index.starts.dtype == np.int64 and index.starts.tolist() == [0, 3, 3, 5]
    assert [index.locate(i) for i in range(5)] == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]
    for bad in (-1, 5):
        with pytest.raises(IndexError, match="holds 5 samples"):
            index.locate(bad)


def test_missing_index_says_how_to_build_it(tmp_path) -> None:
    url = str(tmp_path)
    with pytest.raises(MissingIndexError) as caught:
        Index.load(Store(url))
    assert isinstance(caught.value, FileNotFoundError)
    assert f"no {INDEX_NAME} at {url}: build it once with `stoker index {url}`" in str(caught.value)
    assert "build_index(" in str(caught.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(stoker_index=2), "stoker_index is 2; this stoker reads version 1"),
        (lambda d: d.update(format="zip"), "format is 'zip'"),
        (lambda d: d["shards"][0].pop("sha256"), r"shards\[0\] has no 'sha256'"),
        (lambda d: d["shards"][1].update(samples="3"), r"shards\[1\].samples is '3', not a int"),
        (lambda d: d["shards"][0]["offsets"].pop(), r"shards\[0\] \(part-000.tar\) has 7 samples but 7 offsets"),
        (lambda d: d["shards"][0]["offsets"].reverse(), "offsets should increase"),
        (lambda d: d.update(samples=99), "samples is 99 but the shards hold 20"),
        (lambda d: d.update(shards={}), "'shards' should be a list"),
    ],
)
def test_a_malformed_index_is_refused_saying_what_is_wrong(tmp_path, change, message) -> None:
    _webdataset_shards(tmp_path)
    data = build_index(str(tmp_path)).to_json()
    change(data)
    (tmp_path / INDEX_NAME).write_text(json.dumps(data))
    with pytest.raises(MalformedIndexError, match=message) as caught:
        Index.load(Store(str(tmp_path)))
    assert str(caught.value).startswith(f"{tmp_path}/{INDEX_NAME}: malformed")


def test_an_index_that_is_not_json_is_refused(tmp_path) -> None:
    (tmp_path / INDEX_NAME).write_text("{not json")
    with pytest.raises(MalformedIndexError, match="not JSON"):
        Index.load(Store(str(tmp_path)))


def test_build_index_names_a_damaged_shard(tmp_path) -> None:
    _webdataset_shards(tmp_path)
    path = tmp_path / "part-002.tar"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CorruptShardError, match=r"part-002\.tar, .*sample \d+ \('s\d+'\).*cut short"):
        build_index(str(tmp_path))
    assert not (tmp_path / INDEX_NAME).exists()


def test_build_index_argument_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"holds no \.tar or \.parquet"):
        build_index(str(tmp_path))
    (tmp_path / "a.tar").write_bytes(b"")
    (tmp_path / "b.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"both \.tar and \.parquet"):
        build_index(str(tmp_path))
    with pytest.raises(ValueError, match="format should be 'tar', 'parquet' or None"):
        build_index(str(tmp_path), format="zip")


def test_cli_builds_the_index(tmp_path, capsys) -> None:
    _webdataset_shards(tmp_path / "d")
    assert main(["index", str(tmp_path / "d"), "--format", "tar"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'd'}/{INDEX_NAME}: 3 tar shards, 20 samples" in out
    assert len(Index.load(Store(str(tmp_path / "d")))) == 20
    assert main(["index", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stoker index: ") and "holds no .tar" in err[0]
    path = tmp_path / "d" / "part-000.tar"
    path.write_bytes(path.read_bytes()[:1500])
    assert main(["index", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CorruptShardError" in err[0] and "part-000.tar" in err[0]


def test_cli_as_a_subprocess(tmp_path) -> None:
    _webdataset_shards(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "stoker", "index", f"file://{tmp_path}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "3 tar shards, 20 samples" in done.stdout
    assert (tmp_path / INDEX_NAME).exists()


def test_build_index_and_the_cli_over_s3(s3_url, tmp_path, capsys) -> None:
    samples = _webdataset_shards(tmp_path / "local", counts=(4, 6))
    store = Store(s3_url)
    for name in sorted(os.listdir(tmp_path / "local")):
        store.write(name, (tmp_path / "local" / name).read_bytes())
    with pytest.raises(MissingIndexError, match=f"build it once with `stoker index {s3_url}`"):
        Index.load(store)
    assert main(["index", s3_url]) == 0
    assert "2 tar shards, 10 samples" in capsys.readouterr().out
    index = Index.load(store)
    assert [s.sha256 for s in index.shards] == [s.sha256 for s in build_index(str(tmp_path / "local")).shards]
    for i, want in enumerate(samples):
        shard, k = index.locate(i)
        got = read_tar_sample(store.read(index.shards[shard].name, *index.shards[shard].byte_range(k)))
        assert got["__key__"] == want["__key__"] and got["txt"] == want["txt"].encode()
