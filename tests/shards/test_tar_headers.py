"""The one tar-header parser both readers share (`iter_tar_samples`, which scans a shard, and
`read_tar_sample`, which reads one sample's byte range): behind pax, GNU long-name and global
pax headers they find the same member, and a tar cut anywhere inside those headers is reported
by each as its own words say; the headers the writer makes read back through the parser and
through Python's `tarfile`."""

from __future__ import annotations

import io
import re
import tarfile

import pytest

from stoker._shards.formats import (
    BLOCK,
    CorruptShardError,
    iter_tar_samples,
    pax_record,
    read_tar_sample,
    ustar_header,
)
from stoker._shards.writer import TarShardWriter

EXTENDED = (b"x", b"g", b"L", b"K")


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def ours_with_a_long_name() -> bytes:
    writer = TarShardWriter()
    writer.add("deep/" + "n" * 140, {"txt": b"hello"})
    return writer.finish()[0]


def gnu_long_name() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        member = tarfile.TarInfo("g/" + "x" * 150 + ".txt")
        member.size = 2
        tar.addfile(member, io.BytesIO(b"hi"))
    return out.getvalue()


def global_pax_header() -> bytes:  # only tarfile decodes it: the parser hands the chain over
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "c"}) as tar:
        member = tarfile.TarInfo("h/" + "y" * 120 + ".cls")
        member.size = 1
        tar.addfile(member, io.BytesIO(b"7"))
    return out.getvalue()


TARS = {"ours, pax": ours_with_a_long_name, "GNU long name": gnu_long_name, "global pax": global_pax_header}


def extended_layout(data: bytes) -> tuple[list[tuple[int, int, int]], int]:
    """For the first member: each extended header's (payload start, padded payload end, the
    next header's end), and where the member's data starts."""
    layout, pos = [], 0
    while data[pos + 156 : pos + 157] in EXTENDED:
        size = tarfile.TarInfo.frombuf(data[pos : pos + BLOCK], "utf-8", "surrogateescape").size
        start = pos + BLOCK
        end = start + _padded(size)
        layout.append((start, end, end + BLOCK))
        pos = end
    return layout, pos + BLOCK


@pytest.mark.parametrize("make", TARS.values(), ids=list(TARS))
def test_both_readers_find_the_member_tarfile_finds_behind_extended_headers(make) -> None:
    data = make()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        (info,) = tar.getmembers()
        payload = tar.extractfile(info).read()  # type: ignore[union-attr]
    key, field = info.name.rsplit(".", 1)
    (scanned,) = list(iter_tar_samples(io.BytesIO(data), "t.tar"))
    assert scanned[:2] == (key, {field: payload})
    assert read_tar_sample(data[scanned[2] : scanned[3]], "t.tar", 0) == {"__key__": key, field: payload}
    layout, _ = extended_layout(data)
    assert layout, "the member has no extended header: the case tests nothing"


@pytest.mark.parametrize("make", TARS.values(), ids=list(TARS))
def test_a_cut_inside_the_extended_headers_is_reported_by_each_reader(make) -> None:
    data = make()
    layout, _ = extended_layout(data)
    assert layout
    for payload_start, payload_end, header_end in layout:
        for cut in range(payload_start, header_end):
            what = "an extended header" if cut < payload_end else "a header"
            with pytest.raises(CorruptShardError, match=re.escape(f"the tar ends inside {what} (cut short?)")):
                list(iter_tar_samples(io.BytesIO(data[:cut]), "t.tar"))
            with pytest.raises(CorruptShardError, match=r"t\.tar, sample 0: the bytes end inside an extended header"):
                read_tar_sample(data[:cut], "t.tar", 0)


def test_a_damaged_extended_header_is_a_checksum_error_in_both_readers() -> None:
    data = bytearray(ours_with_a_long_name())
    data[10] ^= 0xFF  # inside the pax header's name field
    with pytest.raises(CorruptShardError, match="checksum does not match"):
        list(iter_tar_samples(io.BytesIO(bytes(data)), "t.tar"))
    with pytest.raises(CorruptShardError, match="checksum does not match"):
        read_tar_sample(bytes(data), "t.tar", 0)


@pytest.mark.parametrize("size", [0, 1, BLOCK, 8**11 - 1])
def test_the_writers_header_reads_back_through_tarfile(size: int) -> None:
    header = ustar_header(b"k/0001.bin", size)
    info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
    assert (info.name, info.size, info.type, info.mode, info.mtime) == ("k/0001.bin", size, b"0", 0o444, 0)


def test_a_pax_record_counts_its_own_length() -> None:
    for value in ("a", "b" * 5, "c" * 94, "d" * 95, "e" * 996):
        record = pax_record("path", value)
        length, rest = record.split(b" ", 1)
        assert int(length) == len(record) and rest == f"path={value}\n".encode()
