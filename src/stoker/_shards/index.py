"""The index at a prefix: `stoker-index.json`, which says what every shard holds.

A loader reads it with one request at its start and never lists the bucket: it gives each
shard's name, size and sha256, its number of samples, and where each sample is (the byte
offset of each sample in a tar shard; the rows in each row group of a Parquet shard). Samples
are numbered globally in shard order.

`build_index` makes it once for shards written by anything (webdataset's `TarWriter`,
pyarrow, `write_shards`): it lists the prefix, reads every `.tar` / `.parquet` object and
saves the index beside them.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._base.checks import check_choice, check_int
from .errors import (
    INDEX_NAME,
    CorruptShardError,
    MalformedIndexError,
    MissingIndexError,
    MissingObjectError,
)
from .formats import iter_tar_samples, parquet_row_groups
from .store import Store

__all__ = ["INDEX_NAME", "Index", "MalformedIndexError", "MissingIndexError", "ShardInfo", "build_index"]

VERSION = 1
FORMATS = ("tar", "parquet")
_SUFFIXES = {"tar": ".tar", "parquet": ".parquet"}


@dataclass(eq=False)
class ShardInfo:
    """What the index says of one shard.

    Args:
        name: The object's name relative to the prefix, e.g. "shard-00000-000000.tar".
        size: The object's size in bytes.
        sha256: The hex sha256 of the whole object.
        samples: How many samples it holds.
        offsets: Tar only: `samples + 1` byte offsets, the start of each sample's first
            header and, last, the end of the last sample's padded data; None for Parquet.
        row_groups: Parquet only: the rows in each row group; None for tar.
    """

    name: str
    size: int
    sha256: str
    samples: int
    offsets: np.ndarray | None = None
    row_groups: tuple[int, ...] | None = None

    def byte_range(self, k: int) -> tuple[int, int]:
        """The byte range `[start, end)` of sample `k` of this (tar) shard.

        Args:
            k: The sample's number within the shard.

        Returns:
            `(start, end)` offsets into the shard.

        Raises:
            ValueError: when the shard is not a tar shard.
            IndexError: when `k` is not in `[0, samples)`.
        """
        if self.offsets is None:
            raise ValueError(f"{self.name} is not a tar shard: it has no byte offsets")
        self._check_sample(k)
        return int(self.offsets[k]), int(self.offsets[k + 1])

    def row_of(self, k: int) -> tuple[int, int]:
        """Where sample `k` of this (Parquet) shard is: `(row group, row within it)`.

        Args:
            k: The sample's number within the shard.

        Returns:
            `(row_group, row)`.

        Raises:
            ValueError: when the shard is not a Parquet shard.
            IndexError: when `k` is not in `[0, samples)`.
        """
        if self.row_groups is None:
            raise ValueError(f"{self.name} is not a Parquet shard: it has no row groups")
        self._check_sample(k)
        group = 0
        for rows in self.row_groups:
            if k < rows:
                return group, k
            k -= rows
            group += 1
        raise IndexError(f"{self.name}: its row groups hold fewer rows than its samples")

    def _check_sample(self, k: int) -> None:
        if not 0 <= k < self.samples:
            raise IndexError(f"{self.name} holds {self.samples} samples, asked for sample {k}")

    def to_json(self) -> dict[str, Any]:
        """The shard's entry in the index file.

        Returns:
            A JSON-ready dict.
        """
        entry: dict[str, Any] = {
            "name": self.name,
            "size": int(self.size),
            "sha256": self.sha256,
            "samples": int(self.samples),
        }
        if self.offsets is not None:
            entry["offsets"] = [int(o) for o in self.offsets]
        if self.row_groups is not None:
            entry["row_groups"] = [int(r) for r in self.row_groups]
        return entry


def _fail(where: str, what: str) -> MalformedIndexError:
    return MalformedIndexError(f"{where}: malformed {INDEX_NAME}: {what}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shard_from_json(entry: object, i: int, fmt: str, where: str) -> ShardInfo:
    if not isinstance(entry, Mapping):
        raise _fail(where, f"shards[{i}] is a {type(entry).__name__}, not an object")
    for key, kind in (("name", str), ("size", int), ("sha256", str), ("samples", int)):
        if key not in entry:
            raise _fail(where, f"shards[{i}] has no {key!r}")
        if not isinstance(entry[key], kind) or isinstance(entry[key], bool):
            raise _fail(where, f"shards[{i}].{key} is {entry[key]!r}, not a {kind.__name__}")
    name, size, samples = entry["name"], entry["size"], entry["samples"]
    if size < 0 or samples < 0:
        raise _fail(where, f"shards[{i}] ({name}) has a negative size or sample count")
    offsets = row_groups = None
    if fmt == "tar":
        raw = entry.get("offsets")
        if not isinstance(raw, list) or not all(_is_int(o) for o in raw):
            raise _fail(where, f"shards[{i}] ({name}): a tar shard needs 'offsets', a list of ints")
        if len(raw) != samples + 1:
            raise _fail(where, f"shards[{i}] ({name}) has {samples} samples but {len(raw)} offsets (want samples + 1)")
        offsets = np.asarray(raw, dtype=np.int64)
        if len(offsets) and (offsets[0] < 0 or offsets[-1] > size or np.any(np.diff(offsets) <= 0)):
            raise _fail(where, f"shards[{i}] ({name}): offsets should increase within [0, size={size}]")
    else:
        raw = entry.get("row_groups")
        if not isinstance(raw, list) or not all(_is_int(r) and r >= 0 for r in raw):
            raise _fail(where, f"shards[{i}] ({name}): a Parquet shard needs 'row_groups', a list of ints")
        if sum(raw) != samples:
            raise _fail(where, f"shards[{i}] ({name}) has {samples} samples but its row groups hold {sum(raw)} rows")
        row_groups = tuple(raw)
    return ShardInfo(name, size, entry["sha256"], samples, offsets, row_groups)


class Index:
    """Every shard at a prefix and every sample in them, as `stoker-index.json` says.

    Args:
        format: "tar" or "parquet".
        shards: The shards, in sample order.

    Raises:
        ValueError: when `format` is not "tar" or "parquet".
    """

    def __init__(self, format: str, shards: Sequence[ShardInfo]) -> None:
        check_choice("format", format, FORMATS)
        self.format = format
        self.shards = list(shards)
        counts = np.fromiter((s.samples for s in self.shards), dtype=np.int64, count=len(self.shards))
        self.starts = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.starts[1:])
        self._starts: list[int] = self.starts.tolist()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __repr__(self) -> str:
        return f"Index(format={self.format!r}, shards={len(self.shards)}, samples={len(self)})"

    def locate(self, i: int) -> tuple[int, int]:
        """Which shard holds global sample `i`, and where in it.

        Args:
            i: The sample's global number, in `[0, len(index))`.

        Returns:
            `(shard_number, k)`: the shard's position in `shards` and the sample's number in it.

        Raises:
            IndexError: when `i` is out of range.
        """
        total = self._starts[-1]
        if not 0 <= i < total:
            raise IndexError(f"sample {i} is out of range: the index holds {total} samples")
        i = int(i)
        # bisect on a list: a numpy call per sample costs more than the search (the hot path of
        # every read)
        shard = bisect.bisect_right(self._starts, i) - 1
        return shard, i - self._starts[shard]

    def to_json(self) -> dict[str, Any]:
        """The index as the JSON object the file holds.

        Returns:
            A JSON-ready dict.
        """
        return {
            "stoker_index": VERSION,
            "format": self.format,
            "samples": len(self),
            "shards": [s.to_json() for s in self.shards],
        }

    @classmethod
    def from_json(cls, data: object, where: str = INDEX_NAME) -> Index:
        """An index from the JSON object of a `stoker-index.json`, checked.

        Args:
            data: The parsed JSON.
            where: The file's URL, for error messages. Defaults to "stoker-index.json".

        Returns:
            The Index.

        Raises:
            MalformedIndexError: when a key is missing, a value has the wrong type, the
                version is not one this stoker reads, or the counts disagree; the message
                says which.
        """
        if not isinstance(data, Mapping):
            raise _fail(where, f"the file holds a {type(data).__name__}, not a JSON object")
        version = data.get("stoker_index")
        if version != VERSION:
            raise _fail(where, f"stoker_index is {version!r}; this stoker reads version {VERSION}")
        fmt = data.get("format")
        if fmt not in FORMATS:
            raise _fail(where, f"format is {fmt!r}, not 'tar' or 'parquet'")
        shards = data.get("shards")
        if not isinstance(shards, list):
            raise _fail(where, "'shards' should be a list")
        infos = [_shard_from_json(entry, i, fmt, where) for i, entry in enumerate(shards)]
        names = [s.name for s in infos]
        if len(set(names)) != len(names):
            raise _fail(where, "a shard is listed twice")
        index = cls(fmt, infos)
        if data.get("samples") != len(index):
            raise _fail(where, f"samples is {data.get('samples')!r} but the shards hold {len(index)}")
        return index

    @classmethod
    def load(cls, store: Store) -> Index:
        """The index at a store's prefix, read with one request.

        Args:
            store: The prefix's Store.

        Returns:
            The Index.

        Raises:
            MissingIndexError: when the prefix has no index (a FileNotFoundError whose
                message says how to build one).
            MalformedIndexError: when the file is not valid JSON or not a valid index.
            OSError: a StoreError or AccessDeniedError from the store.
        """
        where = store.url_of(INDEX_NAME)
        try:
            raw = store.read(INDEX_NAME)
        except MissingObjectError:
            raise MissingIndexError(store.url) from None
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise _fail(where, f"not JSON ({exc})") from None
        return cls.from_json(data, where)

    def save(self, store: Store) -> None:
        """Write the index to a store's prefix as `stoker-index.json`.

        Args:
            store: The prefix's Store.

        Raises:
            OSError: when the store refuses the write.
        """
        store.write(INDEX_NAME, json.dumps(self.to_json(), separators=(",", ":")).encode())


def scan_shard(store: Store, name: str, fmt: str) -> ShardInfo:
    """Read one shard whole and describe it (size, sha256, samples, offsets or row groups).

    Args:
        store: The prefix's Store.
        name: The shard's name under the prefix.
        fmt: "tar" or "parquet".

    Returns:
        Its ShardInfo.

    Raises:
        CorruptShardError: when the shard does not parse, naming it and the sample.
        OSError: the store's errors.
    """
    url = store.url_of(name)
    with tempfile.TemporaryFile(prefix="stoker-scan-") as f:
        store.download(name, f)
        size = f.tell()
        f.seek(0)
        digest = hashlib.sha256()
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        f.seek(0)
        if fmt == "tar":
            # Sample k's range runs to sample k + 1's start: members skipped by the grouping
            # rule (folders, metadata) that follow a sample are read with it, and skipped again.
            offsets: list[int] = []
            last_end = 0
            for _, _, start, end in iter_tar_samples(f, url):
                offsets.append(start)
                last_end = end
            offsets.append(last_end)
            return ShardInfo(name, size, digest.hexdigest(), len(offsets) - 1, np.asarray(offsets, dtype=np.int64))
        try:
            groups = parquet_row_groups(f)
        except CorruptShardError as exc:
            raise CorruptShardError(f"{url}: {str(exc).split(': ', 1)[-1]}") from None
        return ShardInfo(name, size, digest.hexdigest(), sum(groups), None, tuple(groups))


def build_index(
    url: str,
    format: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    threads: int = 4,
) -> Index:
    """Scan the shards at a prefix and save their index there (`stoker-index.json`).

    Lists the prefix once, reads every `.tar` (or `.parquet`) object, a few at a time, and
    records each one's size, sha256, samples and where each sample is. Shards are taken in
    name order, which is the samples' global order.

    Args:
        url: The prefix, e.g. "s3://bucket/data" or a local folder.
        format: "tar" or "parquet"; None picks the one whose objects the prefix holds.
            Defaults to None.
        storage_options: Passed to the Store's client (e.g. `{"endpoint_url": ...}`).
            Defaults to None.
        threads: How many shards are read at once. Defaults to 4.

    Returns:
        The Index, also saved at the prefix.

    Raises:
        TypeError: when `threads` is not an int.
        ValueError: when `format` is not "tar", "parquet" or None, `threads` is below 1, the
            prefix holds no shards, or it holds both kinds and `format` is None.
        CorruptShardError: when a shard does not parse; it names the shard and sample.
        OSError: the store's errors (each names the URL).
    """
    check_choice("format", format, (*FORMATS, None))
    check_int("threads", threads, low=1)
    store = Store(url, storage_options=storage_options)
    names = store.list()
    found = {fmt: [n for n in names if n.endswith(_SUFFIXES[fmt])] for fmt in FORMATS}
    if format is None:
        present = [fmt for fmt in FORMATS if found[fmt]]
        if len(present) > 1:
            raise ValueError(f"{store.url} holds both .tar and .parquet objects: pass format='tar' or 'parquet'")
        if not present:
            raise ValueError(f"{store.url} holds no .tar or .parquet objects to index")
        format = present[0]
    shards = found[format]
    if not shards:
        raise ValueError(f"{store.url} holds no {_SUFFIXES[format]} objects to index")
    with ThreadPoolExecutor(max_workers=min(threads, len(shards))) as pool:
        infos = list(pool.map(lambda n: scan_shard(store, n, format), shards))
    index = Index(format, infos)
    index.save(store)
    return index
