"""Any dataset -> shards at a URL, and their index: `write_shards`; the tar and Parquet shard
writers it uses (`TarShardWriter`: deterministic ustar, fixed mtime, owner and mode, pax only
for a name longer than the ustar field; `write_parquet`).

A map-style dataset is cut into contiguous parts, one per worker process, and each part
writes its own numbered shards (`shard-PPPPP-NNNNNN.tar`), so the shards' names sort in
sample order. An iterable is written by one producer, which hands each finished shard to a
background thread to upload. The index is written last: a prefix that has one is complete.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from .._base.checks import check_choice, check_int, fail
from .formats import BLOCK, _padded, _pyarrow, encode_auto, pax_record, split_name, ustar_header
from .index import FORMATS, Index, ShardInfo
from .store import Store

__all__ = ["TarShardWriter", "write_parquet", "write_shards"]

_ROW_GROUP_BYTES = 1 << 20  # a row group a random read decodes whole: small, for random access
_UPLOADS_IN_FLIGHT = 2

Encoder = Callable[[Any, str], Any]


class TarShardWriter:
    """A tar shard built in memory, one sample at a time: deterministic ustar, members of a
    sample in field-name order, as webdataset writes them.

    Args:
        shard: The shard's name, for error messages. Defaults to "<tar shard>".

    Raises:
        Nothing on construction.
    """

    def __init__(self, shard: str = "<tar shard>") -> None:
        self.shard = shard
        self._out = io.BytesIO()
        self._hash = hashlib.sha256()
        self.offsets: list[int] = [0]
        self.size = 0

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _put(self, data: bytes) -> None:
        self._out.write(data)
        self._hash.update(data)
        self.size += len(data)

    def add(self, key: str, fields: Mapping[str, bytes | bytearray | memoryview]) -> None:
        """Append one sample.

        Args:
            key: The sample's key: no "." in its base name, not empty, not a `__...__` name.
            fields: `{field: bytes}`; the field becomes the member name's extension.

        Raises:
            ValueError: when the key or a field name would not read back as written (a "."
                in the key's base name, an upper-case or empty field, a "/" in a field), or
                a value is not bytes.
        """
        if not fields:
            raise ValueError(f"sample {key!r} has no fields: a tar sample needs at least one")
        for field in sorted(fields):
            name = f"{key}.{field}"
            if field != field.lower() or not field or "/" in field:
                raise ValueError(
                    f"field {field!r} of sample {key!r}: field names are lowercase, non-empty and "
                    "hold no '/' (webdataset lowercases them when it reads)"
                )
            if split_name(name) != (key, field):
                raise ValueError(
                    f"key {key!r}: a key is a non-empty path whose base name holds no '.' and is "
                    "not a __metadata__ name"
                )
            value = fields[field]
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise ValueError(
                    f"field {field!r} of sample {key!r} is {type(value).__name__}, not bytes: "
                    "encode it first (encode_auto)"
                )
            raw_name = name.encode("utf-8", "surrogateescape")
            size = len(value)
            if len(raw_name) > 100 or size >= 8**11:
                records = b""
                if len(raw_name) > 100:
                    records += pax_record("path", name)
                if size >= 8**11:
                    records += pax_record("size", str(size))
                self._put(ustar_header(b"././@PaxHeader", len(records), b"x"))
                self._put(records + bytes(_padded(len(records)) - len(records)))
                raw_name = raw_name[:100]
            self._put(ustar_header(raw_name, min(size, 8**11 - 1)))
            self._put(bytes(value))
            self._put(bytes(_padded(size) - size))
        self.offsets.append(self.size)

    def finish(self) -> tuple[bytes, str]:
        """Close the archive (two zero blocks).

        Returns:
            `(the shard's bytes, their sha256 hex digest)`.
        """
        self._put(bytes(2 * BLOCK))
        return self._out.getvalue(), self._hash.hexdigest()


def write_parquet(rows: Sequence[Mapping[str, Any]], out: BinaryIO | str, row_group_size: int = 1024) -> list[int]:
    """Write samples as the rows of one Parquet file.

    Args:
        rows: The samples, `{column: value}` each, all with the same columns; values are
            what pyarrow stores (numbers, str, bytes, lists); encode arrays first.
        out: A path or a binary file object to write to.
        row_group_size: Rows per row group, the unit a random read decodes. Defaults to 1024.

    Returns:
        The number of rows in each row group.

    Raises:
        ValueError: when `rows` is empty, `row_group_size` is below 1, or the rows' columns
            differ.
        ImportError: when pyarrow is not installed.
    """
    pa, pq = _pyarrow()
    if not rows:
        raise ValueError("rows is empty: a Parquet shard needs at least one row")
    check_int("row_group_size", row_group_size, low=1, unit="rows")
    columns = list(rows[0])
    for i, row in enumerate(rows):
        if list(row) != columns and set(row) != set(columns):
            raise ValueError(f"row {i} has columns {sorted(row)}, the first row has {sorted(columns)}")
    table = pa.table({c: [row[c] for row in rows] for c in columns})
    pq.write_table(table, out, row_group_size=row_group_size)
    n = len(rows)
    return [min(row_group_size, n - s) for s in range(0, n, row_group_size)]


@dataclass(frozen=True)
class _WriteSpec:
    url: str
    storage_options: dict[str, Any] | None
    format: str
    shard_bytes: int
    fields: tuple[str, ...] | None
    encode: Encoder | None
    row_group_size: int | None


def _as_dict(sample: Any, number: int, fields: tuple[str, ...] | None) -> dict[str, Any]:
    if isinstance(sample, Mapping):
        return dict(sample)
    if isinstance(sample, (tuple, list)):
        if fields is None:
            raise ValueError(
                f"sample {number} is a {type(sample).__name__}: pass fields=(...) naming its "
                "items (e.g. fields=('jpg', 'cls')), or make samples dicts"
            )
        if len(sample) != len(fields):
            raise ValueError(f"sample {number} has {len(sample)} items but fields names {len(fields)}: {fields}")
        return dict(zip(fields, sample))
    raise ValueError(
        f"sample {number} is a {type(sample).__name__}: samples should be dicts "
        "({field: value}) or tuples/lists named by fields"
    )


def _parquet_auto(value: Any, field: str) -> Any:
    if isinstance(value, np.ndarray):
        return encode_auto(value, field)
    if isinstance(value, np.generic):
        return value.item()
    return value


def _value_bytes(value: Any) -> int:
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return len(value)
    return 8


class _PartWriter:
    """Writes one part's samples into numbered shards, uploading each in the background."""

    def __init__(self, spec: _WriteSpec, part: int) -> None:
        self.spec = spec
        self.part = part
        self.store = Store(spec.url, storage_options=spec.storage_options)
        self.suffix = ".tar" if spec.format == "tar" else ".parquet"
        self.infos: list[ShardInfo] = []
        self.uploads: list[Future[None]] = []
        self.pool = ThreadPoolExecutor(max_workers=_UPLOADS_IN_FLIGHT, thread_name_prefix="stoker-upload")
        self.tar: TarShardWriter | None = None
        self.rows: list[dict[str, Any]] = []
        self.row_bytes = 0

    def _name(self) -> str:
        return f"shard-{self.part:05d}-{len(self.infos):06d}{self.suffix}"

    def add(self, number: int, sample: Any) -> None:
        spec = self.spec
        values = _as_dict(sample, number, spec.fields)
        key = values.pop("__key__", None)
        key = f"{number:09d}" if key is None else str(key)
        try:
            if spec.format == "tar":
                encoded = {}
                for field, value in values.items():
                    if field.startswith("_"):
                        continue  # metadata, which webdataset's writer leaves out too
                    encoded[field] = value if spec.encode is None else spec.encode(value, field)
                if self.tar is None:
                    self.tar = TarShardWriter(self._name())
                self.tar.add(key, encoded)
                if self.tar.size >= spec.shard_bytes:
                    self._close()
            else:
                row = {"__key__": key}
                for field, value in values.items():
                    row[field] = value if spec.encode is None else spec.encode(value, field)
                self.rows.append(row)
                self.row_bytes += sum(_value_bytes(v) for v in row.values())
                if self.row_bytes >= spec.shard_bytes:
                    self._close()
        except ValueError as exc:
            raise ValueError(f"sample {number} (key {key!r}): {exc}") from None

    def _close(self) -> None:
        name = self._name()
        if self.tar is not None:
            writer, self.tar = self.tar, None
            data, digest = writer.finish()
            info = ShardInfo(name, len(data), digest, len(writer), np.asarray(writer.offsets, dtype=np.int64))
        elif self.rows:
            rows, self.rows = self.rows, []
            per_group = self.spec.row_group_size
            if per_group is None:
                per_group = max(1, len(rows) * _ROW_GROUP_BYTES // max(1, self.row_bytes))
            self.row_bytes = 0
            buf = io.BytesIO()
            groups = write_parquet(rows, buf, row_group_size=per_group)
            data = buf.getvalue()
            info = ShardInfo(name, len(data), hashlib.sha256(data).hexdigest(), len(rows), None, tuple(groups))
        else:
            return
        self.infos.append(info)
        while len(self.uploads) >= _UPLOADS_IN_FLIGHT:
            self.uploads.pop(0).result()
        self.uploads.append(self.pool.submit(self.store.write, name, data))

    def finish(self) -> list[ShardInfo]:
        try:
            self._close()
            for upload in self.uploads:
                upload.result()
        finally:
            self.pool.shutdown(wait=True)
        return self.infos


def _write_part(spec: _WriteSpec, part: int, samples: Iterator[tuple[int, Any]]) -> list[ShardInfo]:
    writer = _PartWriter(spec, part)
    try:
        for number, sample in samples:
            writer.add(number, sample)
    except BaseException:
        writer.pool.shutdown(wait=True)
        raise
    return writer.finish()


# A fork child inherits the source from here, so a map-style source need not pickle.
_FORKED_SOURCE: Any = None


def _run_part(spec: _WriteSpec, part: int, lo: int, hi: int, source: Any = None) -> list[ShardInfo]:
    data = _FORKED_SOURCE if source is None else source
    return _write_part(spec, part, ((i, data[i]) for i in range(lo, hi)))


def _context() -> Any:
    # On Linux, fork: the children inherit the source, which need not pickle (many datasets
    # hold open files or handles). A child runs only the source's __getitem__, the encoder and
    # its own Store client, made anew after the fork (or asking this process, once this process
    # has used obstore: see `relay`). Elsewhere fork is unsafe: spawn, and the
    # source is pickled to each child.
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _check(
    format: str,
    shard_bytes: int,
    fields: Sequence[str] | None,
    workers: int | None,
    encode: str | Encoder | None,
    row_group_size: int | None,
) -> tuple[tuple[str, ...] | None, Encoder | None]:
    check_choice("format", format, FORMATS)
    check_int("shard_bytes", shard_bytes, low=1, unit="bytes per shard")
    names: tuple[str, ...] | None = None
    if fields is not None:
        if isinstance(fields, str) or not all(isinstance(f, str) and f for f in fields):
            fail(ValueError, "fields", "a sequence of non-empty field names", fields)
        names = tuple(fields)
        if len(set(names)) != len(names):
            fail(ValueError, "fields", "a sequence naming each field once", fields)
    check_int("workers", workers, low=1, none_ok=True)
    check_int("row_group_size", row_group_size, low=1, unit="rows", none_ok=True)
    encoder: Encoder | None
    if encode == "auto":
        encoder = encode_auto if format == "tar" else _parquet_auto
    elif encode is None or callable(encode):
        encoder = encode
    else:
        fail(ValueError, "encode", "'auto', None or a callable(value, field)", encode)
    return names, encoder


def write_shards(
    source: Any,
    url: str,
    *,
    format: str = "tar",
    shard_bytes: int = 268435456,
    fields: Sequence[str] | None = None,
    workers: int | None = None,
    encode: str | Encoder | None = "auto",
    storage_options: Mapping[str, Any] | None = None,
    row_group_size: int | None = None,
) -> Index:
    """Write a dataset as shards at a URL, then their index (`stoker-index.json`).

    Args:
        source: A map-style dataset (`__len__` and `__getitem__`), written in contiguous
            parts by worker processes, or any iterable, written by this process. A sample is
            a dict `{field: value}` (fields are tar extensions such as "jpg", "cls",
            "seg.png", or Parquet columns; "__key__", if present, is the sample's key, else
            its number zero-padded) or a tuple/list named by `fields`.
        url: The prefix to write under ("s3://bucket/data", "file:///path", a local path).
        format: "tar" (WebDataset layout) or "parquet". Defaults to "tar".
        shard_bytes: A shard is closed once it holds this many bytes (Parquet: of values,
            before compression). 256 MiB by default. Defaults to 268435456.
        fields: The field names of tuple/list samples, in order. Defaults to None.
        workers: Processes writing a map-style source; None is min(cores, 8); 1 writes in
            this process. Defaults to None.
        encode: "auto" (tar: `encode_auto`; Parquet: arrays as .npy bytes, numpy scalars as
            Python ones, the rest as pyarrow stores it), None (values are stored as given:
            bytes for tar), or a callable `(value, field) -> encoded value`. Defaults to
            "auto".
        storage_options: Passed to the store's client (e.g. `{"endpoint_url": ...}`).
            Defaults to None.
        row_group_size: Parquet only: rows per row group; None picks about 1 MiB of values
            per group. Defaults to None.

    Returns:
        The Index of the written shards (also saved at `url`).

    Raises:
        TypeError: when `url`, `shard_bytes`, `workers` or `row_group_size` is not of the type
            it accepts (the message names it).
        ValueError: when an argument is not one of those accepted (the message names it), a
            sample is not a dict or a tuple that `fields` names, a value has no encoding, or
            the source is empty.
        OSError: the store's errors (each names the URL).
    """
    names, encoder = _check(format, shard_bytes, fields, workers, encode, row_group_size)
    if not isinstance(url, str) or not url:
        fail(ValueError if isinstance(url, str) else TypeError, "url", "a non-empty string", url)
    spec = _WriteSpec(url, dict(storage_options or {}) or None, format, shard_bytes, names, encoder, row_group_size)
    map_style = hasattr(source, "__len__") and hasattr(source, "__getitem__") and not isinstance(source, Mapping)
    if not map_style and not isinstance(source, Iterable):
        raise ValueError(
            f"source should be a map-style dataset (__len__ and __getitem__) or an iterable, "
            f"but got a {type(source).__name__}"
        )
    if map_style:
        n = len(source)
        parts = min(workers or min(_cores(), 8), n)
        if parts <= 1:
            infos = _write_part(spec, 0, ((i, source[i]) for i in range(n)))
        else:
            infos = _write_parallel(spec, source, n, parts)
    else:
        infos = _write_part(spec, 0, enumerate(source))
    if not infos:
        raise ValueError("source is empty: there is nothing to write")
    index = Index(format, sorted(infos, key=lambda s: s.name))
    index.save(Store(url, storage_options=storage_options))
    return index


def _write_parallel(spec: _WriteSpec, source: Any, n: int, parts: int) -> list[ShardInfo]:
    global _FORKED_SOURCE
    context = _context()
    forked = context.get_start_method() == "fork"
    bounds = [n * p // parts for p in range(parts + 1)]
    if forked:
        _FORKED_SOURCE = source
    try:
        with ProcessPoolExecutor(max_workers=parts, mp_context=context) as pool:
            jobs = [
                pool.submit(_run_part, spec, p, bounds[p], bounds[p + 1], None if forked else source)
                for p in range(parts)
            ]
            infos = []
            for job in jobs:
                infos.extend(job.result())
    finally:
        _FORKED_SOURCE = None
    return infos
