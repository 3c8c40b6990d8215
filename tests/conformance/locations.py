"""LocationTests: the conformance suite of every location (where checkpoint bytes live).

A location gets the whole suite by subclassing :class:`LocationTests` and filling one
hook, :meth:`LocationTests.make_location` (an empty location for the test);
tests/test_locations.py runs it on a local directory, a ``file://`` URL and S3 (a
real moto server on 127.0.0.1).

The claims: put, stat, read (whole, into a buffer, ranges), list (by prefix, by
directory), delete; a range past the end is damage, never a short read; a create-only
put refuses a second writer; the streaming writer shows nothing before it closes, is
checksummed, aborts on an exception leaving an older object, and copies what it is
given; an opened object is a seekable file.
"""

from __future__ import annotations

import os

import pytest

import ckptvar as cv
from ckptvar.errors import CheckpointExistsError
from ckptvar.locations import Location

__all__ = ["LocationTests"]


class LocationTests:
    """The claims of a location (see the module docstring)."""

    def make_location(self, request: pytest.FixtureRequest) -> Location:
        """An empty location for one test."""
        raise NotImplementedError

    @pytest.fixture
    def loc(self, request: pytest.FixtureRequest) -> Location:
        return self.make_location(request)

    def test_put_stat_read_list_delete(self, loc: Location) -> None:
        loc.put("a/x.bin", b"hello world")
        loc.put("a/b/y.bin", b"12345")
        loc.put("z.bin", b"")
        assert loc.size("a/x.bin") == 11 and loc.exists("a/x.bin") and not loc.exists("a")
        assert loc.read("a/x.bin") == b"hello world"
        out = bytearray(5)
        loc.read_into("a/x.bin", 6, out)
        assert out == b"world"
        assert loc.read_ranges("a/x.bin", [(0, 5), (6, 5), (4, 0)]) == [b"hello", b"world", b""]
        assert [o.key for o in loc.list()] == ["a/b/y.bin", "a/x.bin", "z.bin"]
        assert [o.key for o in loc.list("a/")] == ["a/b/y.bin", "a/x.bin"]
        loc.put("ab.bin", b"not below a/")
        assert [o.key for o in loc.list("a")] == ["a/b/y.bin", "a/x.bin"]
        assert [o.key for o in loc.list("a/b")] == ["a/b/y.bin"]
        loc.delete("ab.bin")
        dirs, objs = loc.list_dir("a")
        assert dirs == ["a/b"] and [(o.key, o.size) for o in objs] == [("a/x.bin", 11)]
        assert loc.delete_prefix("a") == 2
        loc.delete(["z.bin", "never-existed"])
        assert loc.list() == []
        with pytest.raises(cv.CheckpointNotFoundError, match="x.bin"):
            loc.read("a/x.bin")
        with pytest.raises(cv.CheckpointNotFoundError):
            loc.stat("a/x.bin")


    def test_short_range_is_corrupt_not_short(self, loc: Location) -> None:
        loc.put("k", b"0123456789")
        with pytest.raises(cv.CorruptCheckpointError, match="k"):
            loc.read_into("k", 8, bytearray(4))


    def test_create_only_put(self, loc: Location) -> None:
        loc.put("m", b"first", create_only=True)
        with pytest.raises(CheckpointExistsError, match="m"):
            loc.put("m", b"second", create_only=True)
        assert loc.read("m") == b"first"
        assert isinstance(CheckpointExistsError("x"), cv.CkptError)


    def test_streaming_writer_is_atomic_and_checksummed(self, loc: Location) -> None:
        import crc32c

        part = 5 * 1024 * 1024  # the S3 minimum part size
        payload = os.urandom(3 * part + 1234)
        with loc.open_writer("big.bin", part_size=part, max_concurrency=2) as w:
            for i in range(0, len(payload), 1 << 20):
                w.write(payload[i : i + (1 << 20)])
            assert not loc.exists("big.bin")  # nothing visible before close
        assert w.crc32c == crc32c.crc32c(payload) and w.bytes_written == len(payload)
        assert loc.size("big.bin") == len(payload)
        got = bytearray(len(payload))
        loc.read_into("big.bin", 0, got)
        assert got == payload
        # An exception inside the block aborts: nothing appears, an older object stays.
        with pytest.raises(RuntimeError), loc.open_writer("big.bin", part_size=part) as w2:
            w2.write(b"x" * (2 * part + 1))
            raise RuntimeError("stop")
        assert loc.size("big.bin") == len(payload)
        with pytest.raises(RuntimeError), loc.open_writer("new.bin", part_size=part) as w3:
            w3.write(b"y" * (2 * part + 1))
            raise RuntimeError("stop")
        assert not loc.exists("new.bin") and [o.key for o in loc.list()] == ["big.bin"]


    def test_writer_copies_what_it_is_given(self, loc: Location) -> None:
        """A caller may reuse its buffer as soon as write() returns (as with any file)."""
        part = 5 * 1024 * 1024
        buf = bytearray(part)
        expected = bytearray()
        with loc.open_writer("reuse.bin", part_size=part, max_concurrency=4) as w:
            for i in range(4):
                buf[:] = bytes([i + 1]) * part
                w.write(buf)
                expected += buf
        got = bytearray(len(expected))
        loc.read_into("reuse.bin", 0, got)
        assert got == expected


    def test_open_file_is_seekable(self, loc: Location) -> None:
        loc.put("f", bytes(range(256)) * 100)
        with loc.open_file("f", buffer_size=4096) as f:
            f.seek(1000)
            assert f.read(4) == bytes([1000 % 256, 1001 % 256, 1002 % 256, 1003 % 256])
            f.seek(-2, os.SEEK_END)
            assert f.read() == bytes([254, 255])
