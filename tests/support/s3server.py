"""An S3-compatible server on loopback, and a proxy that makes it behave like a real one.

`S3Server` runs moto's S3 server in a child process bound to 127.0.0.1 on a free port. The
child exits when the server is stopped, and also on its own when its parent dies (it watches
a pipe from the parent and its parent's pid), so a killed test run leaves nothing behind.

`FaultProxy` sits in front of any HTTP endpoint (moto, or a real store) and adds what object
stores show and moto does not: a delay before each response's first byte and a bandwidth cap
per connection; and, for fault tests, a fraction of requests answered 500 or 503 SlowDown,
connections reset in the middle of a body, requests that are never answered, and 403/404
for keys under a prefix. Which request gets which fault is decided from the seed, the request
(method, target within its bucket, range) and how many times that same request was seen
before, so a run is repeatable whatever the order threads send in and whichever bucket it
uses. It streams bodies through in chunks (nothing is held whole) and keeps connections alive.

Used by tests/shards (the `s3_server`, `s3_url` and `fault_proxy` fixtures) and by the
benchmark harness (the streaming benchmark, the cache sweep), which borrows it from here.
`python -m tests.support.s3server`, from the repo root, runs a server until interrupted.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter, deque
from collections.abc import Collection
from types import TracebackType
from typing import IO, Any

# The child: moto's threaded server on a free loopback port. It prints the port once the S3
# backend has answered a request (so the first test does not pay for loading it), then serves
# until its stdin closes (the parent stopped it or died) or its parent's pid changes.
_CHILD = r"""
import logging, os, sys, threading, time, urllib.request
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
parent = os.getppid()
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
port = server.get_host_and_port()[1]
urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).read()
def watch_parent():
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)
threading.Thread(target=watch_parent, daemon=True).start()
sys.stdout.write(f"{port}\n")
sys.stdout.flush()
sys.stdin.buffer.read()
os._exit(0)
"""

_AUTHORIZATION = (
    "AWS4-HMAC-SHA256 Credential=testing/20200101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0"
)
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


def server_python() -> str:
    """The interpreter that runs moto: `STOKER_S3_SERVER_PYTHON` where set (a test run in a
    user's install, which has no moto, borrows the test environment's), else this one.

    Returns:
        str: The interpreter's path.
    """
    return os.environ.get("STOKER_S3_SERVER_PYTHON") or sys.executable


def client_env(endpoint: str) -> dict[str, str]:
    """The environment variables that point S3 clients (obstore, s3fs, boto3) at `endpoint`.

    Args:
        endpoint: The server's URL, e.g. `http://127.0.0.1:PORT`.

    Returns:
        dict: `AWS_ENDPOINT_URL`, the test credentials, the region and `AWS_ALLOW_HTTP`
        (obstore refuses plain http without it).
    """
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}


class S3Server:
    """moto's S3 server in a child process on 127.0.0.1 (a context manager).

    Args:
        start_timeout_s: How long to wait for the server to answer before giving up.
            Defaults to 60.0.

    Raises:
        RuntimeError: from `start()` when the child exits or does not answer in time (the
            message holds what it wrote to stderr).
    """

    def __init__(self, start_timeout_s: float = 60.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.endpoint = ""
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The child process's pid while it runs, else None."""
        return self._process.pid if self._process is not None else None

    def start(self) -> S3Server:
        """Start the child and wait until it serves S3 requests.

        Returns:
            S3Server: self, with `endpoint` and `port` set.

        Raises:
            RuntimeError: when the child exits or does not report its port within
                `start_timeout_s`.
        """
        if self._process is not None:
            return self
        self._stderr = tempfile.TemporaryFile()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._process = subprocess.Popen(
            [server_python(), "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            close_fds=True,
        )
        assert self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], self.start_timeout_s)
        line = self._process.stdout.readline() if ready else b""
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the moto S3 server did not start: {self._errors()}")
        self.port = int(line)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        return self

    def _errors(self) -> str:
        if self._stderr is None:
            return "(no stderr)"
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace").strip()
        return text[-4000:] or "(it wrote nothing to stderr)"

    def stop(self) -> None:
        """Stop the child (closing its stdin asks it to exit; it is killed after 5 s)."""
        process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One HTTP request to the server, with a placeholder signature (moto wants one on
        object requests and does not check it).

        Args:
            method: The HTTP method.
            path: The target, e.g. `/bucket/key`.
            body: The request body. Defaults to None (none).

        Returns:
            tuple: (status, response body).
        """
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers={"Authorization": _AUTHORIZATION})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def make_bucket(self, name: str) -> str:
        """Create bucket `name`.

        Args:
            name: The bucket's name.

        Returns:
            str: `s3://name`.

        Raises:
            RuntimeError: when the server refuses.
        """
        status, body = self.request("PUT", f"/{name}")
        if status != 200:
            raise RuntimeError(f"making bucket {name!r}: HTTP {status}: {body[:500]!r}")
        return f"s3://{name}"

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        """Store `data` as `key` in `bucket`, directly (no client library).

        Args:
            bucket: The bucket's name.
            key: The object's key.
            data: Its contents.

        Raises:
            RuntimeError: when the server refuses.
        """
        status, body = self.request("PUT", f"/{bucket}/{urllib.parse.quote(key)}", data)
        if status != 200:
            raise RuntimeError(f"putting {bucket}/{key}: HTTP {status}: {body[:500]!r}")

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


_ERRORS = {
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}
_CHUNK = 1 << 20
# How many requests FaultProxy.log remembers (method, path, outcome), the latest last.
LOG_LENGTH = 100_000


def _error_response(status: int, resource: str, keep_alive: bool, head_only: bool) -> bytes:
    code, message = _ERRORS.get(status, ("InternalError", "Injected failure."))
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{resource}</Resource><RequestId>stoker-fault-proxy</RequestId></Error>"
    ).encode()
    reason = http.client.responses.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: stoker-fault-proxy\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    return head.encode() if head_only else head.encode() + body


def _read_head(rfile: Any) -> list[bytes] | None:
    """The lines of an HTTP message head up to the blank line; None at EOF before any."""
    lines: list[bytes] = []
    while True:
        line = rfile.readline(65537)
        if not line:
            if lines:
                raise ConnectionError("connection closed in the middle of a message head")
            return None
        if line in (b"\r\n", b"\n"):
            if lines:
                return lines
            continue  # a stray blank line between messages
        lines.append(line.rstrip(b"\r\n"))


def _headers(lines: list[bytes]) -> list[tuple[str, str]]:
    pairs = []
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        pairs.append((name.strip(), value.strip()))
    return pairs


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _head_bytes(first: bytes, headers: list[tuple[str, str]]) -> bytes:
    text = "".join(f"{k}: {v}\r\n" for k, v in headers)
    return first + b"\r\n" + text.encode("latin-1") + b"\r\n"


class _Sink:
    """Where a body goes: a socket (paced by a bandwidth cap), or nowhere (drained)."""

    def __init__(self, sock: socket.socket | None, bandwidth: float | None, count: Any) -> None:
        self.sock = sock
        self.bandwidth = bandwidth
        self.count = count
        self.sent = 0
        self.started = time.monotonic()

    def write(self, data: bytes | memoryview) -> None:
        if self.sock is None:
            return
        if not self.bandwidth:
            self.sock.sendall(data)
            self.sent += len(data)
            self.count(len(data))
            return
        step = max(1024, int(self.bandwidth / 50))
        view = memoryview(data)
        for at in range(0, len(view), step):
            piece = view[at : at + step]
            self.sock.sendall(piece)
            self.sent += len(piece)
            self.count(len(piece))
            wait = self.started + self.sent / self.bandwidth - time.monotonic()
            if wait > 0:
                time.sleep(wait)


def _copy_exact(rfile: Any, sink: _Sink, length: int, buffer: bytearray) -> None:
    view = memoryview(buffer)
    left = length
    while left > 0:
        got = rfile.readinto(view[: min(left, len(view))])
        if not got:
            raise ConnectionError("connection closed in the middle of a body")
        sink.write(view[:got])
        left -= got


def _copy_chunked(rfile: Any, sink: _Sink, buffer: bytearray) -> None:
    """Copy a chunked body as it is (sizes, extensions and trailers included)."""
    while True:
        line = rfile.readline(65537)
        if not line:
            raise ConnectionError("connection closed in the middle of a chunked body")
        sink.write(line)
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while True:
                trailer = rfile.readline(65537)
                if not trailer:
                    raise ConnectionError("connection closed in a chunked body's trailer")
                sink.write(trailer)
                if trailer in (b"\r\n", b"\n"):
                    return
        _copy_exact(rfile, sink, size + 2, buffer)  # the data and its CRLF


def _copy_until_close(rfile: Any, sink: _Sink, buffer: bytearray) -> None:
    view = memoryview(buffer)
    while True:
        got = rfile.readinto(view)
        if not got:
            return
        sink.write(view[:got])


def _reset(sock: socket.socket) -> None:
    """Close `sock` with a TCP RST (SO_LINGER 0) rather than an orderly FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of `upstream` that delays, throttles and breaks
    requests (a context manager).

    Fractions apply independently, in this order: hang, reset, fail. Prefix rules (`deny`,
    `missing`) come first and apply to every method. All settings are plain attributes and
    may be changed while it runs. What it did is in `requests`, `bytes_sent` (response body
    bytes sent to clients), `bytes_received` (request body bytes), `faults` (a Counter by
    outcome: "fail", "reset", "hang", "deny", "missing") and `log`.

    Args:
        upstream: The endpoint to forward to, e.g. `http://127.0.0.1:PORT`.
        first_byte_s: Each response waits this long before its first byte. Defaults to 0.0.
        bandwidth: Bytes per second each connection's response bodies are held to; None
            means no cap. Defaults to None.
        fail_fraction: The fraction of requests answered `fail_status` with S3's XML error
            body (and not forwarded). Defaults to 0.0.
        fail_status: 500 (InternalError) or 503 (SlowDown). Defaults to 503.
        reset_fraction: The fraction of requests forwarded whose response is cut with a TCP
            reset after its head and part of its body. Defaults to 0.0.
        hang_fraction: The fraction of requests never answered (the connection stays open
            until the client gives up). Defaults to 0.0.
        seed: Which requests get which fault. Defaults to 0.
        methods: The HTTP methods the fractions apply to; None means all. Defaults to None.

    Raises:
        ValueError: when a fraction is outside [0, 1] or `upstream` is not http://host:port.
    """

    def __init__(
        self,
        upstream: str,
        first_byte_s: float = 0.0,
        bandwidth: float | None = None,
        fail_fraction: float = 0.0,
        fail_status: int = 503,
        reset_fraction: float = 0.0,
        hang_fraction: float = 0.0,
        seed: int = 0,
        methods: Collection[str] | None = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"upstream should be http://host:port, but got upstream={upstream!r}")
        for name, value in (
            ("fail_fraction", fail_fraction),
            ("reset_fraction", reset_fraction),
            ("hang_fraction", hang_fraction),
        ):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} should be in [0, 1], but got {name}={value!r}")
        self.upstream = (parsed.hostname, parsed.port or 80)
        self.first_byte_s = first_byte_s
        self.bandwidth = bandwidth
        self.fail_fraction = fail_fraction
        self.fail_status = fail_status
        self.reset_fraction = reset_fraction
        self.hang_fraction = hang_fraction
        self.seed = seed
        self.methods = None if methods is None else {m.upper() for m in methods}
        self.requests = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.faults: Counter[str] = Counter()
        self.log: deque[tuple[str, str, str]] = deque(maxlen=LOG_LENGTH)
        self.endpoint = ""
        self._denied: list[str] = []
        self._missing: list[str] = []
        self._seen: Counter[tuple[str, str, str]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()

    def deny(self, prefix: str) -> None:
        """Answer 403 AccessDenied for every path under `prefix`.

        Args:
            prefix: Matched against the request's path without its leading slash, i.e.
                `bucket/key` for path-style S3 requests.
        """
        with self._lock:
            self._denied.append(prefix.lstrip("/"))

    def missing(self, prefix: str) -> None:
        """Answer 404 NoSuchKey for every path under `prefix` (as `deny` matches).

        Args:
            prefix: Matched against the request's path without its leading slash.
        """
        with self._lock:
            self._missing.append(prefix.lstrip("/"))

    def clear(self) -> None:
        """Drop the `deny` and `missing` rules and set every fraction to 0."""
        with self._lock:
            self._denied.clear()
            self._missing.clear()
        self.fail_fraction = self.reset_fraction = self.hang_fraction = 0.0

    def start(self) -> FaultProxy:
        """Listen on a free port of 127.0.0.1.

        Returns:
            FaultProxy: self, with `endpoint` set.
        """
        if self._listener is not None:
            return self
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listener = listener
        self.endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop listening, close every connection and wait for the threads."""
        self._stop.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        listener = self._listener
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.add(client)
                self._threads = [t for t in self._threads if t.is_alive()]
            thread = threading.Thread(target=self._serve, args=(client,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _draw(self, kind: str, key: tuple[str, str, str], nth: int) -> float:
        text = f"{self.seed}|{kind}|{key}|{nth}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") / 2.0**64

    def _outcome(self, method: str, path: str, range_: str) -> str:
        name = urllib.parse.unquote(path).lstrip("/")
        # the key within its bucket: the same faults whichever bucket a test was given (the
        # fixtures number buckets per process, so a test's bucket depends on the tests before it)
        key = (method, name.split("/", 1)[1] if "/" in name else name, range_)
        with self._lock:
            self.requests += 1
            nth = self._seen[key]
            self._seen[key] += 1
            denied = any(name.startswith(p) for p in self._denied)
            missing = any(name.startswith(p) for p in self._missing)
        if denied:
            return "deny"
        if missing:
            return "missing"
        if self.methods is not None and method not in self.methods:
            return "forward"
        for kind, fraction in (
            ("hang", self.hang_fraction),
            ("reset", self.reset_fraction),
            ("fail", self.fail_fraction),
        ):
            if fraction and self._draw(kind, key, nth) < fraction:
                return kind
        return "forward"

    def _count_sent(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += n

    def _count_received(self, n: int) -> None:
        with self._lock:
            self.bytes_received += n

    def _note(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            if outcome != "forward":
                self.faults[outcome] += 1
            self.log.append((method, path, outcome))

    def _hang(self, client: socket.socket) -> None:
        """Answer nothing until the client closes the connection or the proxy stops."""
        while not self._stop.is_set():
            readable, _, _ = select.select([client], [], [], 0.1)
            if readable:
                try:
                    if not client.recv(65536):
                        return
                except OSError:
                    return

    def _serve(self, client: socket.socket) -> None:
        rfile = client.makefile("rb", buffering=65536)
        upstream: socket.socket | None = None
        up_rfile: Any = None
        buffer = bytearray(_CHUNK)
        try:
            while not self._stop.is_set():
                head = _read_head(rfile)
                if head is None:
                    return
                method, target, _ = head[0].decode("latin-1").split(" ", 2)
                headers = _headers(head)
                path = urllib.parse.urlsplit(target).path
                outcome = self._outcome(method, path, _get(headers, "range") or "")
                self._note(method, path, outcome)
                expect = (_get(headers, "expect") or "").lower() == "100-continue"
                headers = [(k, v) for k, v in headers if k.lower() != "expect"]
                if expect:
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                length = int(_get(headers, "content-length") or 0)
                chunked = "chunked" in (_get(headers, "transfer-encoding") or "").lower()
                keep_alive = (_get(headers, "connection") or "").lower() != "close"
                if outcome != "forward" and outcome != "reset":
                    drain = _Sink(None, None, self._count_received)
                    if chunked:
                        _copy_chunked(rfile, drain, buffer)
                    else:
                        _copy_exact(rfile, drain, length, buffer)
                    if outcome == "hang":
                        self._hang(client)
                        return
                    status = {"deny": 403, "missing": 404}.get(outcome, self.fail_status)
                    if self.first_byte_s:
                        time.sleep(self.first_byte_s)
                    client.sendall(_error_response(status, path, keep_alive, method == "HEAD"))
                    if not keep_alive:
                        return
                    continue

                if upstream is not None and select.select([upstream], [], [], 0)[0]:
                    upstream.close()  # the upstream closed an idle connection
                    upstream = None
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=None)
                    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    up_rfile = upstream.makefile("rb", buffering=65536)
                    with self._lock:
                        self._sockets.add(upstream)
                upstream.sendall(_head_bytes(head[0], headers))
                to_upstream = _Sink(upstream, None, self._count_received)
                if chunked:
                    _copy_chunked(rfile, to_upstream, buffer)
                else:
                    _copy_exact(rfile, to_upstream, length, buffer)

                response = _read_head(up_rfile)
                while response is not None and response[0].split(b" ")[1:2] == [b"100"]:
                    response = _read_head(up_rfile)  # an interim answer we did not ask for
                if response is None:
                    raise ConnectionError("the upstream closed the connection")
                status = int(response[0].split(b" ")[1])
                up_headers = _headers(response)
                up_close = (_get(up_headers, "connection") or "").lower() == "close"
                if self.first_byte_s:
                    time.sleep(self.first_byte_s)
                body_length = _get(up_headers, "content-length")
                no_body = method == "HEAD" or status in (204, 304)
                if outcome == "reset":
                    if no_body:  # nothing to cut short: reset before the answer
                        _reset(client)
                        return
                    client.sendall(_head_bytes(response[0], up_headers))
                    if body_length is not None:
                        part = int(body_length) // 2
                        sink = _Sink(client, self.bandwidth, self._count_sent)
                        _copy_exact(up_rfile, sink, part, buffer)
                    _reset(client)
                    return
                client.sendall(_head_bytes(response[0], up_headers))
                sink = _Sink(client, self.bandwidth, self._count_sent)
                if no_body:
                    pass
                elif "chunked" in (_get(up_headers, "transfer-encoding") or "").lower():
                    _copy_chunked(up_rfile, sink, buffer)
                elif body_length is not None:
                    _copy_exact(up_rfile, sink, int(body_length), buffer)
                else:
                    _copy_until_close(up_rfile, sink, buffer)
                    return
                if up_close:
                    with self._lock:
                        self._sockets.discard(upstream)
                    upstream.close()
                    upstream = None
                if not keep_alive:
                    return
        except (OSError, ValueError, IndexError):
            return  # a client or upstream gone, or a message we cannot parse: drop the line
        finally:
            with self._lock:
                self._sockets.discard(client)
                if upstream is not None:
                    self._sockets.discard(upstream)
            if upstream is not None:
                upstream.close()
            try:
                client.close()
            except OSError:
                pass


def main() -> None:
    """Run an S3 server (and a proxy in front of it when asked) until interrupted.

    Usage: `python -m tests.support.s3server [FIRST_BYTE_S [BANDWIDTH]]`.
    """
    first_byte_s = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    bandwidth = float(sys.argv[2]) if len(sys.argv) > 2 else None
    with S3Server() as server:
        print(f"moto S3 server: {server.endpoint}")
        with FaultProxy(server.endpoint, first_byte_s=first_byte_s, bandwidth=bandwidth) as proxy:
            print(f"proxy (first byte {first_byte_s} s, bandwidth {bandwidth}): {proxy.endpoint}")
            for name, value in client_env(server.endpoint).items():
                print(f"export {name}={value}")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
