"""What is inside a shard: tar archives laid out as WebDataset lays them out, and Parquet files.

A tar shard holds samples as runs of members that share a key: `000123.jpg`, `000123.cls` are
the fields `jpg` and `cls` of sample `000123`. The key is the member's path up to the first
"." of its base name (the folder kept); the field is the rest, lowercased. Members that are not
regular files, metadata names (`__...__`) and names without a "." are skipped. This is the rule
webdataset 1.0.2 groups by, so both read the same samples from the same shard.

The reader parses the 512-byte headers itself, which is what a random read of one sample needs
to be fast: ustar, and the pax and GNU long-name headers that give a member its path and size
(webdataset's writer puts a pax header before every member); the rarer extended headers (global
pax headers, other charsets, sparse files) are decoded by Python's `tarfile`. One parser
(`_member`) serves both readers; the headers the writer (writer.py) writes are made here too,
beside it (`ustar_header`, `pax_record`).

Parquet shards hold one sample per row; the unit of random access is the row group, and the
last few decoded row groups are kept per process. pyarrow is imported only when a Parquet
shard is read or written.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import re
import tarfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np

from .._base.checks import check_bool
from .._base.process import at_fork
from .errors import CorruptShardError

__all__ = [
    "CorruptShardError",
    "decode_auto",
    "encode_auto",
    "iter_tar_samples",
    "parquet_row_groups",
    "read_parquet_row",
    "read_tar_sample",
    "split_name",
]

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = (b"0", b"\x00", b"7")
# Headers that describe the member after them: pax (x, g) and GNU long name/link (L, K).
_EXTENDED = (b"x", b"g", b"L", b"K")
_NAME_RULE = re.compile(r"((?:.*/)?[^.]+)\.([^/]*)")
_META_RULE = re.compile(r"__[^/]*__($|/)")


def _where(shard: str, sample: object) -> str:
    return shard if sample is None else f"{shard}, sample {sample}"


def split_name(name: str) -> tuple[str, str] | None:
    """The (key, field) a tar member's name gives, or None for a member that is not part of
    a sample.

    Args:
        name: The member's path in the archive, e.g. `"train/000123.seg.png"`.

    Returns:
        `(key, field)`, e.g. `("train/000123", "seg.png")`, the field lowercased; None for a
        metadata name (`__...__`, skipped) or a name with no "." in its base name.
    """
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return None
    if _META_RULE.match(name):
        return None
    found = _NAME_RULE.fullmatch(name)
    if found is None:
        return None
    return found.group(1), found.group(2).lower()


def _octal(field: bytes | memoryview) -> int:
    raw = bytes(field)
    if raw[:1] == b"\x80":  # base-256, for members too big for the octal field
        return int.from_bytes(raw[1:], "big")
    text = raw.split(b"\x00", 1)[0].strip()
    return int(text, 8) if text else 0


def _checksum_ok(raw: bytes) -> bool:
    stored = raw[148:156].split(b"\x00", 1)[0].strip()
    if not stored:
        return False
    try:
        expected = int(stored, 8)
    except ValueError:
        return False
    # The sum of the header's bytes with the checksum field counted as eight spaces.
    unsigned = sum(raw) - sum(raw[148:156]) + 256
    if unsigned == expected:
        return True
    # Some old writers summed signed bytes.
    signed = unsigned - 256 * sum(1 for b in raw[:148] + raw[156:BLOCK] if b > 127)
    return signed == expected


def _decode_header(header: bytes | memoryview) -> tuple[str, int, bytes]:
    """(name, size, type flag) of one ustar/GNU/v7 header block; raises ValueError."""
    raw = bytes(header)
    if not _checksum_ok(raw):
        raise ValueError("a tar header's checksum does not match")
    name = raw[:100].split(b"\x00", 1)[0]
    if raw[257:263] == b"ustar\x00":
        prefix = raw[345:500].split(b"\x00", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    kind = raw[156:157]
    size = _octal(raw[124:136])
    text = name.decode("utf-8", "surrogateescape")
    if kind == b"\x00" and text.endswith("/"):  # a v7 folder
        kind = b"5"
    return text, size, kind


def _resolve_extended(chunk: bytes) -> tuple[str, int, bytes]:
    """(name, size, type) of the member that extended headers describe, decoded by tarfile:
    `chunk` holds the extended headers with their data and the member's own header."""
    try:
        with tarfile.open(fileobj=io.BytesIO(chunk), mode="r:") as archive:
            info = archive.next()
    except tarfile.TarError as exc:
        raise ValueError(f"an extended tar header does not parse ({exc})") from None
    if info is None:
        raise ValueError("an extended tar header describes no member")
    kind = b"0" if info.isreg() else info.type
    return info.name, info.size, kind


def _apply_extended(kind: bytes, payload: bytes, found: dict[str, Any]) -> bool:
    """Record in `found` the path and size an extended header gives the member after it;
    False when only tarfile can decode it (a global pax header, another charset, sparse)."""
    if kind == b"L":
        found["path"] = payload.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
        return True
    if kind == b"K":
        return True
    if kind == b"g":
        return False
    p = 0
    while p < len(payload) and payload[p] != 0:
        space = payload.find(b" ", p)
        length = int(payload[p:space]) if space > p else 0
        record = payload[space + 1 : p + length]
        if length <= 0 or not record.endswith(b"\n"):
            raise ValueError("a pax header's records do not parse")
        key, _, value = record[:-1].partition(b"=")
        if key == b"path":
            found["path"] = value.decode("utf-8", "surrogateescape")
        elif key == b"size":
            found["size"] = int(value)
        elif key == b"hdrcharset" or key.startswith(b"GNU.sparse"):
            return False
        p += length
    return True


def _padded(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK * BLOCK


def ustar_header(name: bytes, size: int, kind: bytes = b"0") -> bytes:
    """The ustar header block `TarShardWriter` writes before a member (`_decode_header` reads
    it back)."""
    header = bytearray(BLOCK)
    header[0 : len(name)] = name
    header[100:108] = b"0000444\x00"  # mode r--r--r--
    header[108:116] = b"0000000\x00"  # uid
    header[116:124] = b"0000000\x00"  # gid
    header[124:136] = b"%011o\x00" % size
    header[136:148] = b"00000000000\x00"  # mtime: fixed, so equal input gives equal shards
    header[148:156] = b" " * 8
    header[156:157] = kind
    header[257:265] = b"ustar\x0000"
    header[148:156] = b"%06o\x00 " % sum(header)
    return bytes(header)


def pax_record(key: str, value: str) -> bytes:
    """One pax record: `<length> <key>=<value>` and a newline, the length counting itself."""
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def _member(header: bytes, take: Callable[[int, str], bytes]) -> tuple[str, int, bytes]:
    """(name, size, type flag) of the member whose first header block is `header`, the one
    header parser of both readers. Extended headers (pax, GNU long names) are followed to the
    member's own header: `take(size, what)` gives the next `size` bytes of the tar, padded to
    whole blocks (a shorter padding is the caller's to notice), or raises ValueError saying
    the tar ends inside `what`. Raises ValueError when a header does not parse."""
    kind = header[156:157]
    if kind not in _EXTENDED:
        return _decode_header(header)
    chunk, native = [header], True
    found: dict[str, Any] = {}
    while kind in _EXTENDED:
        _, size, _ = _decode_header(chunk[-1])
        chunk.append(take(size, "an extended header"))
        native = _apply_extended(kind, chunk[-1][:size], found) and native
        chunk.append(take(BLOCK, "a header"))
        kind = chunk[-1][156:157]
    if not native:
        return _resolve_extended(b"".join(chunk))
    name, size, kind = _decode_header(chunk[-1])
    return found.get("path", name), found.get("size", size), kind


def read_tar_sample(
    data: bytes | bytearray | memoryview, shard: str = "<tar bytes>", sample: object = None
) -> dict[str, Any]:
    """One sample, from the bytes of a tar shard that hold it (the range `[o_k, o_{k+1})` an
    index gives).

    Args:
        data: The bytes of the sample's members: each header, its data, its padding.
        shard: The shard's name or URL, for error messages. Defaults to "<tar bytes>".
        sample: The sample's number (or key), for error messages. Defaults to None.

    Returns:
        `{"__key__": key, field: bytes, ...}`, fields named as webdataset names them.

    Raises:
        CorruptShardError: when the bytes end inside a member, a header does not parse, or
            the range holds no sample, more than one, or a field twice.
    """
    view = memoryview(data)
    end = len(view)
    pos = 0
    key: str | None = None
    fields: dict[str, Any] = {}

    def take(size: int, what: str) -> bytes:
        nonlocal pos
        if pos + size > end:  # only extended headers are taken: a member's data is sliced below
            raise ValueError("the bytes end inside an extended header")
        got = view[pos : pos + _padded(size)].tobytes()
        pos += _padded(size)
        return got

    try:
        while pos + BLOCK <= end:
            header = view[pos : pos + BLOCK].tobytes()
            if header == _ZERO_BLOCK:
                break
            pos += BLOCK
            name, size, kind = _member(header, take)
            if pos + size > end:
                raise ValueError(f"the bytes end inside member {name!r}")
            if kind in _REGULAR:
                parts = split_name(name)
                if parts is not None:
                    if key is None:
                        key = parts[0]
                    elif parts[0] != key:
                        raise ValueError(f"the range holds two samples: {key!r} and {parts[0]!r}")
                    if parts[1] in fields:
                        raise ValueError(f"sample {key!r} has field {parts[1]!r} twice")
                    fields[parts[1]] = view[pos : pos + size].tobytes()
            pos += _padded(size)
        if pos + BLOCK > end and pos < end:
            raise ValueError("the bytes end inside a tar header")
    except ValueError as exc:
        raise CorruptShardError(f"{_where(shard, sample)}: {exc}") from None
    if key is None:
        raise CorruptShardError(f"{_where(shard, sample)}: the byte range holds no sample")
    fields["__key__"] = key
    return fields


def _read_exact(fileobj: BinaryIO, size: int, what: str) -> bytes:
    got = fileobj.read(size)
    if len(got) != size:
        raise ValueError(f"the tar ends inside {what} (cut short?)")
    return got


def iter_tar_samples(
    fileobj: BinaryIO, shard: str = "<tar stream>"
) -> Iterator[tuple[str, dict[str, bytes], int, int]]:
    """Every sample of a tar shard, in order, with the byte range it occupies.

    Samples are grouped as webdataset groups them: a new sample starts wherever the key
    changes (a key that comes back later makes a second sample).

    Args:
        fileobj: The shard, a binary file object read from its start (only `read` is used).
        shard: The shard's name or URL, for error messages. Defaults to "<tar stream>".

    Yields:
        `(key, fields, start, end)`: the key, `{field: bytes}`, the offset of the sample's
        first header and the offset just past its last member's padded data. A sample's end
        is the next one's start unless skipped members (folders, metadata) lie between.

    Raises:
        CorruptShardError: when the tar ends inside a member, a header does not parse, or a
            sample has a field twice; it names the shard and the sample being read.
    """
    pos = member_start = 0
    key: str | None = None
    fields: dict[str, bytes] = {}
    start = end = 0
    count = 0  # samples yielded
    name: str | None = None

    def take(size: int, what: str) -> bytes:
        nonlocal pos
        got = _read_exact(fileobj, _padded(size), what)
        pos += len(got)
        return got

    try:
        while True:
            member_start, name = pos, None
            header = fileobj.read(BLOCK)
            if len(header) == 0:
                break  # no end-of-archive blocks: tolerated, as tarfile does
            if len(header) != BLOCK:
                raise ValueError("the tar ends inside a header (cut short?)")
            if header == _ZERO_BLOCK:
                break
            pos += BLOCK
            name, size, kind = _member(header, take)
            body = _read_exact(fileobj, _padded(size), f"member {name!r}")
            pos += len(body)
            parts = split_name(name) if kind in _REGULAR else None
            if parts is None:
                continue
            if parts[0] != key:
                if key is not None:
                    yield key, fields, start, end
                    count += 1
                key, fields, start = parts[0], {}, member_start
            if parts[1] in fields:
                raise ValueError(f"field {parts[1]!r} appears twice")
            fields[parts[1]] = body[:size]
            end = pos
    except ValueError as exc:
        parts = None if name is None else split_name(name)
        if parts is not None:
            number = count + (1 if key is not None and parts[0] != key else 0)
            where = f"sample {number} ({parts[0]!r}), member {name!r} at byte {member_start}"
        elif name is not None:
            where = f"member {name!r} at byte {member_start}"
        elif key is None:
            where = f"the header at byte {member_start}, before the first sample"
        else:
            where = f"the header at byte {member_start}, following sample {count} ({key!r})"
        raise CorruptShardError(f"{shard}, {where}: {exc}") from None
    if key is not None:
        yield key, fields, start, end


# ---------------------------------------------------------------- encoding
_INT_EXTS = frozenset({"cls", "cls2", "index", "id", "int"})
_TEXT_EXTS = frozenset({"txt", "text"})
_PICKLE_EXTS = frozenset({"pyd", "pickle"})


def _extension(field: str) -> str:
    return field.rsplit(".", 1)[-1].lower()


def encode_auto(value: Any, ext: str) -> bytes:
    """The bytes that store `value` in field `ext`: the inverse of `decode_auto`.

    Args:
        value: bytes (kept as they are), str (UTF-8), an int, float or numpy scalar (as
            text), a numpy array (a .npy file), or anything `json.dumps` takes for a `json`
            field and `pickle.dumps` takes for a `pyd`/`pickle` field.
        ext: The field's name; its last part after the final "." picks the encoding
            (`npy` saves any array-like as .npy, `json`, `pyd`, `pickle`).

    Returns:
        The encoded bytes.

    Raises:
        ValueError: when the value's type has no encoding for that field (e.g. a dict in a
            `txt` field); the message names the field and the type.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    kind = _extension(ext)
    if kind == "json":
        return json.dumps(value.tolist() if isinstance(value, np.ndarray) else value).encode()
    if kind in _PICKLE_EXTS:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    if kind == "npy" or isinstance(value, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, np.asanyarray(value), allow_pickle=False)
        return buf.getvalue()
    if isinstance(value, (bool, np.bool_)):
        return b"1" if value else b"0"
    if isinstance(value, (int, float, np.number)):
        return str(value).encode("ascii")
    raise ValueError(
        f"field {ext!r}: cannot encode a {type(value).__name__}; give bytes, a str, a number or "
        "an array, or name the field with a json, pyd or npy extension"
    )


def decode_auto(sample: Mapping[str, Any], *, allow_pickle: bool = False) -> dict[str, Any]:
    """A sample with its fields decoded by extension (the last part after the final "."):
    cls/cls2/index/id/int -> int, txt/text -> str, json -> json.loads, npy -> np.load,
    pyd/pickle -> pickle.loads (only with `allow_pickle=True`); other fields, values that are
    not bytes, and `__key__` stay.

    Unpickling runs whatever code the bytes name: whoever can write to the store the shards
    came from could run code in every process that reads them. So pickle fields are refused
    unless the caller trusts the store and says so, as `np.load(allow_pickle=...)` does.

    Args:
        sample: `{field: value}` as read from a shard.
        allow_pickle: Whether to unpickle `pyd`/`pickle` fields (bool). False refuses them
            with a `ValueError`; pass True only for shards from a store you trust. Defaults
            to False.

    Returns:
        A new dict with the decoded values.

    Raises:
        TypeError: when `allow_pickle` is not a bool.
        ValueError: when a field's bytes do not decode as its extension says, or a pickle
            field is met without `allow_pickle=True`; the message names the sample's key and
            the field.
    """
    check_bool("allow_pickle", allow_pickle)
    out: dict[str, Any] = {}
    for field, value in sample.items():
        if field.startswith("__") or not isinstance(value, (bytes, bytearray, memoryview)):
            out[field] = value
            continue
        kind = _extension(field)
        if kind in _PICKLE_EXTS and not allow_pickle:
            raise ValueError(
                f"sample {sample.get('__key__')!r}, field {field!r}: is a pickle, and unpickling runs "
                "whatever code its bytes name (anyone who can write to the store could run code "
                "here): pass allow_pickle=True only if you trust the store, or decode=None to "
                "keep the field's bytes"
            )
        try:
            if kind in _INT_EXTS:
                out[field] = int(bytes(value))
            elif kind in _TEXT_EXTS:
                out[field] = bytes(value).decode("utf-8")
            elif kind == "json":
                out[field] = json.loads(bytes(value))
            elif kind == "npy":
                out[field] = np.load(io.BytesIO(value), allow_pickle=False)
            elif kind in _PICKLE_EXTS:
                out[field] = pickle.loads(value)
            else:
                out[field] = bytes(value) if not isinstance(value, bytes) else value
        except Exception as exc:
            key = sample.get("__key__")
            raise ValueError(f"sample {key!r}, field {field!r}: does not decode as {kind}: {exc}") from exc
    return out


# ---------------------------------------------------------------- parquet
def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("Parquet shards need pyarrow: pip install 'stoker[parquet]'") from None
    return pa, pq


def parquet_row_groups(fileobj: BinaryIO | str) -> list[int]:
    """The number of rows in each row group of a Parquet file (its footer only).

    Args:
        fileobj: A path or a seekable binary file object.

    Returns:
        Rows per row group, in order.

    Raises:
        CorruptShardError: when the file is not Parquet.
        ImportError: when pyarrow is not installed.
    """
    _, pq = _pyarrow()
    try:
        meta = pq.ParquetFile(fileobj).metadata
    except Exception as exc:
        name = fileobj if isinstance(fileobj, str) else getattr(fileobj, "name", "<parquet>")
        raise CorruptShardError(f"{name}: not a Parquet file ({exc})") from None
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


_ROW_GROUPS: collections.OrderedDict[tuple[Any, ...], list[dict[str, Any]]] = collections.OrderedDict()
_ROW_GROUPS_LOCK = threading.Lock()
ROW_GROUP_CACHE = 8  # decoded row groups kept per process


def _forget_row_groups() -> None:
    global _ROW_GROUPS_LOCK
    _ROW_GROUPS_LOCK = threading.Lock()  # another thread may have held it at the fork
    _ROW_GROUPS.clear()


at_fork(after_in_child=_forget_row_groups)


def read_parquet_row(path: str, row_group: int, row: int, columns: Sequence[str] | None = None) -> dict[str, Any]:
    """One row of a local Parquet file, as `{column: value}`.

    The row group it is in is decoded whole and kept: the last few decoded row groups stay
    in this process (keyed by the file's path, inode, size and mtime, so a replaced file is
    read again).

    Args:
        path: The Parquet file's local path.
        row_group: The row group's number.
        row: The row's number within the row group.
        columns: The columns to read; None reads all. Defaults to None.

    Returns:
        `{column: value}`, values as pyarrow gives them to Python (bytes, str, int, list...).

    Raises:
        CorruptShardError: when the file does not parse as Parquet, or has no such row group
            or row; it names the file and the row.
        FileNotFoundError: when there is no file at `path`.
        ImportError: when pyarrow is not installed.
    """
    st = os.stat(path)
    cols = None if columns is None else tuple(columns)
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns, row_group, cols)
    with _ROW_GROUPS_LOCK:
        rows = _ROW_GROUPS.get(key)
        if rows is not None:
            _ROW_GROUPS.move_to_end(key)
    if rows is None:
        _, pq = _pyarrow()
        try:
            with pq.ParquetFile(path) as pf:
                if not 0 <= row_group < pf.metadata.num_row_groups:
                    raise CorruptShardError(
                        f"{path}: row group {row_group} of {pf.metadata.num_row_groups} does not exist"
                    )
                rows = pf.read_row_group(row_group, columns=None if cols is None else list(cols)).to_pylist()
        except CorruptShardError:
            raise
        except Exception as exc:
            raise CorruptShardError(f"{path}, row group {row_group}: does not read as Parquet ({exc})") from None
        with _ROW_GROUPS_LOCK:
            _ROW_GROUPS[key] = rows
            while len(_ROW_GROUPS) > ROW_GROUP_CACHE:
                _ROW_GROUPS.popitem(last=False)
    if not 0 <= row < len(rows):
        raise CorruptShardError(f"{path}, row group {row_group}: row {row} of {len(rows)} does not exist")
    return dict(rows[row])
