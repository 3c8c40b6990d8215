"""Reads of foreign files that cover a whole value are checked against the stored checksum.

Lazy reads (``reader[key][...]``) of torch, npz and TensorFlow values, and every
view of a torch storage shared by several tensors, fail on damaged bytes;
``verify_all`` and ``ckpt verify`` report each damaged key.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import CorruptCheckpointError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SHARED = ["shared.base", "shared.transposed", "shared.column", "shared.row_offset",
          "shared.every_other"]


def _member_data_offset(path: Path, name: str) -> int:
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))


def _damaged_torch(tmp: Path, member: str, at: int) -> Path:
    path = tmp / "damaged.pt"
    shutil.copy(FIXTURES / "torch" / "state_dict.pt", path)
    _flip(path, _member_data_offset(path, member) + at)
    return path


def test_every_view_of_a_damaged_shared_storage_fails(tmp_path: Path) -> None:
    with cv.open(FIXTURES / "torch" / "state_dict.pt") as reader:
        clean = {k: reader[k].read() for k in SHARED}
    path = _damaged_torch(tmp_path, "state_dict/data/19", 4 * 23 + 2)  # the last element
    with cv.open(path) as reader:
        for key in SHARED:
            assert reader.info(key).checksum is not None
            with pytest.raises(CorruptCheckpointError, match="CRC-32"):
                reader[key].read()
            with pytest.raises(CorruptCheckpointError, match="CRC-32"):
                reader[key][...]
            with pytest.raises(CorruptCheckpointError, match="CRC-32"):
                reader.read(key, out=np.empty(reader.info(key).shape, reader.info(key).dtype))
        # The element damaged is in base and transposed only; the others' own bytes are intact.
        np.testing.assert_array_equal(reader["shared.column"].read(verify=False),
                                      clean["shared.column"])
        assert sorted(k for k, _ in reader.verify_all()) == sorted(SHARED)
        with pytest.raises(CorruptCheckpointError):
            cv.load(path)
    proc = subprocess.run(
        [sys.executable, "-m", "ckptvar", "verify", str(path)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAILED: {len(SHARED)} of" in proc.stdout
    for key in SHARED:
        assert f"DAMAGED  {key}:" in proc.stdout


def test_views_of_an_intact_shared_storage_read_as_before() -> None:
    with cv.open(FIXTURES / "torch" / "state_dict.pt") as reader:
        base = reader["shared.base"].read()
        np.testing.assert_array_equal(reader["shared.transposed"].read(), base.T)
        np.testing.assert_array_equal(reader["shared.column"][...], base[:, 2])
        np.testing.assert_array_equal(reader["shared.row_offset"].read(), base[3])
        np.testing.assert_array_equal(reader["shared.every_other"][:, 1], base[::2, 1::3][:, 1])
        assert reader.verify_all() == []
