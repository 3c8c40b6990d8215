"""The native backends (HDF5, Zarr v3) run the BackendTests conformance suite, plus their own."""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conformance.backends import BackendTests

from ckptvar.errors import CorruptCheckpointError, UnsupportedFormatError
from ckptvar.storage import backend_for
from ckptvar.storage._h5 import read_userblock


class TestH5Backend(BackendTests):
    fmt = "h5"
    suffix = ".h5"
    max_files_for_small_values = 1

    def value_at(self, path: Path, key: str) -> tuple[Path, int]:
        with self.reader(path) as r:
            e = r.entry(key)
            base = r.packed_source()[1] if e.loc.kind == "packed" else 0
        return path, base + e.loc.offset

    def record_at(self, path: Path) -> tuple[Path, int, int]:
        fd = os.open(path, os.O_RDONLY)
        try:
            _, _, off, n, _ = read_userblock(fd, path)
        finally:
            os.close(fd)
        return path, off, n

    def test_foreign_hdf5_is_not_ours(self, tmp_path: Path) -> None:
        import h5py

        from ckptvar.storage._h5 import H5Backend, H5Reader

        p = tmp_path / "plain.h5"
        with h5py.File(p, "w") as f:
            f["x"] = np.ones(3)
        assert not H5Backend.sniff(p)
        try:  # handed to another registered reader (generic HDF5), or refused
            reader = H5Backend.open_reader(p)
        except UnsupportedFormatError as exc:
            assert "did not write" in str(exc)
        else:
            assert not isinstance(reader, H5Reader)
            reader.close()

    def test_compression_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(UnsupportedFormatError, match="zarr"):
            backend_for(self.path(tmp_path), mode="w").open_writer(
                self.path(tmp_path), compression="zstd")


class TestZarrBackend(BackendTests):
    fmt = "zarr"
    suffix = ".zarr"
    max_files_for_small_values = 9

    def value_at(self, path: Path, key: str) -> tuple[Path, int]:
        with self.reader(path) as r:
            e = r.entry(key)
        if e.loc.kind == "packed":
            return path / "_ckptvar" / "packed" / "c.0", e.loc.offset
        return path / str(e.loc.path) / "c.0", 0

    def record_at(self, path: Path) -> tuple[Path, int, int]:
        f = path / "_ckptvar" / "record" / "c.0"
        return f, 0, f.stat().st_size

    def test_deleted_chunk_is_caught(self, tmp_path: Path) -> None:
        p = self.write(self.path(tmp_path), {"w": np.ones((300, 300)), "s": np.ones(2)})
        (p / "w" / "c.0.0").unlink()
        with self.reader(p) as r:
            with pytest.raises(CorruptCheckpointError, match="chunk"):
                r.read("w")
            assert [k for k, _ in r.verify_all()] == ["w"]
            np.testing.assert_array_equal(r.read("s"), np.ones(2))

    def test_symlinked_chunk_is_refused(self, tmp_path: Path) -> None:
        secret = tmp_path / "secret.bin"
        secret.write_bytes(b"s" * 8 * 300 * 300)
        p = self.write(self.path(tmp_path), {"w": np.ones((300, 300))})
        chunk = p / "w" / "c.0.0"
        chunk.unlink()
        chunk.symlink_to(secret)
        with self.reader(p) as r, pytest.raises(CorruptCheckpointError, match="symlink"):
            r.read("w")

    @pytest.mark.parametrize("codec", ["zstd", "gzip", "blosc"])
    def test_opt_in_compression_uses_zarr_codecs(self, tmp_path: Path, codec: str) -> None:
        import zarr

        v = np.zeros((400, 400), np.float32)
        v[::7] = 1
        bf = np.ones((300, 300), ml_dtypes.bfloat16)
        p = self.write(self.path(tmp_path), {"w": v, "bf": bf, "s": np.ones(3)},
                       compression=codec)
        assert (p / "w" / "c.0.0").stat().st_size < v.nbytes // 4
        with self.reader(p) as r:
            np.testing.assert_array_equal(r.read("w"), v)
            assert r.read("bf").dtype == bf.dtype
            np.testing.assert_array_equal(r["w"][3:9], v[3:9])
        np.testing.assert_array_equal(zarr.open_group(p, mode="r")["w"][...], v)
        (p / "w" / "c.0.0").unlink()
        with self.reader(p) as r, pytest.raises(CorruptCheckpointError, match="chunk"):
            r.read("w")

    def test_plain_zarr_dir_is_not_ours(self, tmp_path: Path) -> None:
        import zarr

        p = tmp_path / "plain.zarr"
        zarr.open_group(p, mode="w").create_array("x", shape=(3,), dtype="f4")
        with pytest.raises(UnsupportedFormatError, match="not a ckptvar"):
            backend_for(p).open_reader(p)
