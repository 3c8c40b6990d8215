"""Fixtures of the cloud tests: one real local S3 server (moto's ThreadedMotoServer on
127.0.0.1) for the session, a fresh bucket per test, and a fault-injecting TCP proxy."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from ._s3 import FaultProxy, S3Bucket, make_bucket, options_for

_COUNTER = itertools.count()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """The endpoint URL of one moto S3 server for the whole session."""
    pytest.importorskip("obstore", reason="the cloud tests need the 'cloud' extra (obstore)")
    moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (test extra)")
    ThreadedMotoServer = moto_server.ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(moto_endpoint: str) -> S3Bucket:
    """A new, empty bucket on the session's server."""
    name = f"bucket-{next(_COUNTER)}"
    make_bucket(moto_endpoint, name)
    return S3Bucket(moto_endpoint, name, f"s3://{name}", options_for(moto_endpoint))


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    """A TCP proxy in front of the server that counts bytes and can drop connections."""
    p = FaultProxy(moto_endpoint)
    try:
        yield p
    finally:
        p.close()
