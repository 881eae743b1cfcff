"""Requests a forked process asks of the process that owns obstore's runtime.

obstore makes its requests on a runtime (tokio's threads) started at a process's first
request, and that runtime does not survive `fork()`: a child forked after it started hangs
in its first request, whatever client it makes. Workers are forked after the loader's
process has read the index and started downloading ahead, and so are torch's workers, the
writer's processes, and any process the user forks. So the process that starts the runtime
(the owner) first opens a relay, and every process forked from it, at any depth, sends its
requests there:

    owner (runtime, relay thread) <--- Unix socket ---  forked child: RelayBackend
          |  one thread per connection                  (one connection per thread)
          '- Store(url, options).backend: one attempt of read / download / write / size / list

- The socket is in Linux's abstract namespace: no file to leave behind when the owner is
  killed. Anyone on the machine may connect to it, so a connection first sends a random
  token that only the owner and its forked descendants hold, and a peer of another user is
  refused by its credentials before that.
- Each request is one attempt of one `Backend` method, run with the owner's client: the
  asking process's own `Store` counts, retries and words the errors, as it does for a client
  of its own. An exception is sent back as what `classify` makes of it, with its text.
- A download comes back in chunks as the owner's client receives them, and the asker writes
  them into its file: nothing holds a whole object in memory.
- While waiting for an answer, the asker checks once a second that the owner still lives:
  an owner that exits or is killed is a `StoreError` naming it, never a hang.

Spawned and forkserver processes start clean and make their own runtime; so does a process
forked before its parent's first request. Elsewhere than Linux there is no relay: there,
workers are spawned by default, and a forked child of an owner gets an error saying so.
"""

from __future__ import annotations

import errno
import hmac
import os
import pickle
import secrets
import select
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO, cast

from .._base.process import at_fork
from .clients import Backend, Counters, Prefix, classify, describe
from .errors import OwnerGone, RangeNotSatisfiable, Relayed, SizeMismatch, Transient

# How long a new connection has to present its token.
HANDSHAKE_S = 10.0
# How often a process waiting for an answer checks that the owner is alive.
OWNER_CHECK_S = 1.0
# Fewer, larger copies through the socket for a download's chunks (the kernel may cap it).
SOCKET_BUFFER_BYTES = 4 << 20
# A frame: its kind (a pickled object, or raw bytes of a download) and length.
_HEAD = struct.Struct("!cQ")
_OBJECT = b"P"
_CHUNK = b"C"


# --- wire ------------------------------------------------------------------------------


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEAD.pack(_OBJECT, len(data)))
    sock.sendall(data)


def _send_chunk(sock: socket.socket, chunk: bytes | memoryview) -> None:
    sock.sendall(_HEAD.pack(_CHUNK, len(chunk)))
    sock.sendall(chunk)


def _recv_exact(sock: socket.socket, n: int, wait: Callable[[], None] | None = None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if wait is not None:
            wait()
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the connection was closed")
        got += k
    return buf


def _recv(sock: socket.socket, wait: Callable[[], None] | None = None) -> tuple[bytes, Any]:
    """One frame: (_OBJECT, the unpickled object) or (_CHUNK, its bytes)."""
    kind, length = _HEAD.unpack(_recv_exact(sock, _HEAD.size, wait))
    body = _recv_exact(sock, length, wait)
    return kind, (pickle.loads(body) if kind == _OBJECT else body)


class _ChunkSink:
    """The file a download writes into, in the owner: each write goes to the asker."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        _send_chunk(self.sock, view)
        return len(view)


# --- the owner's side -------------------------------------------------------------------


class _Owner:
    """What the owner holds: its listening socket, token and the stores it serves."""

    def __init__(self, make_store: Callable[..., Any]) -> None:
        self.make_store = make_store
        self.pid = os.getpid()
        self.token = secrets.token_bytes(32)
        self.address = f"\0stoker-relay-{self.pid}-{secrets.token_hex(8)}"
        self.listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.address)
        self.listener.listen(64)
        self.stores: dict[bytes, Any] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="stoker-relay", daemon=True).start()

    def _accept(self) -> None:
        listener = self.listener
        while listener is not None and os.getpid() == self.pid:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="stoker-relay-conn", daemon=True).start()

    def _store(self, key: tuple[Any, ...]) -> Any:
        blob = pickle.dumps(key)
        with self.lock:
            store = self.stores.get(blob)
            if store is None:
                url, options, client, timeout_s = key
                store = self.stores[blob] = self.make_store(
                    url, storage_options=options, client=client, retries=0, timeout_s=timeout_s
                )
        return store

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
                if not self._admit(conn):
                    return
                while True:
                    try:
                        _, request = _recv(conn)
                    except (EOFError, OSError):
                        return
                    _send(conn, self._answer(request, conn))
            except (OSError, EOFError):
                return

    def _admit(self, conn: socket.socket) -> bool:
        if hasattr(socket, "SO_PEERCRED"):
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid != os.getuid():
                return False
        conn.settimeout(HANDSHAKE_S)
        try:
            token = _recv_exact(conn, len(self.token))
        except (OSError, EOFError):
            return False
        conn.settimeout(None)
        if not hmac.compare_digest(token, self.token):
            return False
        conn.sendall(b"\1")
        return True

    def _answer(self, request: tuple[Any, ...], conn: socket.socket) -> tuple[Any, ...]:
        op, key, *args = request
        try:
            backend = self._store(key)._backend()
            if op == "download":
                name, size = args
                return ("ok", backend.download(name, cast(BinaryIO, _ChunkSink(conn)), size))
            if op == "read":
                return ("ok", backend.read(*args))
            if op == "write":
                backend.write(*args)
                return ("ok", None)
            if op == "size":
                return ("ok", backend.size(*args))
            if op == "list":
                return ("ok", backend.list())
            return ("err", "fatal", "", f"unknown relay request {op!r}")
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.ECONNRESET) and op == "download":
                raise  # the asker went away in the middle of a download
            return ("err", classify(exc), type(exc).__name__, describe(exc))
        except Exception as exc:
            return ("err", classify(exc), type(exc).__name__, describe(exc))


_owner: _Owner | None = None
# Inherited by forked children: where their owner listens, its token and pid.
_inherited: tuple[str, bytes, int] | None = None
_owner_lock = threading.Lock()


def become_owner(make_store: Callable[..., Any]) -> None:
    """Open this process's relay (once), before its first obstore request.

    Does nothing where there is no abstract Unix socket (outside Linux) or when this process
    already is the owner.

    Args:
        make_store: Makes the owner's store for a request: called as `Store` is, with the
            asker's url, storage options, client and timeout, and `retries=0`.
    """
    global _owner
    if not sys.platform.startswith("linux"):
        return
    with _owner_lock:
        if _owner is None:  # a forked child's copy was dropped by the fork hook below
            _owner = _Owner(make_store)


def available() -> bool:
    """Whether this process can ask an owner (it was forked from one)."""
    return _owner_address() is not None


def _owner_address() -> tuple[str, bytes, int] | None:
    return _inherited


def _after_fork_in_child() -> None:
    """A child of the owner (or of one of its descendants): close the inherited listener and
    connections, keep the owner's address and token."""
    global _owner, _inherited, _owner_lock
    _owner_lock = threading.Lock()  # another thread may have held it at the fork
    if _owner is not None:
        _inherited = (_owner.address, _owner.token, _owner.pid)
        listener, _owner.listener = _owner.listener, None
        if listener is not None:
            listener.close()
        _owner = None
    _connections.__dict__.clear()  # the forking thread's: the child's only thread


at_fork(after_in_child=_after_fork_in_child)


# --- the asking side -------------------------------------------------------------------

_connections = threading.local()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RelayBackend(Backend):
    """A `Backend` whose every attempt is made by the owner's client (see the module's
    docstring). Made by `Store` in a process forked from the owner."""

    def __init__(self, prefix: Prefix, counters: Counters) -> None:
        address = _owner_address()
        if address is None:
            raise OwnerGone("no process to relay requests to")
        super().__init__(prefix, counters)
        self.address, self.token, self.owner = address
        self.key = (prefix.url, prefix.storage_options, "obstore", prefix.timeout_s)

    def _gone(self) -> OwnerGone:
        return OwnerGone(
            f"the process that made this process's object-storage requests (pid {self.owner}, "
            "which this one was forked from) has exited"
        )

    def _socket(self) -> socket.socket:
        made = getattr(_connections, "sock", None)  # this thread's (the fork hook drops it)
        if made is not None:
            return made
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            sock.connect(self.address)
            sock.sendall(self.token)
            sock.settimeout(HANDSHAKE_S)
            answer = sock.recv(1)
            sock.settimeout(None)
        except OSError as exc:
            sock.close()
            if isinstance(exc, (ConnectionRefusedError, FileNotFoundError)) or not _alive(self.owner):
                raise self._gone() from exc
            raise
        if answer != b"\1":
            sock.close()
            raise self._gone()
        _connections.sock = sock
        return sock

    def _drop(self) -> None:
        made = getattr(_connections, "sock", None)
        _connections.sock = None
        if made is not None:
            made.close()

    def _wait(self, sock: socket.socket) -> None:
        while not select.select([sock], [], [], OWNER_CHECK_S)[0]:
            if not _alive(self.owner):
                raise self._gone()

    def _ask(self, request: tuple[Any, ...], out: BinaryIO | None = None) -> Any:
        sock = self._socket()
        try:
            _send(sock, request)
            while True:
                kind, answer = _recv(sock, lambda: self._wait(sock))
                if kind == _OBJECT:
                    break
                assert out is not None
                out.write(answer)
                self.counters.add(nbytes=len(answer))
        except OwnerGone:
            self._drop()
            raise
        except (OSError, EOFError) as exc:
            self._drop()
            if not _alive(self.owner):
                raise self._gone() from exc
            raise Transient(f"the relay's connection failed: {exc}") from exc
        if answer[0] == "ok":
            return answer[1]
        _, kind, name, text = answer
        known = {"RangeNotSatisfiable": RangeNotSatisfiable, "SizeMismatch": SizeMismatch, "Transient": Transient}
        if name in known:
            raise known[name](text)
        raise Relayed(kind, text)

    def read(self, name: str, start: int | None, end: int | None) -> bytes:
        self.counters.add(requests=1)
        data: bytes = self._ask(("read", self.key, name, start, end))
        self.counters.add(nbytes=len(data))
        return data

    def download(self, name: str, out: BinaryIO, size: int | None) -> int:
        self.counters.add(requests=1)
        written: int = self._ask(("download", self.key, name, size), out)
        return written

    def write(self, name: str, data: bytes) -> None:
        self.counters.add(requests=1)
        self._ask(("write", self.key, name, data))

    def size(self, name: str) -> int:
        self.counters.add(requests=1)
        return int(self._ask(("size", self.key, name)))

    def list(self) -> list[str]:
        self.counters.add(requests=1)
        return list(self._ask(("list", self.key)))


__all__ = ["RelayBackend", "available", "become_owner"]
