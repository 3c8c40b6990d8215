"""Every reader of another tool's files runs the ReaderTests conformance suite on real
fixtures made by the producing libraries (fixtures/manifest.json)."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import h5py
import numpy as np
from conformance.readers import ReaderTests, flip, sha256

import ckptvar as cv


def _member_data_offset(path: Path, name: str) -> int:
    """Where the bytes of zip member ``name`` start (after its local header)."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


class TestTF2Object(ReaderTests):
    fixture, fmt, checksummed = "tf2_object/ckpt-1", "tf", True

    def damaged(self, tmp: Path) -> tuple[Path, str | None]:
        prefix = self.source(tmp)
        with cv.open(prefix) as reader:
            offset = reader["model/dense/kernel"]._offset  # where the (4, 3) value's bytes are
        flip(tmp / "ckpt-1.data-00000-of-00001", offset + 4 * 3 * 3 + 2)  # in its last row
        return prefix, "model/dense/kernel"


class TestTF1Saver(ReaderTests):
    fixture, fmt = "tf1_saver/model.ckpt", "tf"


class TestTFSharded(ReaderTests):
    fixture, fmt = "tf2_sharded/ckpt", "tf"


class TestTFNames(ReaderTests):
    fixture, fmt = "tf2_names/ckpt-1", "tf"

    def damaged(self, tmp: Path) -> tuple[Path, str | None]:
        # the object graph (a string, after the values) is most of the data file: cutting
        # it in half leaves every value whole, so cut into the values
        prefix = self.source(tmp)
        data = tmp / "ckpt-1.data-00000-of-00001"
        data.write_bytes(data.read_bytes()[:16])
        return prefix, None


class TestTFExperimentalDtypes(ReaderTests):
    fixture, fmt = "tf2_names/dtypes", "tf"


class TestTorchZip(ReaderTests):
    fixture, fmt, checksummed = "torch/state_dict.pt", "torch", True

    def damaged(self, tmp: Path) -> tuple[Path, str | None]:
        path = self.source(tmp)
        flip(path, _member_data_offset(path, "state_dict/data/0") + 4 * 11 + 1)
        return path, "0.weight"


class TestTorchNested(ReaderTests):
    fixture, fmt = "torch/nested.pth", "torch"


class TestTorchLegacy(ReaderTests):
    fixture, fmt = "torch/legacy.bin", "torch"


class TestSafetensors(ReaderTests):
    fixture, fmt = "safetensors/model.safetensors", "safetensors"


class TestNpz(ReaderTests):
    fixture, fmt, checksummed = "npz/plain.npz", "npz", True

    def damaged(self, tmp: Path) -> tuple[Path, str | None]:
        path = self.source(tmp)
        start = _member_data_offset(path, "weights.npy")
        (hlen,) = struct.unpack_from("<H", path.read_bytes(), start + 8)
        flip(path, start + 10 + hlen + 4 * 3 * 4 + 1)  # in row 4 of the (5, 3) float32 array
        return path, "weights"


class TestNpzCompressed(ReaderTests):
    fixture, fmt = "npz/compressed.npz", "npz"


class TestKerasArchive(ReaderTests):
    fixture, fmt = "keras/tiny.keras", "keras"


class TestKerasWeights(ReaderTests):
    fixture, fmt = "keras/tiny.weights.h5", "keras"


class TestKerasLegacyH5(ReaderTests):
    fixture, fmt = "keras/tiny_legacy.h5", "keras"


class TestHFSharded(ReaderTests):
    fixture, fmt = "hf_sharded", "hf-safetensors"


class TestDcpSingle(ReaderTests):
    fixture, fmt = "dcp/single", "dcp"


class TestDcpTwoRanks(ReaderTests):
    fixture, fmt = "dcp/two_ranks", "dcp"


class TestOrbaxZarr(ReaderTests):
    fixture, fmt = "orbax/zarr_step", "orbax"


class TestOrbaxOcdbt(ReaderTests):
    fixture, fmt = "orbax/ocdbt_run/5", "orbax"


class TestOrbaxRunStep2(ReaderTests):
    fixture, fmt = "orbax/run/2", "orbax"


class TestOrbaxRunStep10(ReaderTests):
    fixture, fmt = "orbax/run/10", "orbax"


class TestOrbaxNames(ReaderTests):
    fixture, fmt = "orbax/names_step", "orbax"


class TestOrbaxZarr3(ReaderTests):
    fixture, fmt = "orbax/zarr3_step", "orbax"


class TestOrbaxOcdbtZarr3(ReaderTests):
    fixture, fmt = "orbax/ocdbt_zarr3_step", "orbax"


class TestGenericHDF5(ReaderTests):
    """Any HDF5 file ckptvar did not write, made here by h5py (no manifest entry)."""

    fixture, fmt = "plain.h5", "hdf5"
    VALUES = {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
              "g/b": np.arange(5, dtype=np.int64), "s": np.float64(2.5)}

    def source(self, tmp: Path) -> Path:
        path = tmp / self.fixture
        with h5py.File(path, "w") as f:
            for key, value in self.VALUES.items():
                f[key] = value
        return path

    def expected(self) -> dict[str, tuple[tuple[int, ...], str, str]]:
        return {k: (np.shape(v), str(np.asarray(v).dtype), sha256(np.asarray(v)))
                for k, v in self.VALUES.items()}


def test_every_fixture_runs_the_reader_suite() -> None:
    from conformance.readers import MANIFEST

    covered = {cls.fixture for cls in ReaderTests.__subclasses__()}
    assert set(MANIFEST) <= covered
    formats = {cls.fmt for cls in ReaderTests.__subclasses__()}
    assert formats == {"tf", "torch", "safetensors", "npz", "keras", "hdf5", "hf-safetensors",
                       "dcp", "orbax"}


def test_a_named_pipe_or_device_is_refused_not_waited_on(tmp_path: Path) -> None:
    """``ckpt inspect`` of a FIFO (or ``/dev/zero``) used to block forever: opening a pipe
    waits for a writer, and sniffing a device reads without end."""
    import os
    import subprocess
    import sys

    import pytest

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    named = tmp_path / "pipe.pt"
    os.mkfifo(named)
    for path, fmt in ((fifo, None), (named, None), (fifo, "torch"), (Path("/dev/zero"), None)):
        with pytest.raises(cv.UnsupportedFormatError, match="not a regular file"):
            cv.open(path, format=fmt)
    for path in (fifo, named, "/dev/zero"):
        proc = subprocess.run([sys.executable, "-m", "ckptvar.cli", "inspect", str(path)],
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2 and str(path) in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


_READ_ALL = (
    "import sys, ckptvar as cv\n"
    "try:\n"
    "    with cv.open(sys.argv[1]) as r:\n"
    "        [r.read(k) for k in r]\n"
    "    print('read')\n"
    "except cv.CkptError as e:\n"
    "    print('refused:', e)\n"
)


def test_a_pipe_inside_a_checkpoint_folder_is_refused_not_waited_on(tmp_path: Path) -> None:
    """An Orbax chunk that is a named pipe made every read block for ever (a pipe's open
    waits for a writer); a DCP data file that is one is refused too."""
    import os
    import shutil
    import subprocess
    import sys

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    dcp = tmp_path / "dcp"
    shutil.copytree(fixtures / "dcp" / "two_ranks", dcp)
    orbax = tmp_path / "orbax"
    shutil.copytree(fixtures / "orbax" / "zarr_step", orbax)
    victims = [dcp / "__1_0.distcp", next(p for p in (orbax / "params.embed").iterdir()
                                           if not p.name.startswith("."))]
    for victim in victims:
        victim.unlink()
        os.mkfifo(victim)
    for folder, victim in zip((dcp, orbax), victims, strict=True):
        proc = subprocess.run([sys.executable, "-c", _READ_ALL, str(folder)],
                              capture_output=True, text=True, timeout=20, check=False)
        assert proc.stdout.startswith("refused:") and victim.name in proc.stdout, (
            proc.stdout + proc.stderr)
    assert "is a named pipe, not a regular file" in proc.stdout  # the Orbax chunk
