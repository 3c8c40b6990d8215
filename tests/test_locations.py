"""Every location runs the LocationTests conformance suite: a local directory, a ``file://``
URL, and S3 on a real moto server (127.0.0.1)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from cloud._s3 import S3Bucket, make_bucket, options_for
from conformance.locations import LocationTests

from ckptvar.locations import LocalLocation, Location, open_location

_BUCKETS = itertools.count()


@pytest.fixture(scope="module")
def moto() -> Iterator[str]:
    """One moto S3 server for this module's tests."""
    pytest.importorskip("obstore", reason="the S3 location needs the 'cloud' extra (obstore)")
    server_mod = pytest.importorskip("moto.server", reason="needs moto[server] (test extra)")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


class TestLocalLocation(LocationTests):
    def make_location(self, request: pytest.FixtureRequest) -> Location:
        tmp: Path = request.getfixturevalue("tmp_path")
        return LocalLocation(tmp / "root")


class TestFileURLLocation(LocationTests):
    def make_location(self, request: pytest.FixtureRequest) -> Location:
        tmp: Path = request.getfixturevalue("tmp_path")
        (tmp / "root").mkdir()
        loc = open_location(f"file://{tmp / 'root'}")
        assert isinstance(loc, LocalLocation)
        return loc


class TestS3Location(LocationTests):
    def make_location(self, request: pytest.FixtureRequest) -> Location:
        endpoint: str = request.getfixturevalue("moto")
        name = f"loc-{next(_BUCKETS)}"
        make_bucket(endpoint, name)
        return S3Bucket(endpoint, name, f"s3://{name}", options_for(endpoint)).location("root")
