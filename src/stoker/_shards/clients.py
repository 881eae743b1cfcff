"""The clients behind `Store`: one attempt of each request, by obstore (Rust; s3, gs, az, http
and https), fsspec (s3fs for s3, and any scheme fsspec knows) or `os` for local paths, and
what each client's exceptions mean (`classify`: missing, denied, transient or fatal).

Nothing here retries: `Store` does, so that each attempt is counted and bounded in one place.
A backend is given what it uses, the prefix (`Prefix`) and where to count (`Counters`), not
the `Store`. Both remote clients are imported only when a backend is made, and their own
retries are off.
"""

from __future__ import annotations

import os
import re
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, BinaryIO

from .errors import (
    MissingObjectError,
    OwnerGone,
    RangeNotSatisfiable,
    Relayed,
    SizeMismatch,
    Transient,
)

# How much of an object is held in memory at once while it is downloaded.
CHUNK_BYTES = 8 << 20
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


# An answer 416, as the clients word it. Not a bare "416": obstore's messages carry the
# request's duration ("in 374.416µs"), which a 500 was once taken for.
_RANGE_NOT_SATISFIABLE = re.compile(
    r"status(?: code)?:? 416\b|\b416 range not satisfiable|invalidrange|range was invalid|range is not satisfiable",
    re.IGNORECASE,
)


# The pid of the process whose obstore runtime has made requests. obstore's runtime does not
# survive fork: a child forked from that process hangs in its first request, whatever client it
# makes, so such a child asks that process to make its requests (`relay`). A process forked
# before the first request, or spawned, makes its own.
_obstore_used_in: int | None = None


def obstore_usable() -> bool:
    return _obstore_used_in is None or _obstore_used_in == os.getpid()


def obstore_installed() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def classify(exc: BaseException) -> str:
    """What a client's exception means: "missing", "denied", "transient" or "fatal"."""
    if isinstance(exc, Relayed):
        return exc.kind
    if isinstance(exc, OwnerGone):
        return "fatal"
    if isinstance(exc, (MissingObjectError, FileNotFoundError)):
        return "missing"
    if isinstance(exc, PermissionError):
        return "denied"
    if isinstance(exc, (Transient, TimeoutError, ConnectionError)):
        return "transient"
    fatal = (SizeMismatch, RangeNotSatisfiable, IsADirectoryError, NotADirectoryError)
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


def describe(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    if isinstance(exc, Relayed):
        return text  # already "Type: message", as described where it was raised
    if len(text) > 600:
        text = text[:600] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_range(url: str, got: int, start: int, end: int | None, size: int) -> None:
    """Raise Transient when a read of [start, end) returned other than what the object
    holds there."""
    want = max(0, (size if end is None else min(end, size)) - start)
    if got != want:
        raise Transient(f"{url}: body of {got} bytes where {want} were expected")


def check_size(url: str, actual: int, expected: int | None) -> None:
    if expected is not None and actual != expected:
        raise SizeMismatch(f"{url} is {actual} bytes, but {expected} were expected")


@dataclass(frozen=True)
class Prefix:
    """What a backend is told of its `Store`: where the objects are and how to reach them
    (retrying, and choosing the client, are the Store's).

    Args:
        url: The prefix URL, without a trailing "/".
        scheme: Its scheme ("file" for a local path).
        root: A local prefix's folder (for a remote one, the URL).
        storage_options: The options for the client.
        timeout_s: How long a request may send nothing before it is abandoned.
    """

    url: str
    scheme: str
    root: str
    storage_options: Mapping[str, Any]
    timeout_s: float

    def url_of(self, name: str) -> str:
        """The URL of object `name` under the prefix, for messages."""
        return f"{self.url}/{name}"


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


class Backend:
    """One client's requests; each method is one attempt (the Store retries). Each counts its
    requests and the bytes they bring in `counters`."""

    def __init__(self, prefix: Prefix, counters: Counters) -> None:
        self.prefix = prefix
        self.counters = counters

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


class LocalBackend(Backend):
    def _path(self, name: str) -> str:
        return os.path.join(self.prefix.root, name)

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
            check_size(self.prefix.url_of(name), os.fstat(f.fileno()).st_size, size)
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
        root = self.prefix.root
        if not os.path.isdir(root):
            return []
        found = []
        for folder, _, files in os.walk(root):
            for file in files:
                found.append(os.path.relpath(os.path.join(folder, file), root))
        return found


class ObstoreBackend(Backend):
    def __init__(self, prefix: Prefix, counters: Counters) -> None:
        super().__init__(prefix, counters)
        import obstore.store

        global _obstore_used_in
        _obstore_used_in = os.getpid()
        self.client: Any
        timeout = timedelta(seconds=prefix.timeout_s)
        client_options: dict[str, Any] = {
            "connect_timeout": timeout,
            "read_timeout": timeout,
            # the overall limit defaults to 30 s: a large object on a slow link must not hit it
            "timeout": timedelta(days=1),
        }
        retry_config: Any = {"max_retries": 0}
        parsed = urllib.parse.urlsplit(prefix.url)
        options: dict[str, Any] = dict(prefix.storage_options)
        if prefix.scheme == "file":
            os.makedirs(prefix.root, exist_ok=True)
            self.client = obstore.store.LocalStore(prefix.root)
        elif prefix.scheme in ("s3", "s3a"):
            config: dict[str, Any] = {}
            for key, value in options.items():
                config[S3_OPTION_KEYS.get(key, key)] = value
            endpoint = (
                config.get("endpoint")
                or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL")
                or ""
            )
            if str(endpoint).startswith("http://"):
                client_options["allow_http"] = True
            if "skip_signature" in config:
                config["skip_signature"] = bool(config["skip_signature"])

            def make(config: dict[str, Any]) -> Any:
                return obstore.store.S3Store(
                    parsed.netloc,
                    prefix=parsed.path.strip("/") or None,
                    config=config,  # type: ignore[arg-type]
                    client_options=client_options,  # type: ignore[arg-type]
                    retry_config=retry_config,
                )

            if "endpoint" in config:
                # obstore reads AWS_ENDPOINT_URL_S3 into a key of its own that beats
                # "endpoint": the endpoint the caller named goes in both
                try:
                    self.client = make({**config, "aws_endpoint_url_s3": config["endpoint"]})
                except Exception:  # an obstore that knows no such key reads no such variable
                    self.client = make(config)
            else:
                self.client = make(config)
        else:
            from_url: Any = obstore.store.from_url
            self.client = from_url(prefix.url, client_options=client_options, retry_config=retry_config, **options)

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
                if _RANGE_NOT_SATISFIABLE.search(str(exc)):
                    raise RangeNotSatisfiable(str(exc)) from exc
                raise
        data = bytes(result.bytes())
        self.counters.add(nbytes=len(data))
        check_range(self.prefix.url_of(name), len(data), start or 0, end, result.meta["size"])
        return data

    def download(self, name: str, out: BinaryIO, size: int | None) -> int:
        import obstore

        self.counters.add(requests=1)
        result = obstore.get(self.client, name)
        expected = result.meta["size"]
        check_size(self.prefix.url_of(name), expected, size)
        written = 0
        for chunk in result.stream(min_chunk_size=CHUNK_BYTES):
            out.write(memoryview(chunk))
            written += len(chunk)
            self.counters.add(nbytes=len(chunk))
        check_range(self.prefix.url_of(name), written, 0, None, expected)
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


class FsspecBackend(Backend):
    def __init__(self, prefix: Prefix, counters: Counters) -> None:
        super().__init__(prefix, counters)
        import fsspec  # type: ignore[import-untyped]

        options: dict[str, Any] = dict(prefix.storage_options)
        if prefix.scheme in ("s3", "s3a"):
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
            config.setdefault("connect_timeout", prefix.timeout_s)
            config.setdefault("read_timeout", prefix.timeout_s)
            config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
            options["client_kwargs"] = client_kwargs
            options["config_kwargs"] = config
            options.setdefault("use_listings_cache", False)
        self.fs: Any = fsspec.filesystem(prefix.scheme, skip_instance_cache=True, **options)
        # s3fs retries on its own, and reads a whole object as a HEAD and then several
        # ranges at once: one attempt is one request here, counted and retried by the Store
        self.cat_options: dict[str, Any] = {}
        if prefix.scheme in ("s3", "s3a"):
            self.fs.retries = 1
            self.cat_options["max_concurrency"] = 1
        self.root = self.fs._strip_protocol(prefix.url).rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read(self, name: str, start: int | None, end: int | None) -> bytes:
        self.counters.add(requests=1)
        try:
            data = self.fs.cat_file(self._path(name), start=start, end=end, **self.cat_options)
        except OSError as exc:
            text = str(exc).lower()
            if start and _RANGE_NOT_SATISFIABLE.search(text):
                raise RangeNotSatisfiable(str(exc)) from exc
            raise
        self.counters.add(nbytes=len(data))
        if start is not None or end is not None:
            wanted = (end if end is not None else 0) - (start or 0)
            if end is None or len(data) != wanted:
                # fewer bytes than asked for: the object's end, or a body cut short?
                check_range(self.prefix.url_of(name), len(data), start or 0, end, self.size(name))
        return bytes(data)

    def download(self, name: str, out: BinaryIO, size: int | None) -> int:
        total = self.size(name)
        check_size(self.prefix.url_of(name), total, size)
        path = self._path(name)
        written = 0
        while written < total:
            end = min(total, written + CHUNK_BYTES)
            self.counters.add(requests=1)
            chunk = self.fs.cat_file(path, start=written, end=end, **self.cat_options)
            self.counters.add(nbytes=len(chunk))
            if len(chunk) != end - written:
                raise Transient(
                    f"{self.prefix.url_of(name)}: body of {len(chunk)} bytes where "
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
        if self.prefix.scheme in ("s3", "s3a"):
            # one HEAD: s3fs's info() follows a 404 with a listing (is it a directory?)
            bucket, key, _ = self.fs.split_path(self._path(name))
            return int(self.fs.call_s3("head_object", Bucket=bucket, Key=key)["ContentLength"])
        return int(self.fs.size(self._path(name)))

    def list(self) -> list[str]:
        self.counters.add(requests=1)
        found = self.fs.find(self.root)
        prefix = self.root + "/"
        return [path[len(prefix) :] for path in found if path.startswith(prefix)]
