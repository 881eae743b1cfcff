"""Fixtures for the shard tests: a real moto S3 server on loopback, a fresh bucket per test,
and fault proxies in front of the server.

    def test_x(s3_url):                  # "s3://bucket-N/data", env pointed at the server
        store = Store(s3_url)
    def test_y(s3_url, fault_proxy):
        proxy = fault_proxy(fail_fraction=0.3)        # a started FaultProxy
        store = Store(s3_url, storage_options={"endpoint_url": proxy.endpoint})
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tests.support.s3server import FaultProxy, S3Server, client_env

_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for this test process (each xdist worker has its own)."""
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new, empty bucket's prefix, `s3://bucket-N/data`; the AWS_* environment variables
    (endpoint, test credentials, region, AWS_ALLOW_HTTP) point clients at the server for the
    test's duration."""
    for name, value in client_env(s3_server.endpoint).items():
        monkeypatch.setenv(name, value)
    bucket = f"bucket-{next(_buckets)}"
    s3_server.make_bucket(bucket)
    return f"s3://{bucket}/data"


@pytest.fixture
def fault_proxy(s3_server: S3Server) -> Iterator[Callable[..., FaultProxy]]:
    """A factory: `fault_proxy(**kwargs)` starts a `FaultProxy` in front of the server
    (kwargs as FaultProxy takes them); each is stopped after the test."""
    proxies: list[FaultProxy] = []

    def make(**kwargs: Any) -> FaultProxy:
        proxy = FaultProxy(s3_server.endpoint, **kwargs).start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.stop()
