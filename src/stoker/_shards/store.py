"""Where shards live: one prefix URL (`s3://bucket/data`, `file:///mnt/data`, a plain path,
`gs://`, `hf://`, `https://`), read and written by name through one small client layer.

`Store` is the only thing in stoker that talks to object storage. It retries what a store
answers transiently (5xx, SlowDown, a connection reset, a body cut short, a request that
hangs past its timeout) with exponential backoff and jitter, and turns everything else into
an error that names the object's URL: `MissingObjectError` (FileNotFoundError),
`AccessDeniedError` (PermissionError), `StoreError` (OSError) once the retries are spent.

Two clients serve remote URLs: obstore (Rust; s3, gs, az, http and https) and fsspec (s3fs
for s3, and any scheme fsspec knows). "auto" picks obstore where it is installed and serves
the scheme: read from a loopback S3 server, it was the faster of the two. Local paths are
read with `os`. Both clients are imported only when a remote `Store` is first used, and their
own retries are turned off so that each attempt is counted and bounded here.

A `Store` is cheap to pickle: its client is made on first use in each process (keyed by the
pid), so a worker forked or spawned from the loader's process makes its own. obstore's runtime
does not survive fork, so a process forked from one that has used obstore sends its requests
to that process instead (`relay`): the same client serves every process, on any start method,
with the `stream` extra alone. One `Store` may be used by several threads at once.
"""

from __future__ import annotations

import os
import random
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO, TypeVar

from .._base.checks import check_choice, check_int, check_number, fail
from .._base.process import PerProcess
from . import relay
from .clients import (
    OBSTORE_SCHEMES,
    S3_OPTION_KEYS,
    Backend,
    Counters,
    FsspecBackend,
    LocalBackend,
    ObstoreBackend,
    Prefix,
    classify,
    describe,
    obstore_installed,
    obstore_usable,
)
from .errors import (
    AccessDeniedError,
    MissingObjectError,
    RangeNotSatisfiable,
    StoreError,
    Transient,
)

T = TypeVar("T")

# The longest wait between two attempts, whatever `backoff_s` and the attempt number say.
MAX_BACKOFF_S = 20.0


def split_url(url: str) -> tuple[str, str]:
    """Split a prefix URL into its scheme and the rest.

    Args:
        url: `scheme://...`, `file:///path` or a plain local path.

    Returns:
        tuple: (scheme, rest): for a local path ("file", its absolute path), else (scheme,
        the whole URL).

    Raises:
        TypeError: when `url` is not a string.
        ValueError: when `url` is empty.
    """
    if not isinstance(url, str) or not url:
        fail(
            ValueError if isinstance(url, str) else TypeError,
            "url",
            "a non-empty string such as 's3://bucket/prefix' or a path",
            url,
        )
    parsed = urllib.parse.urlsplit(url)
    if len(parsed.scheme) <= 1:  # a plain path (or a Windows drive letter)
        return "file", os.path.abspath(url)
    if parsed.scheme == "file":
        return "file", urllib.parse.unquote(parsed.path)
    return parsed.scheme, url


class Store:
    """Objects under one prefix URL, read and written by name (a path relative to it).

    Args:
        url: The prefix: `s3://bucket/path`, `gs://...`, `hf://...`, `https://...`,
            `file:///path` or a plain local path.
        storage_options: Passed to the client, e.g. `{"endpoint_url": ...}`. For s3 the
            fsspec-style keys (`endpoint_url`, `key`, `secret`, `token`, `region_name`,
            `anon`) are understood by both clients; "auto" uses fsspec when there are any
            others. An option given here takes precedence over the environment's
            (`AWS_ENDPOINT_URL_S3` and `AWS_ENDPOINT_URL` included). None means the client's
            defaults and the environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...).
            Defaults to None.
        client: "auto" (obstore where it is installed and serves the scheme, else fsspec;
            local paths are read directly with `os`), "obstore" or "fsspec" (which serve
            local paths too). Defaults to "auto".
        retries: How many times a transient failure is retried. Defaults to 6.
        backoff_s: The first retry's wait (times a random factor in [0.5, 1.5]); each next
            one doubles it. Defaults to 0.1.
        timeout_s: A request that has sent nothing for this long is abandoned and retried.
            Defaults to 30.0.

    Raises:
        TypeError: when `url` is not a string, or `retries`, `backoff_s` or `timeout_s` is
            not a number (an int, for `retries`).
        ValueError: when `url` is empty, `client` is not one of the three, or `retries`,
            `backoff_s` or `timeout_s` is negative (or `timeout_s` is 0).
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        client: str = "auto",
        retries: int = 6,
        backoff_s: float = 0.1,
        timeout_s: float = 30.0,
    ) -> None:
        self.scheme, self._root = split_url(url)
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        check_choice("client", client, ("auto", "obstore", "fsspec"))
        check_int("retries", retries, low=0)
        check_number("backoff_s", backoff_s, low=0, unit="seconds")
        check_number("timeout_s", timeout_s, above=0, unit="seconds")
        self.client = client
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.counters = Counters()
        self._client: PerProcess[Backend] = PerProcess(self._make_backend)

    @property
    def backend(self) -> str:
        """Which client serves this store: "local", "obstore" or "fsspec"."""
        if self.client != "auto":
            return self.client
        if self.scheme == "file":
            return "local"
        reachable = obstore_usable() or relay.available()
        if self.scheme in OBSTORE_SCHEMES and reachable and obstore_installed():
            if self.scheme in ("s3", "s3a"):
                if set(self.storage_options) <= set(S3_OPTION_KEYS):
                    return "obstore"
            elif not self.storage_options:
                return "obstore"
        return "fsspec"

    def url_of(self, name: str) -> str:
        """The URL of an object under the prefix.

        Args:
            name: The object's name, relative to the prefix.

        Returns:
            str: `<prefix>/<name>`.
        """
        return f"{self.url}/{name}"

    def _backend(self) -> Backend:
        """This process's client, made on first use (and again in a forked child)."""
        return self._client.get()

    def _make_backend(self) -> Backend:
        kind = self.backend
        prefix = Prefix(self.url, self.scheme, self._root, self.storage_options, self.timeout_s)
        if kind == "local":
            return LocalBackend(prefix, self.counters)
        if kind == "obstore":
            if obstore_usable():
                relay.become_owner(Store)  # before the runtime starts: see `relay`
                return ObstoreBackend(prefix, self.counters)
            if relay.available():
                return relay.RelayBackend(prefix, self.counters)
            raise StoreError(
                self.url,
                "client='obstore' cannot run in a process forked from one that used "
                "obstore (its runtime does not survive fork), and this platform has "
                "no relay to that process: use client='fsspec', or start worker "
                "processes with 'spawn' or 'forkserver'",
            )
        return FsspecBackend(prefix, self.counters)

    def _attempt(self, url: str, op: Callable[[], T]) -> T:
        """Run `op` until it succeeds, retrying transient failures with backoff."""
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.counters.add(retries=1)
                wait = self.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
                time.sleep(min(wait, MAX_BACKOFF_S))
            try:
                return op()
            except Exception as exc:
                kind = classify(exc)
                local = self.scheme == "file" and not isinstance(exc, Transient)
                if kind == "transient" and local:
                    kind = "fatal"  # a local disk's errors do not go away by asking again
                if isinstance(exc, (MissingObjectError, AccessDeniedError, StoreError)):
                    raise
                if kind == "missing":
                    raise MissingObjectError(url) from exc
                if kind == "denied":
                    raise AccessDeniedError(url, f"access denied ({describe(exc)})") from exc
                if kind == "fatal":
                    raise StoreError(url, describe(exc)) from exc
                last = exc
        assert last is not None
        attempts = f"failed {self.retries + 1} times (retries={self.retries})"
        raise StoreError(url, f"{attempts}; last: {describe(last)}") from last

    # The methods below are the whole interface the rest of stoker uses.
    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read an object, or the bytes [start, end) of it.

        Args:
            name: The object's name, relative to the prefix.
            start: The first byte; None means 0. Defaults to None.
            end: One past the last byte (clipped to the object's size); None means the end
                of the object. Defaults to None.

        Returns:
            bytes: The bytes read: never fewer than the object holds in that range (a body
            cut short is retried).

        Raises:
            ValueError: when `start` or `end` is negative, or `end` < `start`.
            MissingObjectError: when the object does not exist.
            AccessDeniedError: when the store refuses access.
            StoreError: when every attempt failed.
        """
        if (start is not None and start < 0) or (end is not None and end < 0):
            raise ValueError(f"start and end should be >= 0, but got start={start}, end={end}")
        if start is not None and end is not None and end < start:
            raise ValueError(f"end should be >= start, but got start={start}, end={end}")
        if end is not None and end == (start or 0):
            return b""
        backend = self._backend()

        def attempt() -> bytes:
            try:
                return backend.read(name, start, end)
            except RangeNotSatisfiable:
                if (start or 0) >= backend.size(name):
                    return b""  # as a file read past its end
                raise

        return self._attempt(self.url_of(name), attempt)

    def download(self, name: str, out: BinaryIO, size: int | None = None) -> int:
        """Write a whole object into an open file, in chunks, from the file's position.

        A failed attempt's bytes are cut off (the file is truncated back to where it started)
        before the next attempt.

        Args:
            name: The object's name, relative to the prefix.
            out: A binary file open for writing, seekable and truncatable.
            size: The object's expected size in bytes; a download of any other length is a
                failure (retried). None means the size the store reports. Defaults to None.

        Returns:
            int: The bytes written.

        Raises:
            MissingObjectError: when the object does not exist.
            AccessDeniedError: when the store refuses access.
            StoreError: when every attempt failed.
        """
        backend = self._backend()
        begin = out.tell()

        def attempt() -> int:
            out.seek(begin)
            out.truncate()
            written = backend.download(name, out, size)
            if size is not None and written != size:
                raise Transient(f"got {written} bytes, expected {size}")
            return written

        return self._attempt(self.url_of(name), attempt)

    def write(self, name: str, data: bytes) -> None:
        """Make an object hold `data` (whole: a reader never sees part of it).

        Args:
            name: The object's name, relative to the prefix.
            data: Its contents.

        Raises:
            AccessDeniedError: when the store refuses access.
            StoreError: when every attempt failed.
        """
        backend = self._backend()
        self._attempt(self.url_of(name), lambda: backend.write(name, data))

    def size(self, name: str) -> int:
        """The size of an object.

        Args:
            name: The object's name, relative to the prefix.

        Returns:
            int: Its size in bytes.

        Raises:
            MissingObjectError: when the object does not exist.
            AccessDeniedError: when the store refuses access.
            StoreError: when every attempt failed.
        """
        backend = self._backend()
        return self._attempt(self.url_of(name), lambda: backend.size(name))

    def list(self) -> list[str]:
        """The names of every object under the prefix (a listing: used only by the one-time
        scan, never at a loader's start).

        Returns:
            list: The names, relative to the prefix, sorted.

        Raises:
            AccessDeniedError: when the store refuses the listing.
            StoreError: when every attempt failed.
        """
        backend = self._backend()
        try:
            return sorted(self._attempt(self.url, backend.list))
        except MissingObjectError:
            return []

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None  # each process makes its own
        state["counters"] = Counters()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = PerProcess(self._make_backend)

    def __repr__(self) -> str:
        return f"Store({self.url!r}, client={self.client!r})"
