"""A process forked from one whose obstore has made requests asks that process (the relay):
every request kind, the documented errors, threads, a grandchild, an owner that dies before or
during a request, and a stranger without the token. Each child blocks fsspec's S3 (as an
install of `stoker[stream]` alone has no s3fs) and runs under an alarm, so a hang fails the
test instead of stalling it."""

from __future__ import annotations

import io
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest
from tests.support.s3server import S3Server

from stoker._shards import relay
from stoker._shards.errors import MissingObjectError, StoreError
from stoker._shards.store import Store

BLOB = os.urandom(3_000_000)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the relay is Linux's")


def put(server: S3Server, url: str, name: str, data: bytes) -> None:
    parsed = urllib.parse.urlsplit(url)
    server.put_object(parsed.netloc, f"{parsed.path.strip('/')}/{name}", data)


def in_child(func: Callable[[], Any], alarm_s: int = 30) -> Any:
    """Run `func` in a forked child without s3fs; return its result or raise what it raised
    (as text)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(alarm_s)
            os.close(read)
            sys.modules["s3fs"] = None  # type: ignore[assignment]
            try:
                answer: Any = ("ok", func())
            except BaseException as exc:
                answer = ("raised", type(exc).__name__, str(exc), traceback.format_exc())
            with os.fdopen(write, "wb") as pipe:
                pipe.write(pickle.dumps(answer))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert data, f"the child said nothing (status {status}: killed by its alarm?)"
    return pickle.loads(data)


def test_a_forked_child_makes_every_request_through_its_parent(s3_server: S3Server, s3_url: str) -> None:
    put(s3_server, s3_url, "blob", BLOB)
    store = Store(s3_url, timeout_s=5)
    assert store.read("blob", 0, 3) == BLOB[:3] and store.backend == "obstore"

    def child() -> Any:
        assert type(store._backend()).__name__ == "RelayBackend"
        out = io.BytesIO()
        written = store.download("blob", out, size=len(BLOB))
        store.write("written-by-child", b"child")
        with ThreadPoolExecutor(4) as pool:  # one connection per thread
            parts = list(pool.map(lambda k: store.read("blob", k * 1000, k * 1000 + 10), range(16)))
        return (
            written,
            out.getvalue() == BLOB,
            store.read("blob", 100, 200) == BLOB[100:200],
            store.read("blob", len(BLOB) + 5),  # past the end: empty, as a file read
            store.size("blob"),
            store.list(),
            parts == [BLOB[k * 1000 : k * 1000 + 10] for k in range(16)],
            store.counters.requests > 0 and store.counters.bytes >= len(BLOB),
        )

    answer = in_child(child)
    assert answer[0] == "ok", answer
    written, same, ranged, past_end, size, names, parts, counted = answer[1]
    assert (written, same, ranged, past_end, size) == (len(BLOB), True, True, b"", len(BLOB))
    assert names == ["blob", "written-by-child"] and parts and counted
    assert store.read("written-by-child") == b"child"


def test_the_documented_errors_cross_and_name_the_url(s3_server: S3Server, s3_url: str) -> None:
    put(s3_server, s3_url, "blob", b"0123456789")
    store = Store(s3_url, timeout_s=5, retries=1, backoff_s=0.01)
    store.read("blob")

    def missing() -> Any:
        try:
            store.read("no-such-object")
        except MissingObjectError as exc:
            return str(exc)

    def wrong_size() -> Any:
        try:
            store.download("blob", io.BytesIO(), size=3)
        except StoreError as exc:
            return str(exc)

    assert in_child(missing) == ("ok", f"{s3_url}/no-such-object: no such object")
    kind, text = in_child(wrong_size)
    assert kind == "ok" and text.startswith(f"{s3_url}/blob: ") and "10 bytes, but 3" in text


def test_a_grandchild_asks_the_owner(s3_server: S3Server, s3_url: str) -> None:
    put(s3_server, s3_url, "blob", b"deep")
    store = Store(s3_url, timeout_s=5)
    store.read("blob")
    answer = in_child(lambda: in_child(lambda: store.read("blob")))
    assert answer == ("ok", ("ok", b"deep"))


# A fresh process becomes the owner (this test process may own a relay already), forks a
# child that waits for a byte on stdin's pipe, then makes one request; the owner prints the
# child's pid and waits to be killed. The child writes "<seconds> <outcome>" to OUT.
_OWNER = r"""
import io, os, signal, sys, time
sys.modules["s3fs"] = None
from stoker._shards.errors import StoreError
from stoker._shards.store import Store
url, endpoint, out, mode = sys.argv[1:5]
options = {"endpoint_url": endpoint} if endpoint else None
store = Store(url, storage_options=options, timeout_s=30, retries=3, backoff_s=0.01)
store.read("blob", 0, 1)
go_r, go_w = os.pipe()
pid = os.fork()
if pid == 0:
    signal.alarm(40)
    os.close(go_w)
    if mode == "before":
        os.read(go_r, 1)  # EOF once the owner is dead
    else:
        print(os.getpid(), flush=True)
    started = time.monotonic()
    try:
        if mode == "before":
            store.read("blob")
        else:
            store.download("blob", io.BytesIO())
        text = "done"
    except StoreError as exc:
        text = str(exc)
    with open(out + ".tmp", "w") as f:
        f.write(f"{time.monotonic() - started:.3f} {text}")
    os.rename(out + ".tmp", out)
    os._exit(0)
os.close(go_r)
if mode == "before":
    print(pid, flush=True)
time.sleep(120)
"""


def _owner_dies(tmp_path: Any, url: str, endpoint: str, mode: str, wait_s: float) -> tuple[int, int, str, float]:
    """Start an owner and its child, SIGKILL the owner (after `wait_s`), and return the
    owner's pid, the child's, what the child said and how long after the kill it said it."""
    out = str(tmp_path / f"child-{mode}.txt")
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, url, endpoint, out, mode], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        time.sleep(wait_s)
        killed_at = time.monotonic()
        owner.kill()
        owner.wait(10)
        while not os.path.exists(out):
            assert time.monotonic() - killed_at < 30, "the child hung"
            time.sleep(0.05)
        noticed = time.monotonic() - killed_at
        text = open(out).read().split(" ", 1)[1]
    finally:
        owner.kill()
        owner.wait(10)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child is still running"
        time.sleep(0.05)
    return owner.pid, child, text, noticed


def test_an_owner_that_is_gone_is_an_error_not_a_hang(tmp_path: Any, s3_server: S3Server, s3_url: str) -> None:
    """The child asks after its owner was SIGKILLed: the request fails at once, naming the
    owner, and is not retried."""
    put(s3_server, s3_url, "blob", b"x")
    owner, _, text, noticed = _owner_dies(tmp_path, s3_url, "", "before", 0.0)
    assert text.startswith(f"{s3_url}/blob: ") and f"(pid {owner}" in text and "has exited" in text, text
    assert "failed" not in text  # not retried
    print(f"\nnoticed {noticed:.2f} s after the kill")  # a figure; the hang bound is _owner_dies's 30 s


def test_an_owner_killed_during_a_download_is_noticed(
    tmp_path: Any, s3_server: S3Server, s3_url: str, fault_proxy: Any
) -> None:
    """The child is waiting for a slow download when its owner is SIGKILLed: it notices within
    the owner check's period and raises, naming the owner."""
    put(s3_server, s3_url, "blob", BLOB)
    proxy = fault_proxy(bandwidth=200_000)  # 3 MB at 200 kB/s: 15 s
    owner, _, text, noticed = _owner_dies(tmp_path, s3_url, proxy.endpoint, "during", 1.5)
    assert text.startswith(f"{s3_url}/blob: ") and f"(pid {owner}" in text and "has exited" in text, text
    print(f"\nnoticed {noticed:.2f} s after the kill")  # a figure; the hang bound is _owner_dies's 30 s


def test_a_connection_without_the_token_is_refused(s3_url: str) -> None:
    store = Store(s3_url, timeout_s=5)
    with pytest.raises(MissingObjectError):
        store.read("nothing")
    owner = relay._owner
    assert owner is not None and owner.pid == os.getpid()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(owner.address)
        sock.sendall(b"\0" * len(owner.token))
        assert sock.recv(1) == b""  # closed without the welcome byte
