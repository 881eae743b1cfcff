"""write_shards: any dataset -> shards + index, read back sample for sample equal (tar and
Parquet; dict and tuple samples; map-style in worker processes and iterables), readable by
webdataset, the index written last, and arguments refused with messages naming them."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stoker._shards.formats import decode_auto, read_parquet_row, read_tar_sample
from stoker._shards.index import INDEX_NAME, Index, MissingIndexError, build_index
from stoker._shards.store import Store
from stoker._shards.writer import write_shards


def _sample(i: int) -> dict:
    return {
        "npy": np.arange(i % 7 * 3, dtype=np.float32).reshape(-1, 3) + i,
        "cls": i,
        "txt": f"sample {i} é",
        "bin": bytes([i % 256]) * (i % 50),
    }


class Samples:
    """A map-style dataset of dict samples."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return _sample(i)


def _equal(got: dict, want: dict) -> None:
    assert set(got) - {"__key__"} == set(want) - {"__key__"}
    for field, value in want.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(got[field], value)
            assert got[field].dtype == value.dtype
        else:
            assert got[field] == value, field


def _read_all(url: str, index: Index) -> list[dict]:
    store = Store(url)
    out = []
    local = Store(url).scheme == "file"
    for i in range(len(index)):
        shard, k = index.locate(i)
        info = index.shards[shard]
        if index.format == "tar":
            out.append(decode_auto(read_tar_sample(store.read(info.name, *info.byte_range(k)), info.name, k)))
        else:
            assert local
            path = os.path.join(store._root, info.name)
            out.append(decode_auto(read_parquet_row(path, *info.row_of(k))))
    return out


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_map_style_in_worker_processes_reads_back_equal(tmp_path, fmt) -> None:
    url = str(tmp_path / "out")
    index = write_shards(Samples(300), url, format=fmt, shard_bytes=4000, workers=2)
    assert len(index) == 300 and len(index.shards) > 4
    names = [s.name for s in index.shards]
    assert names == sorted(names) and {n.split("-")[1] for n in names} == {"00000", "00001"}
    assert Index.load(Store(url)).to_json() == index.to_json()
    for i, got in enumerate(_read_all(url, index)):
        _equal(got, _sample(i))
        assert got["__key__"] == f"{i:09d}"
    rescanned = build_index(url)
    assert [(s.name, s.sha256, s.samples) for s in rescanned.shards] == [
        (s.name, s.sha256, s.samples) for s in index.shards
    ]
    if fmt == "tar":
        assert all((a.offsets == b.offsets).all() for a, b in zip(rescanned.shards, index.shards))


def test_iterable_of_tuples_named_by_fields(tmp_path) -> None:
    samples = [(np.full((2, 2), i, dtype=np.int64), i, f"t{i}", b"raw" * i) for i in range(40)]
    url = f"file://{tmp_path}"
    index = write_shards(iter(samples), url, fields=("x.npy", "cls", "txt", "jpg"), shard_bytes=2000)
    assert len(index) == 40 and len(index.shards) > 1
    for (x, c, t, j), got in zip(samples, _read_all(url, index)):
        _equal(got, {"x.npy": x, "cls": c, "txt": t, "jpg": j})


def test_parquet_from_an_iterable_with_keys(tmp_path) -> None:
    samples = [{"__key__": f"k{i}", "label": i, "text": f"t{i}", "vec.npy": np.arange(i)} for i in range(25)]
    index = write_shards((s for s in samples), str(tmp_path), format="parquet", row_group_size=4)
    assert [s.row_groups for s in index.shards] == [(4, 4, 4, 4, 4, 4, 1)]
    for want, got in zip(samples, _read_all(str(tmp_path), index)):
        _equal(got, want)
        assert got["__key__"] == want["__key__"]


def test_webdataset_reads_what_write_shards_wrote(tmp_path) -> None:
    import webdataset as wds

    index = write_shards(Samples(30), str(tmp_path), shard_bytes=3000, workers=1)
    urls = [str(tmp_path / s.name) for s in index.shards]
    theirs = list(wds.WebDataset(urls, shardshuffle=False))
    ours = _read_all(str(tmp_path), index)
    assert [s["__key__"] for s in theirs] == [s["__key__"] for s in ours]
    store = Store(str(tmp_path))
    for i, sample in enumerate(theirs):
        shard, k = index.locate(i)
        raw = read_tar_sample(store.read(index.shards[shard].name, *index.shards[shard].byte_range(k)))
        assert raw == {f: v for f, v in sample.items() if f == "__key__" or not f.startswith("__")}


class Failing(Samples):
    def __getitem__(self, i: int) -> dict:
        if i == 33:
            raise RuntimeError("sample 33 is unreadable")
        return _sample(i)


def test_the_index_is_written_last(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="sample 33 is unreadable"):
        write_shards(Failing(60), str(tmp_path), shard_bytes=1000, workers=2)
    assert not (tmp_path / INDEX_NAME).exists()
    with pytest.raises(MissingIndexError, match="stoker index"):
        Index.load(Store(str(tmp_path)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"format": "zip"}, "format should be 'tar' or 'parquet'"),
        ({"shard_bytes": 0}, r"shard_bytes should be an int >= 1 \(bytes per shard\), but got shard_bytes=0"),
        ({"fields": "cls"}, "fields should be a sequence"),
        ({"fields": ("a", "a")}, "fields should be a sequence naming each field once"),
        ({"workers": 0}, "workers should be an int >= 1 or None, but got workers=0"),
        ({"encode": "json"}, "encode should be 'auto', None or a callable"),
        ({"row_group_size": -1}, r"row_group_size should be an int >= 1 \(rows\) or None"),
    ],
)
def test_argument_errors_name_the_argument(tmp_path, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        write_shards([{"txt": "a"}], str(tmp_path), **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shard_bytes": "1M"}, "shard_bytes should be an int >= 1"),
        ({"workers": 1.5}, "workers should be an int >= 1 or None, but got workers=1.5"),
        ({"url": b"s3://b"}, "url should be a non-empty string, but got url=b's3://b'"),
    ],
)
def test_argument_types_are_type_errors(tmp_path, kwargs, message) -> None:
    kwargs.setdefault("url", str(tmp_path))
    with pytest.raises(TypeError, match=message):
        write_shards([{"txt": "a"}], **kwargs)


def test_sample_errors_name_the_sample(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"sample 0 is a tuple: pass fields="):
        write_shards([(1, 2)], str(tmp_path))
    with pytest.raises(ValueError, match=r"sample 1 has 1 items but fields names 2"):
        write_shards([(1, 2), (1,)], str(tmp_path), fields=("a", "b"))
    with pytest.raises(ValueError, match=r"sample 2 \(key '000000002'\): field 'txt': cannot encode a dict"):
        write_shards([{"txt": "a"}, {"txt": "b"}, {"txt": {"no": 1}}], str(tmp_path))
    with pytest.raises(ValueError, match=r"key 'a\.b'"):
        write_shards([{"__key__": "a.b", "txt": "a"}], str(tmp_path))
    with pytest.raises(ValueError, match="source should be a map-style dataset"):
        write_shards(42, str(tmp_path))
    with pytest.raises(ValueError, match="source is empty"):
        write_shards([], str(tmp_path))


def test_encode_none_and_a_callable(tmp_path) -> None:
    index = write_shards([{"txt": b"as is"}], str(tmp_path / "a"), encode=None)
    assert _read_all(str(tmp_path / "a"), index)[0]["txt"] == "as is"
    with pytest.raises(ValueError, match="not bytes"):
        write_shards([{"txt": "a str"}], str(tmp_path / "b"), encode=None)
    index = write_shards([{"txt": "x"}], str(tmp_path / "c"), encode=lambda v, f: v.upper().encode())
    assert _read_all(str(tmp_path / "c"), index)[0]["txt"] == "X"


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_write_to_s3_and_read_back(s3_url, tmp_path, fmt) -> None:
    index = write_shards(Samples(60), s3_url, format=fmt, shard_bytes=3000, workers=2)
    store = Store(s3_url)
    assert Index.load(store).to_json() == index.to_json()
    assert store.list() == sorted([INDEX_NAME] + [s.name for s in index.shards])
    if fmt == "tar":
        for i, got in enumerate(_read_all(s3_url, index)):
            _equal(got, _sample(i))
    else:
        for s, info in enumerate(index.shards):
            path = tmp_path / info.name
            path.write_bytes(store.read(info.name))
            for k in range(info.samples):
                _equal(decode_auto(read_parquet_row(str(path), *info.row_of(k))), _sample(int(index.starts[s]) + k))
    assert [s.sha256 for s in build_index(s3_url).shards] == [s.sha256 for s in index.shards]
