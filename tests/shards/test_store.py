"""Store against a real moto S3 server on loopback (both clients) and local files, and each
fault a store shows, injected by a FaultProxy in front of the server: 500 and 503 SlowDown,
a connection reset in the middle of a body, a request that never answers, 403 and 404."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from tests.support.s3server import FaultProxy, S3Server

from stoker._shards.errors import AccessDeniedError, MissingObjectError, StoreError
from stoker._shards.store import Store

CLIENTS = ("obstore", "fsspec")
BLOB = os.urandom(300_000)


def put(server: S3Server, url: str, name: str, data: bytes) -> None:
    """Store an object under the prefix `url`, straight to the server (no Store)."""
    parsed = urllib.parse.urlsplit(url)
    server.put_object(parsed.netloc, f"{parsed.path.strip('/')}/{name}", data)


def through(proxy: FaultProxy, url: str, client: str, **kwargs: object) -> Store:
    """A Store that reaches the server through `proxy`, with quick retries."""
    options = {"retries": 8, "backoff_s": 0.01, "timeout_s": 5.0, **kwargs}
    return Store(url, storage_options={"endpoint_url": proxy.endpoint}, client=client, **options)  # type: ignore[arg-type]


@pytest.fixture(params=["s3-obstore", "s3-fsspec", "file-local", "file-fsspec", "file-obstore"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> tuple[str, str]:
    """(prefix URL, client) for each place and client a Store serves."""
    where, client = request.param.split("-")
    if where == "s3":
        return request.getfixturevalue("s3_url"), client
    url = (tmp_path / "data").as_uri() if client != "local" else str(tmp_path / "data")
    return url, "auto" if client == "local" else client


def test_read_write_size_list_download(store_url: tuple[str, str]) -> None:
    url, client = store_url
    store = Store(url, client=client)
    store.write("a.bin", BLOB)
    store.write("sub/b.txt", b"hello")
    store.write("empty", b"")
    assert store.list() == ["a.bin", "empty", "sub/b.txt"]
    assert store.read("a.bin") == BLOB
    assert store.read("sub/b.txt") == b"hello"
    assert store.read("empty") == b""
    assert store.read("a.bin", 1000, 2000) == BLOB[1000:2000]
    assert store.read("a.bin", 299_990) == BLOB[299_990:]
    assert store.read("a.bin", 299_990, 400_000) == BLOB[299_990:]  # past the end: clipped
    assert store.read("a.bin", 300_000, 300_010) == b""
    assert store.read("a.bin", 5, 5) == b""
    assert store.size("a.bin") == len(BLOB)
    assert store.size("empty") == 0
    out = io.BytesIO(b"head")
    out.seek(4)
    assert store.download("a.bin", out, size=len(BLOB)) == len(BLOB)
    assert out.getvalue() == b"head" + BLOB
    assert store.counters.requests > 0 and store.counters.bytes >= 2 * len(BLOB)
    store.write("sub/b.txt", b"replaced")
    assert store.read("sub/b.txt") == b"replaced"


def test_missing_object_names_its_url(store_url: tuple[str, str]) -> None:
    url, client = store_url
    store = Store(url, client=client, retries=3, backoff_s=0.01)
    store.write("there", b"x")
    for call in (
        lambda: store.read("nope/x.tar"),
        lambda: store.read("nope/x.tar", 0, 10),
        lambda: store.size("nope/x.tar"),
        lambda: store.download("nope/x.tar", io.BytesIO()),
    ):
        with pytest.raises(MissingObjectError) as info:
            call()
        assert str(info.value).startswith(store.url_of("nope/x.tar"))
    assert store.counters.retries == 0


def test_download_of_the_wrong_size_fails_at_once(store_url: tuple[str, str]) -> None:
    url, client = store_url
    store = Store(url, client=client, retries=3, backoff_s=0.01)
    store.write("a.bin", BLOB)
    with pytest.raises(StoreError, match="300000 bytes, but 1000 were expected"):
        store.download("a.bin", io.BytesIO(), size=1000)
    assert store.counters.retries == 0


def test_auto_picks_obstore_for_s3_and_os_for_paths(tmp_path) -> None:
    assert Store("s3://bucket/data").backend == "obstore"
    assert Store("s3://bucket/data", {"endpoint_url": "http://x", "key": "k"}).backend == "obstore"
    # an option only fsspec understands: fsspec serves it
    assert Store("s3://bucket/data", {"requester_pays": True}).backend == "fsspec"
    assert Store("hf://datasets/x/y").backend == "fsspec"
    assert Store(str(tmp_path)).backend == "local"
    assert Store(tmp_path.as_uri()).backend == "local"
    assert Store("s3://bucket/data", client="fsspec").backend == "fsspec"
    with pytest.raises(ValueError, match="client should be"):
        Store("s3://bucket/data", client="boto")


def test_pickles_without_its_client(s3_url: str) -> None:
    store = Store(s3_url)
    store.write("a", b"abc")
    assert store._client.made_here
    copy = pickle.loads(pickle.dumps(store))
    assert not copy._client.made_here and copy.counters.requests == 0
    assert copy.read("a") == b"abc"


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("status", [500, 503])
def test_server_errors_are_retried(s3_server: S3Server, s3_url: str, fault_proxy, client: str, status: int) -> None:
    put(s3_server, s3_url, "a.bin", BLOB)
    proxy = fault_proxy(fail_fraction=0.4, fail_status=status, seed=status)
    store = through(proxy, s3_url, client)
    ranges = [(k * 10_000, k * 10_000 + 7_000) for k in range(20)]
    with ThreadPoolExecutor(8) as pool:  # one Store used by several threads at once
        parts = list(pool.map(lambda r: store.read("a.bin", *r), ranges))
    assert parts == [BLOB[a:b] for a, b in ranges]
    assert store.read("a.bin") == BLOB
    out = io.BytesIO()
    assert store.download("a.bin", out, size=len(BLOB)) == len(BLOB)
    assert out.getvalue() == BLOB
    assert proxy.faults["fail"] > 0
    assert store.counters.retries == proxy.faults["fail"]
    assert store.counters.requests == proxy.requests  # every attempt is counted


@pytest.mark.parametrize("client", CLIENTS)
def test_reset_mid_object_is_retried(s3_server: S3Server, s3_url: str, fault_proxy, client: str) -> None:
    put(s3_server, s3_url, "a.bin", BLOB)
    proxy = fault_proxy(reset_fraction=0.5, seed=1)
    store = through(proxy, s3_url, client)
    assert store.read("a.bin") == BLOB
    assert store.read("a.bin", 100, 250_000) == BLOB[100:250_000]
    out = io.BytesIO(b"x")
    out.seek(1)
    for _ in range(3):  # each download starts again from where the file stood
        out.seek(1)
        assert store.download("a.bin", out) == len(BLOB)
        assert out.getvalue() == b"x" + BLOB
    # (aiohttp itself sends a request again when a reused connection is reset before the
    # answer starts: not every reset is one of the Store's retries)
    assert proxy.faults["reset"] > 0 and store.counters.retries > 0


def test_a_tests_faults_do_not_depend_on_its_bucket(s3_server: S3Server, s3_url: str, fault_proxy) -> None:
    """The fixtures number buckets per process, so which bucket a test gets depends on the tests
    run before it there (by xdist's draw): a proxy's faults, drawn per request, must not."""
    seen = []
    for bucket in (s3_url, s3_url.replace("/data", "-other/data")):
        if bucket != s3_url:
            s3_server.make_bucket(urllib.parse.urlsplit(bucket).netloc)
        put(s3_server, bucket, "a.bin", BLOB)
        proxy = fault_proxy(reset_fraction=0.5, seed=1)
        store = through(proxy, bucket, "obstore")
        for _ in range(3):
            assert store.read("a.bin") == BLOB
        seen.append([outcome for _, _, outcome in proxy.log])
    assert seen[0] == seen[1] and "reset" in seen[0], seen


@pytest.mark.parametrize("client", CLIENTS)
def test_a_hanging_request_is_retried_after_timeout(s3_server: S3Server, s3_url: str, fault_proxy, client: str) -> None:
    put(s3_server, s3_url, "a.bin", BLOB)
    proxy = fault_proxy(hang_fraction=1.0)
    # long enough for the server to answer the retry on a busy machine: a slow answer taken for
    # a hang would be a second retry
    store = through(proxy, s3_url, client, timeout_s=3.0)
    got: list[bytes] = []
    started = time.monotonic()
    reader = threading.Thread(target=lambda: got.append(store.read("a.bin")))
    reader.start()
    while not proxy.faults["hang"]:
        assert time.monotonic() - started < 60, "the first request never reached the proxy"
        time.sleep(0.01)
    proxy.hang_fraction = 0.0  # the first request hangs; the retry is answered
    reader.join(timeout=60)
    assert not reader.is_alive(), "the read did not give up on a hanging request"
    assert got == [BLOB]
    assert proxy.faults["hang"] == 1 and store.counters.retries == 1


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("fault", ["hang", "503", "reset"])
def test_a_fault_on_every_attempt_ends_in_store_error(
    s3_server: S3Server, s3_url: str, fault_proxy, client: str, fault: str
) -> None:
    put(s3_server, s3_url, "a.bin", BLOB)
    proxy = fault_proxy(
        hang_fraction=float(fault == "hang"),
        fail_fraction=float(fault == "503"),
        reset_fraction=float(fault == "reset"),
    )
    # a short timeout where every attempt hangs; a generous one where the proxy answers (a slow
    # answer taken for a hang would change the error)
    store = through(proxy, s3_url, client, retries=2, timeout_s=0.5 if fault == "hang" else 5.0)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            store.read("a.bin")
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "the read is still waiting"
    assert len(errors) == 1 and isinstance(errors[0], StoreError), errors
    assert str(errors[0]).startswith(store.url_of("a.bin"))
    assert "failed 3 times" in str(errors[0])
    assert proxy.requests == 3 and store.counters.requests == 3
    if fault == "503":
        assert "Service Unavailable" in str(errors[0]) or "reduce your request rate" in str(errors[0])


@pytest.mark.parametrize("client", CLIENTS)
def test_403_and_404_are_not_retried(s3_server: S3Server, s3_url: str, fault_proxy, client: str) -> None:
    put(s3_server, s3_url, "private/a.bin", BLOB)
    put(s3_server, s3_url, "gone/a.bin", BLOB)
    proxy = fault_proxy()
    bucket_path = s3_url[len("s3://") :]
    proxy.deny(f"{bucket_path}/private/")
    proxy.missing(f"{bucket_path}/gone/")
    store = through(proxy, s3_url, client)
    for name, error in (("private/a.bin", AccessDeniedError), ("gone/a.bin", MissingObjectError)):
        for call in (
            lambda n: store.read(n),
            lambda n: store.read(n, 10, 20),
            lambda n: store.size(n),
            lambda n: store.download(n, io.BytesIO()),
        ):
            with pytest.raises(error) as info:
                call(name)
            assert str(info.value).startswith(store.url_of(name))
    assert store.counters.retries == 0
    assert proxy.requests == store.counters.requests


def test_proxy_adds_first_byte_delay_and_bandwidth_cap(s3_server: S3Server, s3_url: str, fault_proxy) -> None:
    data = os.urandom(1 << 20)
    put(s3_server, s3_url, "a.bin", data)
    proxy = fault_proxy(first_byte_s=0.2)
    store = through(proxy, s3_url, "obstore")
    started = time.monotonic()
    assert store.read("a.bin", 0, 10) == data[:10]
    assert time.monotonic() - started >= 0.2
    proxy.first_byte_s = 0.0
    proxy.bandwidth = 4 << 20
    started = time.monotonic()
    assert store.read("a.bin") == data
    assert time.monotonic() - started >= 0.22  # 1 MiB at 4 MiB/s
    # the proxy counts a chunk after sending it: the client may have it first
    deadline = time.monotonic() + 30  # a bound on a hang
    while proxy.bytes_sent < len(data) + 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.bytes_sent >= len(data) + 10


def test_server_child_exits_when_its_parent_is_killed() -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from tests.support.s3server import S3Server
        server = S3Server().start()
        print(server.pid, flush=True)
        time.sleep(120)
        """
    )
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root)}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30  # a bound on a hang
        while time.monotonic() < deadline:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            child.kill()
            pytest.fail("the moto server outlived its killed parent")
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"])
def test_an_explicit_endpoint_beats_the_environments(
    s3_server: S3Server, s3_url: str, monkeypatch: pytest.MonkeyPatch, client: str, variable: str
) -> None:
    put(s3_server, s3_url, "a", b"explicit")
    monkeypatch.setenv(variable, "http://127.0.0.1:1")  # nothing listens there
    store = Store(s3_url, {"endpoint_url": s3_server.endpoint}, client=client, retries=0, timeout_s=5)
    assert store.read("a") == b"explicit"
