"""`ShardedDataset`: a map-style dataset over the shards at a URL prefix, read through a bounded
local cache, with downloads driven by the batches the loader draws ahead.

Start-up reads one object (the index). Sample `i` is found in the index (its shard and byte
range, or row group), its shard is brought into the machine's cache (`ShardCache`: one
download per machine, whoever asks first), and the sample is read from the local file.

The loader tells the dataset what comes next through `stoker_upcoming` (the look-ahead hook,
called in the loader's process with each batch's indices as its sampler draws them); a few
threads there download the shards those batches need, in the order they are needed, and
lease them (pin them in the cache) until the samples drawn from them have been read, so that
eviction takes only shards no unread batch needs. Workers then find their shards on local
disk.
A dataset used without a stoker loader (or by torch's) works the same, only without the
downloads ahead: each shard is fetched when a sample of it is first read.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, BinaryIO

import numpy as np

from .._base.checks import check_bool, check_callable, check_choice, check_int, check_number
from .._base.process import PerProcess, finalize
from .._data.datasets import Dataset
from .._data.identity import callable_name
from .ahead import DownloadsAhead, Reads, Tally, download_parts
from .cache import ShardCache
from .errors import AccessDeniedError, MissingObjectError, StoreError
from .formats import decode_auto, read_parquet_row, read_tar_sample
from .index import Index
from .store import Store

# how many upcoming shards the downloads may run ahead of the batches being read, by default
DEFAULT_PREFETCH_SHARDS = 4


class ShardedDataset(Dataset[Any]):
    """The samples of the shards at a URL prefix, read through a local cache.

    The prefix holds the shards (WebDataset tar or Parquet, or what `write_shards` wrote)
    and their index, `stoker-index.json` (`write_shards` writes it; `stoker index URL`
    builds it once for shards written by another tool). A sample of a tar shard is a dict
    with `__key__` and one entry per file of the sample, by extension; of a Parquet shard,
    a dict of its row's columns.

    Use it with `ShardedSampler`, whose order reads each shard in one stretch:

        data = ShardedDataset("s3://bucket/train", cache_bytes=20 << 30)
        loader = DataLoader(data, batch_size=64, sampler=ShardedSampler(data, seed=0))

    Args:
        url: The prefix: `s3://bucket/path`, `file:///path` or a plain path (tested);
            `gs://`, `hf://`, `https://` go through the same client layer (untested here).
        cache_dir: The machine's cache folder; datasets of other prefixes (or other
            contents) get sub-folders of their own, so ranks and jobs reading the same
            data share one. None means `stoker-shards` in the temporary folder
            (`tempfile.gettempdir()`). Defaults to None.
        cache_bytes: The cache's byte cap, never exceeded (int > 0). None means the
            dataset's size or half the free space of `cache_dir`'s disk, whichever is
            smaller. Defaults to None.
        decode: "auto" decodes the fields whose extension says how (`cls`, `txt`, `json`,
            `npy`; `pyd`/`pickle` only with `allow_pickle=True`; images stay bytes); None
            leaves every field bytes; or a callable taking the sample dict and returning what
            `__getitem__` gives. Defaults to "auto".
        transform: A callable applied to each decoded sample. None means none. Defaults
            to None.
        storage_options: Options for the store's client (e.g. `{"endpoint_url": ...}`);
            None means the client's defaults and the environment. Defaults to None.
        client: "auto", "obstore" or "fsspec" (see `Store`). Defaults to "auto".
        prefetch_shards: How many shards the downloads run ahead of the ones being read
            (int >= 0; 0 downloads only what a batch already drawn needs). Defaults to 4.
        download_threads: Concurrent downloads in the loader's process (int >= 1).
            Defaults to 4.
        timeout_s: How long a read waits for room in the cache, or for another process's
            download of the shard it needs, before it raises. Defaults to 600.0.
        store_retries: How many times the store retries a request that failed transiently
            (5xx, SlowDown, a reset, a timeout) before it raises `StoreError` (int >= 0).
            Defaults to 6.
        store_timeout_s: A request to the store that has sent nothing for this long is
            abandoned and retried (seconds > 0). Defaults to 30.0.
        part_bytes: A remote shard larger than two parts is downloaded as ranges of this
            many bytes, `download_threads` at a time (an object store serves each
            connection at a bounded rate); None downloads each shard in one request.
            16 MiB by default. Defaults to 16777216.
        allow_pickle: Whether `decode="auto"` unpickles `pyd`/`pickle` fields (bool).
            Unpickling runs whatever code the bytes name, so anyone who can write to the store
            could run code in every worker: by default such a field raises `ValueError`
            naming it and this argument. Pass True only for a store you trust. Defaults to
            False.

    Raises:
        MissingObjectError: when the prefix has no index (the message says how to build it).
        TypeError: when an argument is not of the type it accepts (the message names it).
        ValueError: when an argument's value is outside what it accepts (the message names
            it), or `cache_bytes` is smaller than the largest shard.
    """

    def __init__(
        self,
        url: str,
        cache_dir: str | None = None,
        cache_bytes: int | None = None,
        decode: str | Callable[[dict[str, Any]], Any] | None = "auto",
        transform: Callable[[Any], Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        client: str = "auto",
        prefetch_shards: int = DEFAULT_PREFETCH_SHARDS,
        download_threads: int = 4,
        timeout_s: float = 600.0,
        store_retries: int = 6,
        store_timeout_s: float = 30.0,
        part_bytes: int | None = 16777216,
        allow_pickle: bool = False,
    ) -> None:
        if not callable(decode):
            check_choice("decode", decode, ("auto", None), also="a callable")
        check_bool("allow_pickle", allow_pickle)
        check_callable("transform", transform, none_ok=True)
        check_int("prefetch_shards", prefetch_shards, low=0)
        check_int("download_threads", download_threads, low=1)
        check_int("cache_bytes", cache_bytes, low=1, unit="bytes", none_ok=True)
        check_int("part_bytes", part_bytes, low=1, unit="bytes", none_ok=True)
        check_number("timeout_s", timeout_s, low=0, unit="seconds")
        check_int("store_retries", store_retries, low=0)
        check_number("store_timeout_s", store_timeout_s, above=0, unit="seconds")
        self.url = url
        self.store = Store(
            url, storage_options=storage_options, client=client, retries=store_retries, timeout_s=store_timeout_s
        )
        self.index = Index.load(self.store)
        self.shard_starts = np.asarray(self.index.starts, dtype=np.int64)
        self._sizes = [int(s.size) for s in self.index.shards]
        self.decode = decode
        self.allow_pickle = allow_pickle
        self.transform = transform
        self.prefetch_shards = prefetch_shards
        self.part_bytes = part_bytes
        self.download_threads = download_threads
        folder = cache_dir if cache_dir is not None else os.path.join(tempfile.gettempdir(), "stoker-shards")
        # one sub-folder per (prefix, contents): a rewritten prefix never reads an old shard
        digest = hashlib.sha256(repr((self.store.url, [(s.name, s.sha256) for s in self.index.shards])).encode())
        folder = os.path.join(folder, digest.hexdigest()[:16])
        if cache_bytes is None:
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:  # said as the cache says it when given cache_bytes
                raise type(exc)(
                    exc.errno,
                    f"cannot make the shard cache folder {folder} ({exc.strerror}): pass a cache_dir that can be created",
                ) from exc
            stat = os.statvfs(folder)
            cache_bytes = max(1, min(sum(self._sizes), stat.f_bavail * stat.f_frsize // 2))
        largest = max(self._sizes, default=0)
        if cache_bytes < largest:
            raise ValueError(
                f"cache_bytes={cache_bytes} is smaller than the largest shard of {url} ({largest} bytes): "
                "the cache must hold at least one whole shard"
            )
        self.cache_bytes = cache_bytes
        self.cache = ShardCache(folder, cache_bytes, timeout_s=timeout_s)
        # names this dataset's read counts in the cache folder: the loader's process (its
        # downloads ahead) sums what its workers read, to end each lease once its samples are read
        self._reads_key = f"{os.getpid()}-{os.urandom(6).hex()}"
        self._per_process()
        self._index_digest: str | None = None  # stoker_describe's, made at the first state

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        n = len(self.index)
        index = int(i)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {i} is out of range for a ShardedDataset of {n} samples")
        number, k = self.index.locate(index)
        try:
            sample = self._read(number, k)
        except OSError as exc:
            raise _naming(exc, f"sample {index}, shard {self.store.url_of(self.index.shards[number].name)}") from exc
        if self.decode == "auto":
            try:
                sample = decode_auto(sample, allow_pickle=self.allow_pickle)
            except ValueError as exc:
                shard = self.store.url_of(self.index.shards[number].name)
                raise ValueError(f"{exc} (in sample {index}, shard {shard})") from exc
        elif callable(self.decode):
            sample = self.decode(sample)
        if self.transform is not None:
            sample = self.transform(sample)
        return sample

    def _read(self, number: int, k: int) -> dict[str, Any]:
        shard = self.index.shards[number]
        if self.index.format == "parquet":
            for _ in range(8):  # evicted between finding the shard and opening it: fetch again
                path = self._fetch(number)
                try:
                    with self.cache.reading(shard.name):
                        group, row = shard.row_of(k)
                        sample = read_parquet_row(path, group, row)
                    self._counted().add(number)
                    return sample
                except FileNotFoundError:
                    continue
        else:
            start, end = shard.byte_range(k)
            opened = self._opened()
            for _ in range(8):
                fd = opened.fd(number)
                if fd is None:
                    continue
                data = os.pread(fd, end - start, start)
                if len(data) == end - start:
                    opened.touch(number, fd)
                    self._counted().add(number)
                    return read_tar_sample(data, shard=self.store.url_of(shard.name), sample=k)
                opened.forget(number)  # evicted under the read: the cache empties a shard first
        raise OSError(f"shard {shard.name} was evicted from the cache each time it was fetched: raise cache_bytes")

    def _per_process(self) -> None:
        """What each process makes for itself (again in a forked child; a worker never makes
        the downloads ahead)."""
        self._ahead: PerProcess[DownloadsAhead] = PerProcess(self._new_ahead, close=DownloadsAhead.close)
        self._open_shards: PerProcess[_OpenShards] = PerProcess(self._new_open_shards, close=_OpenShards.close)
        self._reads: PerProcess[Reads] = PerProcess(self._new_reads, close=Reads.close)

    def _new_ahead(self) -> DownloadsAhead:
        tally = Tally(self._reads_dir(), self._reads_key, len(self.index.shards))
        return DownloadsAhead(self.shard_starts, self._sizes, self._lease, self._unpin, tally, self.download_threads)

    def _new_open_shards(self) -> _OpenShards:
        return _OpenShards(self._fetch)

    def _new_reads(self) -> Reads:
        return Reads(self._reads_dir(), self._reads_key, len(self.index.shards))

    def _counted(self) -> Reads:
        reads = self._reads.get()
        if reads.counts is None and self._ahead.made_here:
            # made before this process's downloads ahead marked the folder: count from now
            self._reads.clear()
            reads = self._reads.get()
        return reads

    def _reads_dir(self) -> str:
        return os.path.join(self.cache.directory, "reads")

    def _opened(self) -> _OpenShards:
        return self._open_shards.get()

    def _fetcher(self, number: int) -> Callable[[BinaryIO], int]:
        shard = self.index.shards[number]
        size = int(shard.size)
        part = self.part_bytes
        if self.store.scheme == "file" or part is None or size <= 2 * part:
            return partial(self.store.download, shard.name, size=size)
        return partial(download_parts, self.store.read, shard.name, size, part, self.download_threads)

    def _fetch(self, number: int) -> str:
        shard = self.index.shards[number]
        return self.cache.get(shard.name, int(shard.size), shard.sha256, self._fetcher(number))

    def _lease(self, number: int, decided: Callable[[bool], None] | None = None) -> bool:
        """Pin shard `number` for a batch that will read it (downloading it first), if the
        cache's leases leave room for the largest shard: a reader that needs a shard nobody
        leased then always finds room."""
        shard = self.index.shards[number]
        return self.cache.lease(
            shard.name, int(shard.size), shard.sha256, self._fetcher(number), max(self._sizes), decided
        )

    def _unpin(self, number: int) -> None:
        self.cache.unpin(self.index.shards[number].name)

    # ------------------------------------------------------------------ the look-ahead hook
    def stoker_upcoming(self, indices: list[int], behind: int) -> bool:
        """The look-ahead hook: a batch the loader's sampler just drew, ahead of its dispatch.

        Called in the loader's process, once per batch in the order drawn. The shards the
        batch needs are downloaded (a few at a time, in the order needed); the drawing goes
        on ahead while this batch and the `behind` batches drawn before it, which may still
        be unread, need fewer than `prefetch_shards` shards beyond the oldest one's, and fill
        at most half the cache.

        Args:
            indices: The batch's sample indices.
            behind: How many earlier batches may still be unread by the workers.

        Returns:
            True when the downloads would run further ahead: the loader then draws the next
            batch at once.
        """
        return self._ahead.get().drawn(indices, behind, self.prefetch_shards, self.cache_bytes)

    def close(self) -> None:
        """Stop the downloads ahead and close the shards this process has open (the cache's
        files stay)."""
        self._ahead.clear()
        self._open_shards.clear()
        self._reads.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_ahead", "_open_shards", "_reads"):  # each process makes its own
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._per_process()

    def stoker_describe(self) -> dict[str, Any]:
        """What a loader state saved over this dataset must agree on: the index's identity
        (a digest of each shard's size, sha256 and sample count, in order: the same data at
        another URL, or cached elsewhere, is the same stream) and the names of `decode` and
        `transform` (their code is not compared). The store, cache and download arguments
        change no sample and are not recorded."""
        if self._index_digest is None:
            shards = [[s.size, s.sha256, s.samples] for s in self.index.shards]
            text = json.dumps([self.index.format, shards], separators=(",", ":"))
            self._index_digest = hashlib.sha256(text.encode()).hexdigest()[:32]
        return {
            "type": "ShardedDataset",
            "samples": len(self.index),
            "shards": len(self.index.shards),
            "format": self.index.format,
            "index_digest": self._index_digest,
            "decode": callable_name(self.decode),
            "transform": callable_name(self.transform),
        }

    def __repr__(self) -> str:
        return f"ShardedDataset({self.url!r}, {len(self.index)} samples in {len(self.index.shards)} shards)"


class _OpenShards:
    """The shard files one process has open, most recently read last.

    Reads are `pread`s on a descriptor kept open, without a lock: the cache empties a shard's
    file before it unlinks it, so a read of an evicted shard comes back short, and the shard
    is then fetched again. Reading touches the shard for the cache's LRU, at most every
    `TOUCH_S` seconds."""

    MOST = 32
    TOUCH_S = 0.5

    def __init__(self, fetch: Callable[[int], str]) -> None:
        self.fetch = fetch  # shard number -> the path of its file in the cache, fetched if absent
        self.open: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()  # number -> [fd, touched]
        # the descriptors are closed with this object, in this process only: a forked child's
        # copy forgets them (the holder never closes a parent's value)
        self._closer = finalize(self, _close_all, self.open)

    def fd(self, number: int) -> int | None:
        held = self.open.get(number)
        if held is not None:
            self.open.move_to_end(number)
            return int(held[0])
        path = self.fetch(number)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # evicted since the fetch
            return None
        self.open[number] = [fd, time.monotonic()]
        while len(self.open) > self.MOST:
            _, (old, _) = self.open.popitem(last=False)
            os.close(old)
        return fd

    def touch(self, number: int, fd: int) -> None:
        held = self.open[number]
        now = time.monotonic()
        if now - held[1] >= self.TOUCH_S:
            held[1] = now
            try:
                os.utime(fd)
            except OSError:
                pass

    def forget(self, number: int) -> None:
        held = self.open.pop(number, None)
        if held is not None:
            os.close(held[0])

    def close(self) -> None:
        self._closer()


def _close_all(open_files: collections.OrderedDict[int, list[Any]]) -> None:
    while open_files:
        try:
            os.close(open_files.popitem()[1][0])
        except OSError:
            pass


def _naming(exc: OSError, where: str) -> OSError:
    """`exc` again, of its own type, its message followed by which sample needed it."""
    note = f" (needed by {where})"
    if isinstance(exc, (StoreError, MissingObjectError, AccessDeniedError)):
        return type(exc)(exc.url, exc.reason + note)
    try:
        named = type(exc).__new__(type(exc))
        named.__dict__.update(exc.__dict__)
        named.args = (f"{exc}{note}",)
    except Exception:
        return exc
    return named
