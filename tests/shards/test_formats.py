"""Shard formats: our tar reader and writer agree with webdataset 1.0.2 (its reader reads our
shards, ours reads its writer's), a sample's byte range reads back alone, damage is reported
naming the shard and the sample, and encode_auto / decode_auto invert each other."""

from __future__ import annotations

import io
import itertools
import tarfile

import numpy as np
import pytest

from stoker._shards.formats import (
    CorruptShardError,
    decode_auto,
    encode_auto,
    iter_tar_samples,
    parquet_row_groups,
    read_parquet_row,
    read_tar_sample,
    split_name,
)
from stoker._shards.writer import TarShardWriter, write_parquet


def _shard(n: int = 20) -> tuple[bytes, list[int], list[dict[str, bytes]]]:
    writer = TarShardWriter("t.tar")
    samples = []
    for i in range(n):
        fields = {
            "cls": encode_auto(i, "cls"),
            "npy": encode_auto(np.arange(i, dtype=np.int16), "npy"),
            "seg.png": bytes([i]) * (i * 37),
        }
        writer.add(f"{i:06d}", fields)
        samples.append({"__key__": f"{i:06d}", **fields})
    data, _ = writer.finish()
    return data, writer.offsets, samples


def test_split_name_follows_webdatasets_rule() -> None:
    assert split_name("a/b/000123.seg.PNG") == ("a/b/000123", "seg.png")
    assert split_name("x.y/z.jpg") == ("x.y/z", "jpg")
    assert split_name("noext") is None
    assert split_name("__meta__") is None
    assert split_name("__meta__/a.txt") is None
    assert split_name("dir/.hidden") == ("dir/", "hidden")  # what webdataset's pattern gives


def test_each_sample_range_reads_back_alone() -> None:
    data, offsets, samples = _shard()
    view = memoryview(data)
    for k, want in enumerate(samples):
        assert read_tar_sample(view[offsets[k] : offsets[k + 1]]) == want
    scanned = list(iter_tar_samples(io.BytesIO(data)))
    assert [(s, e) for _, _, s, e in scanned] == list(itertools.pairwise(offsets))
    assert [dict(f, __key__=k) for k, f, _, _ in scanned] == samples


def test_webdataset_reads_our_shards_alike(tmp_path) -> None:
    import webdataset as wds

    data, _, samples = _shard()
    path = tmp_path / "ours.tar"
    path.write_bytes(data)
    theirs = list(wds.WebDataset(str(path), shardshuffle=False))
    assert [s["__key__"] for s in theirs] == [s["__key__"] for s in samples]
    for got, want in zip(theirs, samples):
        assert {k: got[k] for k in want if k != "__key__"} == {k: v for k, v in want.items() if k != "__key__"}


def test_we_read_webdatasets_shards_with_long_names_folders_and_metadata(tmp_path) -> None:
    import webdataset as wds

    path = tmp_path / "theirs.tar"
    want = []
    with wds.TarWriter(str(path)) as sink:  # ustar: a name over 100 characters goes to pax
        for i in range(6):
            key = f"d{i % 2}/" + ("long" * 30 if i == 3 else "") + f"{i:04d}"
            sample = {"__key__": key, "txt": f"t{i}", "cls": i, "json": {"i": i}}
            sink.write(sample)
            want.append(key)
    # A folder entry and a metadata member between samples (both skipped by the grouping
    # rule), a GNU long name, and a global pax header, which only tarfile decodes.
    gnu = io.BytesIO()
    with tarfile.open(fileobj=gnu, mode="w", format=tarfile.GNU_FORMAT) as tar:
        folder = tarfile.TarInfo("d0")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        meta = tarfile.TarInfo("__meta__")
        meta.size = 3
        tar.addfile(meta, io.BytesIO(b"abc"))
        long = tarfile.TarInfo("g/" + "x" * 150 + ".txt")
        long.size = 2
        tar.addfile(long, io.BytesIO(b"hi"))
        gnu_end = tar.offset
    pax = io.BytesIO()
    with tarfile.open(fileobj=pax, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "c"}) as tar:
        member = tarfile.TarInfo("h/0001.TXT")
        member.size = 1
        tar.addfile(member, io.BytesIO(b"!"))
    base = path.read_bytes()
    # Cut each archive at its last member's end (no end-of-archive blocks), then join them.
    members = list(iter_tar_samples(io.BytesIO(base)))
    data = base[: members[-1][3]] + gnu.getvalue()[:gnu_end] + pax.getvalue()
    want += ["g/" + "x" * 150, "h/0001"]
    scanned = list(iter_tar_samples(io.BytesIO(data), "mixed.tar"))
    assert [k for k, _, _, _ in scanned] == want
    theirs = list(wds.WebDataset(_write(tmp_path / "mixed.tar", data), shardshuffle=False))
    assert [s["__key__"] for s in theirs] == want
    starts = [s for _, _, s, _ in scanned] + [scanned[-1][3]]
    for k, sample in enumerate(theirs):
        got = read_tar_sample(data[starts[k] : starts[k + 1]], "mixed.tar", k)
        assert got == {f: v for f, v in sample.items() if not f.startswith("__") or f == "__key__"}
    assert decode_auto(read_tar_sample(data[starts[3] : starts[4]]))["json"] == {"i": 3}
    assert read_tar_sample(data[starts[-2] : starts[-1]]) == {"__key__": "h/0001", "txt": b"!"}


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_long_names_we_write_read_back_through_tarfile() -> None:
    writer = TarShardWriter()
    key = "deep/" + "n" * 140
    writer.add(key, {"txt": b"x"})
    data, _ = writer.finish()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == [key + ".txt"]
    assert read_tar_sample(data[writer.offsets[0] : writer.offsets[1]]) == {"__key__": key, "txt": b"x"}


def test_writer_is_deterministic_and_refuses_names_that_would_not_read_back() -> None:
    a, b = _shard(5)[0], _shard(5)[0]
    assert a == b
    writer = TarShardWriter()
    with pytest.raises(ValueError, match=r"key 'a\.b'"):
        writer.add("a.b", {"txt": b""})
    with pytest.raises(ValueError, match="lowercase"):
        writer.add("k", {"TXT": b""})
    with pytest.raises(ValueError, match="not bytes"):
        writer.add("k", {"txt": 3})  # type: ignore[dict-item]


def test_a_truncated_shard_names_the_shard_and_sample() -> None:
    data, offsets, _ = _shard()
    cut = data[: offsets[7] + 700]  # inside sample 7's first member's data
    with pytest.raises(CorruptShardError, match=r"cut\.tar, sample 7 \('000007'\).*cut short"):
        list(iter_tar_samples(io.BytesIO(cut), "cut.tar"))
    with pytest.raises(CorruptShardError, match=r"cut\.tar, sample 7: .*end inside"):
        read_tar_sample(data[offsets[7] : offsets[8] - 600], "cut.tar", 7)
    with pytest.raises(CorruptShardError, match="end inside a tar header"):
        read_tar_sample(data[offsets[7] : offsets[7] + 100], "cut.tar", 7)


def test_altered_bytes_are_reported() -> None:
    data, offsets, _ = _shard()
    bad = bytearray(data)
    bad[offsets[4] + 130] ^= 0x01  # inside sample 4's first header (its size field)
    with pytest.raises(CorruptShardError, match=r"bad\.tar, sample 4: .*checksum"):
        read_tar_sample(bytes(bad[offsets[4] : offsets[5]]), "bad.tar", 4)
    with pytest.raises(
        CorruptShardError, match=r"bad\.tar, the header at byte \d+, following sample 3 \('000003'\): .*checksum"
    ):
        list(iter_tar_samples(io.BytesIO(bytes(bad)), "bad.tar"))


def test_a_range_with_two_samples_or_none_is_refused() -> None:
    data, offsets, _ = _shard()
    with pytest.raises(CorruptShardError, match="two samples"):
        read_tar_sample(data[offsets[2] : offsets[4]], "s.tar", 2)
    with pytest.raises(CorruptShardError, match="holds no sample"):
        read_tar_sample(b"", "s.tar", 2)


def test_encode_and_decode_invert_each_other() -> None:
    sample = {
        "__key__": "k",
        "cls": 7,
        "id": np.int64(3),
        "txt": "héllo",
        "json": {"a": [1, 2]},
        "npy": np.arange(12, dtype=np.float32).reshape(3, 4),
        "x.npy": [1, 2, 3],
        "pyd": {"set": {1, 2}},
        "jpg": b"\xff\xd8raw",
    }
    encoded = {f: v if f == "__key__" else encode_auto(v, f) for f, v in sample.items()}
    assert all(isinstance(v, bytes) for f, v in encoded.items() if f != "__key__")
    back = decode_auto(encoded, allow_pickle=True)
    assert back["cls"] == 7 and back["id"] == 3 and back["txt"] == "héllo" and back["json"] == {"a": [1, 2]}
    np.testing.assert_array_equal(back["npy"], sample["npy"])
    assert back["npy"].dtype == np.float32
    np.testing.assert_array_equal(back["x.npy"], [1, 2, 3])
    assert back["pyd"] == {"set": {1, 2}} and back["jpg"] == b"\xff\xd8raw" and back["__key__"] == "k"
    with pytest.raises(ValueError, match="field 'txt': cannot encode a dict"):
        encode_auto({"a": 1}, "txt")
    with pytest.raises(ValueError, match="sample 'k', field 'cls'"):
        decode_auto({"__key__": "k", "cls": b"seven"})


def test_parquet_rows_read_back_by_row_group(tmp_path) -> None:
    rows = [{"__key__": f"{i:03d}", "label": i, "text": f"t{i}", "blob": bytes([i]) * i} for i in range(50)]
    path = str(tmp_path / "a.parquet")
    groups = write_parquet(rows, path, row_group_size=16)
    assert groups == [16, 16, 16, 2] == parquet_row_groups(path)
    for i, row in enumerate(rows):
        assert read_parquet_row(path, i // 16, i % 16) == row
    assert read_parquet_row(path, 1, 3, columns=["label"]) == {"label": 19}
    with pytest.raises(CorruptShardError, match="row group 9 of 4"):
        read_parquet_row(path, 9, 0)
    with pytest.raises(CorruptShardError, match="row 5 of 2"):
        read_parquet_row(path, 3, 5)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(CorruptShardError, match=r"junk\.parquet"):
        read_parquet_row(str(tmp_path / "junk.parquet"), 0, 0)
