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
pid), so a worker forked or spawned from the loader's process makes its own. One `Store` may
be used by several threads at once.
"""

from __future__ import annotations

import os
import random
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, BinaryIO, TypeVar

T = TypeVar("T")

# How much of an object is held in memory at once while it is downloaded.
CHUNK_BYTES = 8 << 20
# The longest wait between two attempts, whatever `backoff_s` and the attempt number say.
MAX_BACKOFF_S = 20.0
OBSTORE_SCHEMES = frozenset({"s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "http", "https"})
# fsspec-style storage options (as s3fs takes them) and the obstore S3 config key each means.
S3_OPTION_KEYS = {
    "endpoint_url": "endpoint",
    "endpoint": "endpoint",
    "key": "access_key_id",
    "aws_access_key_id": "access_key_id",
    "access_key_id": "access_key_id",
    "secret": "secret_access_key",
    "aws_secret_access_key": "secret_access_key",
    "secret_access_key": "secret_access_key",
    "token": "session_token",
    "aws_session_token": "session_token",
    "session_token": "session_token",
    "region": "region",
    "region_name": "region",
    "anon": "skip_signature",
    "skip_signature": "skip_signature",
}


class StoreError(OSError):
    """A request to the store failed after its retries; the message names the URL.

    Args:
        url: The object's (or prefix's) URL.
        reason: What went wrong, last cause included.
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


class MissingObjectError(FileNotFoundError):
    """The object is not in the store; the message names its URL.

    Args:
        url: The object's URL.
        reason: What the store said. Defaults to "no such object".
    """

    def __init__(self, url: str, reason: str = "no such object") -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url


class AccessDeniedError(PermissionError):
    """The store refused access to the object; the message names its URL.

    Args:
        url: The object's URL.
        reason: What the store said. Defaults to "access denied".
    """

    def __init__(self, url: str, reason: str = "access denied") -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url


@dataclass
class Counters:
    """What a `Store` asked of its server in this process.

    Args:
        requests: Requests made, each retry and each chunk of a download included.
            Defaults to 0.
        bytes: Bytes received (of object data). Defaults to 0.
        retries: Attempts made after a transient failure. Defaults to 0.
    """

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, requests: int = 0, nbytes: int = 0, retries: int = 0) -> None:
        """Add to the counts (thread safe).

        Args:
            requests: Requests to add. Defaults to 0.
            nbytes: Bytes to add. Defaults to 0.
            retries: Retries to add. Defaults to 0.
        """
        with self.lock:
            self.requests += requests
            self.bytes += nbytes
            self.retries += retries

    def __getstate__(self) -> dict[str, int]:
        return {"requests": self.requests, "bytes": self.bytes, "retries": self.retries}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()


def split_url(url: str) -> tuple[str, str]:
    """Split a prefix URL into its scheme and the rest.

    Args:
        url: `scheme://...`, `file:///path` or a plain local path.

    Returns:
        tuple: (scheme, rest): for a local path ("file", its absolute path), else (scheme,
        the whole URL).

    Raises:
        ValueError: when `url` is not a non-empty string.
    """
    if not isinstance(url, str) or not url:
        raise ValueError(
            f"url should be a non-empty string such as 's3://bucket/prefix' or a path, "
            f"but got url={url!r}"
        )
    parsed = urllib.parse.urlsplit(url)
    if len(parsed.scheme) <= 1:  # a plain path (or a Windows drive letter)
        return "file", os.path.abspath(url)
    if parsed.scheme == "file":
        return "file", urllib.parse.unquote(parsed.path)
    return parsed.scheme, url


class _Transient(Exception):
    """A failure worth another attempt (raised by the backends for a short body)."""


class _RangeNotSatisfiable(Exception):
    """The store answered 416: the range starts at or past the object's end."""


class _SizeMismatch(Exception):
    """The object is not the size the caller expected: not worth another attempt."""


# The pid of the process whose obstore runtime has made requests. obstore's runtime does not
# survive fork: a child forked from that process hangs in its first request, so such a child
# uses fsspec instead (a process forked before the first request, or spawned, is fine).
_obstore_used_in: int | None = None


def _obstore_usable() -> bool:
    return _obstore_used_in is None or _obstore_used_in == os.getpid()


def _obstore_installed() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def _classify(exc: BaseException) -> str:
    """What a client's exception means: "missing", "denied", "transient" or "fatal"."""
    if isinstance(exc, (MissingObjectError, FileNotFoundError)):
        return "missing"
    if isinstance(exc, PermissionError):
        return "denied"
    if isinstance(exc, (_Transient, TimeoutError, ConnectionError)):
        return "transient"
    fatal = (_SizeMismatch, _RangeNotSatisfiable, IsADirectoryError, NotADirectoryError)
    if isinstance(exc, (*fatal, FileExistsError)):
        return "fatal"
    module = type(exc).__module__ or ""
    name = type(exc).__name__
    if module.startswith("obstore"):
        if name in ("PermissionDeniedError", "UnauthenticatedError"):
            return "denied"
        if name == "NotFoundError":
            return "missing"
        if name == "GenericError":
            return "transient" if _transient_text(str(exc)) else "fatal"
        return "fatal"
    if isinstance(exc, OSError):
        return "transient"  # s3fs turns 5xx answers (InternalError, SlowDown) into OSError
    if module.startswith(("aiohttp", "botocore", "aiobotocore", "urllib3", "http.client")):
        settled = ("ParamValidationError", "InvalidRegionError", "UnknownServiceError")
        return "fatal" if name in settled or "Credential" in name else "transient"
    if name in ("IncompleteRead", "ClientPayloadError", "ReadTimeoutError"):
        return "transient"
    return "fatal"


def _transient_text(text: str) -> bool:
    """Whether an obstore GenericError's message describes a transient failure."""
    text = text.lower()
    if "status: 4" in text or "client error (4" in text or "code: 4" in text:
        return "429" in text or "slowdown" in text or "status: 408" in text
    signs = (
        "server error",
        "status: 5",
        "slowdown",
        "timeout",
        "timed out",
        "connection",
        "reset",
        "broken pipe",
        "error sending request",
        "error decoding response body",
        "incomplete",
        "body",
        "eof",
        "http error",
        "retry",
    )
    return any(sign in text for sign in signs)


class Store:
    """Objects under one prefix URL, read and written by name (a path relative to it).

    Args:
        url: The prefix: `s3://bucket/path`, `gs://...`, `hf://...`, `https://...`,
            `file:///path` or a plain local path.
        storage_options: Passed to the client, e.g. `{"endpoint_url": ...}`. For s3 the
            fsspec-style keys (`endpoint_url`, `key`, `secret`, `token`, `region_name`,
            `anon`) are understood by both clients; "auto" uses fsspec when there are any
            others. None means the client's defaults and the environment
            (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...). Defaults to None.
        client: "auto" (obstore where it is installed and serves the scheme, else fsspec;
            local paths are read directly with `os`), "obstore" or "fsspec" (which serve
            local paths too). Defaults to "auto".
        retries: How many times a transient failure is retried. Defaults to 6.
        backoff_s: The first retry's wait (times a random factor in [0.5, 1.5]); each next
            one doubles it. Defaults to 0.1.
        timeout_s: A request that has sent nothing for this long is abandoned and retried.
            Defaults to 30.0.

    Raises:
        ValueError: when `url` is not a non-empty string, `client` is not one of the three,
            or `retries`, `backoff_s` or `timeout_s` is negative (or `timeout_s` is 0).
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
        if client not in ("auto", "obstore", "fsspec"):
            raise ValueError(
                f"client should be 'auto', 'obstore' or 'fsspec', but got client={client!r}"
            )
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries should be an int >= 0, but got retries={retries!r}")
        if backoff_s < 0:
            raise ValueError(f"backoff_s should be >= 0, but got backoff_s={backoff_s!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s should be > 0, but got timeout_s={timeout_s!r}")
        self.client = client
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.counters = Counters()
        self._lock = threading.Lock()
        self._client: tuple[int, _Backend] | None = None

    @property
    def backend(self) -> str:
        """Which client serves this store: "local", "obstore" or "fsspec"."""
        if self.client != "auto":
            return self.client
        if self.scheme == "file":
            return "local"
        if self.scheme in OBSTORE_SCHEMES and _obstore_usable() and _obstore_installed():
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

    def _backend(self) -> _Backend:
        """This process's client, made on first use (and again in a forked child)."""
        made = self._client
        pid = os.getpid()
        if made is not None and made[0] == pid:
            return made[1]
        with self._lock:
            made = self._client
            if made is None or made[0] != pid:
                kind = self.backend
                backend: _Backend
                if kind == "local":
                    backend = _LocalBackend(self)
                elif kind == "obstore":
                    if not _obstore_usable():
                        raise StoreError(
                            self.url,
                            "client='obstore' cannot run in a process forked from one that used "
                            "obstore (its runtime does not survive fork): use client='auto' or "
                            "'fsspec', or start worker processes with 'spawn' or 'forkserver'",
                        )
                    backend = _ObstoreBackend(self)
                else:
                    backend = _FsspecBackend(self)
                made = self._client = (pid, backend)
        return made[1]

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
                kind = _classify(exc)
                local = self.scheme == "file" and not isinstance(exc, _Transient)
                if kind == "transient" and local:
                    kind = "fatal"  # a local disk's errors do not go away by asking again
                if isinstance(exc, (MissingObjectError, AccessDeniedError, StoreError)):
                    raise
                if kind == "missing":
                    raise MissingObjectError(url) from exc
                if kind == "denied":
                    raise AccessDeniedError(url, f"access denied ({_describe(exc)})") from exc
                if kind == "fatal":
                    raise StoreError(url, _describe(exc)) from exc
                last = exc
        assert last is not None
        attempts = f"failed {self.retries + 1} times (retries={self.retries})"
        raise StoreError(url, f"{attempts}; last: {_describe(last)}") from last

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
            except _RangeNotSatisfiable:
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
                raise _Transient(f"got {written} bytes, expected {size}")
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
        state["_client"] = None
        state["_lock"] = None
        state["counters"] = Counters()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, client={self.client!r})"


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    if len(text) > 600:
        text = text[:600] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _check_range(url: str, got: int, start: int, end: int | None, size: int) -> None:
    """Raise _Transient when a read of [start, end) returned other than what the object
    holds there."""
    want = max(0, (size if end is None else min(end, size)) - start)
    if got != want:
        raise _Transient(f"{url}: body of {got} bytes where {want} were expected")


def _check_size(url: str, actual: int, expected: int | None) -> None:
    if expected is not None and actual != expected:
        raise _SizeMismatch(f"{url} is {actual} bytes, but {expected} were expected")


class _Backend:
    """One client's requests; each method is one attempt (the Store retries)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.counters = store.counters

    def read(self, name: str, start: int | None, end: int | None) -> bytes:
        raise NotImplementedError

    def download(self, name: str, out: BinaryIO, size: int | None) -> int:
        raise NotImplementedError

    def write(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def size(self, name: str) -> int:
        raise NotImplementedError

    def list(self) -> list[str]:
        raise NotImplementedError


class _LocalBackend(_Backend):
    def _path(self, name: str) -> str:
        return os.path.join(self.store._root, name)

    def read(self, name: str, start: int | None, end: int | None) -> bytes:
        self.counters.add(requests=1)
        with open(self._path(name), "rb") as f:
            if start:
                f.seek(start)
            data = f.read() if end is None else f.read(end - (start or 0))
        self.counters.add(nbytes=len(data))
        return data

    def download(self, name: str, out: BinaryIO, size: int | None) -> int:
        self.counters.add(requests=1)
        written = 0
        with open(self._path(name), "rb") as f:
            _check_size(self.store.url_of(name), os.fstat(f.fileno()).st_size, size)
            while True:
                chunk = f.read(CHUNK_BYTES)
                if not chunk:
                    break
                out.write(chunk)
                written += len(chunk)
                self.counters.add(nbytes=len(chunk))
        return written

    def write(self, name: str, data: bytes) -> None:
        self.counters.add(requests=1)
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.partial-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(partial, "wb") as f:
                f.write(data)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)

    def size(self, name: str) -> int:
        self.counters.add(requests=1)
        return os.path.getsize(self._path(name))

    def list(self) -> list[str]:
        self.counters.add(requests=1)
        root = self.store._root
        if not os.path.isdir(root):
            return []
        found = []
        for folder, _, files in os.walk(root):
            for file in files:
                found.append(os.path.relpath(os.path.join(folder, file), root))
        return found


class _ObstoreBackend(_Backend):
    def __init__(self, store: Store) -> None:
        super().__init__(store)
        import obstore.store

        global _obstore_used_in
        _obstore_used_in = os.getpid()
        self.client: Any
        timeout = timedelta(seconds=store.timeout_s)
        client_options: dict[str, Any] = {
            "connect_timeout": timeout,
            "read_timeout": timeout,
            # the overall limit defaults to 30 s: a large object on a slow link must not hit it
            "timeout": timedelta(days=1),
        }
        retry_config: Any = {"max_retries": 0}
        parsed = urllib.parse.urlsplit(store.url)
        options = dict(store.storage_options)
        if store.scheme == "file":
            os.makedirs(store._root, exist_ok=True)
            self.client = obstore.store.LocalStore(store._root)
        elif store.scheme in ("s3", "s3a"):
            config: dict[str, Any] = {}
            for key, value in options.items():
                config[S3_OPTION_KEYS.get(key, key)] = value
            endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL") or ""
            if str(endpoint).startswith("http://"):
                client_options["allow_http"] = True
            if "skip_signature" in config:
                config["skip_signature"] = bool(config["skip_signature"])
            self.client = obstore.store.S3Store(
                parsed.netloc,
                prefix=parsed.path.strip("/") or None,
                config=config,  # type: ignore[arg-type]
                client_options=client_options,  # type: ignore[arg-type]
                retry_config=retry_config,
            )
        else:
            from_url: Any = obstore.store.from_url
            self.client = from_url(
                store.url, client_options=client_options, retry_config=retry_config, **options
            )

    def read(self, name: str, start: int | None, end: int | None) -> bytes:
        import obstore

        self.counters.add(requests=1)
        if start is None and end is None:
            result = obstore.get(self.client, name)
        else:
            begin = start or 0
            wanted: Any = {"offset": begin} if end is None else (begin, end)
            try:
                result = obstore.get(self.client, name, options={"range": wanted})
            except Exception as exc:
                if "416" in str(exc) or "range was invalid" in str(exc).lower():
                    raise _RangeNotSatisfiable(str(exc)) from exc
                raise
        data = bytes(result.bytes())
        self.counters.add(nbytes=len(data))
        _check_range(self.store.url_of(name), len(data), start or 0, end, result.meta["size"])
        return data

    def download(self, name: str, out: BinaryIO, size: int | None) -> int:
        import obstore

        self.counters.add(requests=1)
        result = obstore.get(self.client, name)
        expected = result.meta["size"]
        _check_size(self.store.url_of(name), expected, size)
        written = 0
        for chunk in result.stream(min_chunk_size=CHUNK_BYTES):
            out.write(memoryview(chunk))
            written += len(chunk)
            self.counters.add(nbytes=len(chunk))
        _check_range(self.store.url_of(name), written, 0, None, expected)
        return written

    def write(self, name: str, data: bytes) -> None:
        import obstore

        self.counters.add(requests=1)
        obstore.put(self.client, name, data)

    def size(self, name: str) -> int:
        import obstore

        self.counters.add(requests=1)
        return int(obstore.head(self.client, name)["size"])

    def list(self) -> list[str]:
        import obstore

        names: list[str] = []
        for batch in obstore.list(self.client):
            self.counters.add(requests=1)
            names.extend(meta["path"] for meta in batch)
        return names


class _FsspecBackend(_Backend):
    def __init__(self, store: Store) -> None:
        super().__init__(store)
        import fsspec  # type: ignore[import-untyped]

        options = dict(store.storage_options)
        if store.scheme in ("s3", "s3a"):
            client_kwargs = dict(options.pop("client_kwargs", {}) or {})
            for key in ("endpoint_url", "endpoint"):
                if key in options:
                    client_kwargs["endpoint_url"] = options.pop(key)
            for key in ("region", "region_name"):
                if key in options:
                    client_kwargs["region_name"] = options.pop(key)
            for ours, theirs in (
                ("aws_access_key_id", "key"),
                ("access_key_id", "key"),
                ("aws_secret_access_key", "secret"),
                ("secret_access_key", "secret"),
                ("aws_session_token", "token"),
                ("session_token", "token"),
                ("skip_signature", "anon"),
            ):
                if ours in options:
                    options[theirs] = options.pop(ours)
            config = dict(options.pop("config_kwargs", {}) or {})
            config.setdefault("connect_timeout", store.timeout_s)
            config.setdefault("read_timeout", store.timeout_s)
            config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
            options["client_kwargs"] = client_kwargs
            options["config_kwargs"] = config
            options.setdefault("use_listings_cache", False)
        self.fs: Any = fsspec.filesystem(store.scheme, skip_instance_cache=True, **options)
        # s3fs retries on its own, and reads a whole object as a HEAD and then several
        # ranges at once: one attempt is one request here, counted and retried by the Store
        self.cat_options: dict[str, Any] = {}
        if store.scheme in ("s3", "s3a"):
            self.fs.retries = 1
            self.cat_options["max_concurrency"] = 1
        self.root = self.fs._strip_protocol(store.url).rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read(self, name: str, start: int | None, end: int | None) -> bytes:
        self.counters.add(requests=1)
        try:
            data = self.fs.cat_file(self._path(name), start=start, end=end, **self.cat_options)
        except OSError as exc:
            text = str(exc).lower()
            if start and ("416" in text or "range is not satisfiable" in text):
                raise _RangeNotSatisfiable(str(exc)) from exc
            raise
        self.counters.add(nbytes=len(data))
        if start is not None or end is not None:
            wanted = (end if end is not None else 0) - (start or 0)
            if end is None or len(data) != wanted:
                # fewer bytes than asked for: the object's end, or a body cut short?
                _check_range(self.store.url_of(name), len(data), start or 0, end, self.size(name))
        return bytes(data)

    def download(self, name: str, out: BinaryIO, size: int | None) -> int:
        total = self.size(name)
        _check_size(self.store.url_of(name), total, size)
        path = self._path(name)
        written = 0
        while written < total:
            end = min(total, written + CHUNK_BYTES)
            self.counters.add(requests=1)
            chunk = self.fs.cat_file(path, start=written, end=end, **self.cat_options)
            self.counters.add(nbytes=len(chunk))
            if len(chunk) != end - written:
                raise _Transient(
                    f"{self.store.url_of(name)}: body of {len(chunk)} bytes where "
                    f"{end - written} were expected at offset {written}"
                )
            out.write(chunk)
            written = end
        return written

    def write(self, name: str, data: bytes) -> None:
        self.counters.add(requests=1)
        path = self._path(name)
        parent = path.rsplit("/", 1)[0]
        if getattr(self.fs, "protocol", None) in ("file", ("file", "local")):
            self.fs.makedirs(parent, exist_ok=True)
        self.fs.pipe_file(path, data)

    def size(self, name: str) -> int:
        self.counters.add(requests=1)
        if self.store.scheme in ("s3", "s3a"):
            # one HEAD: s3fs's info() follows a 404 with a listing (is it a directory?)
            bucket, key, _ = self.fs.split_path(self._path(name))
            return int(self.fs.call_s3("head_object", Bucket=bucket, Key=key)["ContentLength"])
        return int(self.fs.size(self._path(name)))

    def list(self) -> list[str]:
        self.counters.add(requests=1)
        found = self.fs.find(self.root)
        prefix = self.root + "/"
        return [path[len(prefix) :] for path in found if path.startswith(prefix)]
