"""TensorFlow bundles: damage detection, slice keys, table details; Keras/HDF5: no reach-outs.

The HDF5 oracle is a FIFO standing in for a secret file: opening it for reading
blocks until a writer appears, so a reader that touched it would hang (the child
process would time out), and the parent sees the open as soon as it happens by
polling an ``O_WRONLY | O_NONBLOCK`` open, which succeeds only while someone
has the FIFO open for reading.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptvar.formats._protobuf import parse
from ckptvar.formats._snappy import decompress
from ckptvar.formats._tf_index import decode_slice_key
from ckptvar.storage.checksum import crc32c, mask, unmask

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _copy_tf(tmp: Path, name: str = "tf2_object", prefix: str = "ckpt-1") -> Path:
    for f in (FIXTURES / name).glob(prefix + ".*"):
        shutil.copy(f, tmp / f.name)
    return tmp / prefix


# --------------------------------------------------------------------------- TensorFlow


def test_a_flipped_byte_in_a_tensor_fails_its_crc(tmp_path: Path) -> None:
    prefix = _copy_tf(tmp_path)
    with cv.open(prefix) as reader:
        clean = {k: reader[k].read() for k in reader}
    data = tmp_path / "ckpt-1.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[20] ^= 0x01
    data.write_bytes(bytes(raw))
    damaged = []
    with cv.open(prefix) as reader:
        for key in reader:
            try:
                value = reader[key].read()
            except CorruptCheckpointError as exc:
                assert "CRC32C" in str(exc) and key in str(exc)
                damaged.append(key)
            else:
                np.testing.assert_array_equal(value, clean[key])
        assert len(damaged) == 1
        reader[damaged[0]].read(verify=False)  # opting out returns the bytes as they are
        out = np.empty(reader.info(damaged[0]).shape, reader.info(damaged[0]).dtype)
        with pytest.raises(CorruptCheckpointError):
            reader.read(damaged[0], out=out)


def test_damaged_or_truncated_index_is_refused(tmp_path: Path) -> None:
    prefix = _copy_tf(tmp_path)
    index = tmp_path / "ckpt-1.index"
    good = index.read_bytes()
    index.write_bytes(good[:10] + bytes([good[10] ^ 0x40]) + good[11:])
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        cv.open(prefix)
    index.write_bytes(good[:-5])
    with pytest.raises(CorruptCheckpointError, match="magic"):
        cv.open(prefix, format="tf")
    index.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match="shorter"):
        cv.open(prefix, format="tf")


def test_missing_or_truncated_data_file(tmp_path: Path) -> None:
    prefix = _copy_tf(tmp_path)
    data = tmp_path / "ckpt-1.data-00000-of-00001"
    raw = data.read_bytes()
    data.write_bytes(raw[:300])  # the values come first, the object graph last
    with cv.open(prefix) as reader, pytest.raises(CorruptCheckpointError, match="truncated"):
        for key in reader:
            reader[key].read()
    data.unlink()
    with pytest.raises(CheckpointNotFoundError, match="data file"):
        cv.open(prefix)


def test_every_spelling_of_a_tf_checkpoint_path_opens(tmp_path: Path) -> None:
    prefix = _copy_tf(tmp_path, "tf1_saver", "model.ckpt")
    for path in (prefix, Path(str(prefix) + ".index"),
                 Path(str(prefix) + ".data-00000-of-00001")):
        with cv.open(path) as reader:
            assert reader.format == "tf" and "layer1/weights" in reader


def _encode_signed(v: int) -> bytes:
    """OrderedCode::WriteSignedNumIncreasing, written from its specification."""
    x = ~v if v < 0 else v
    if x < 64:
        return bytes([(0x80 ^ v) & 0xFF])
    length = next(n for n in range(2, 11) if x < 1 << (7 * n - 1))
    buf = bytearray((v & (2**80 - 1)).to_bytes(10, "big"))
    headers = {2: (0xC0, 0), 3: (0xE0, 0), 4: (0xF0, 0), 5: (0xF8, 0), 6: (0xFC, 0),
               7: (0xFE, 0), 8: (0xFF, 0), 9: (0xFF, 0x80), 10: (0xFF, 0xC0)}
    part = buf[10 - length :]
    part[0] ^= headers[length][0]
    part[1] ^= headers[length][1]
    return bytes(part)


@pytest.mark.parametrize(
    "values", [(0, -1), (63, 64), (-64, -65), (8191, 8192), (2**40, -(2**40)),
               (2**63 - 1, -(2**63)), (1000, 7)]
)
def test_slice_keys_decode(values: tuple[int, int]) -> None:
    name = "scope/var\x00\xff"
    key = (b"\x00" + _escape(name.encode("utf-8")) + b"\x00\x01" + b"\x01\x01"
           + _encode_signed(values[0]) + _encode_signed(values[1]))
    assert decode_slice_key(key) == (name, ((values[0], values[1]),))


def _escape(raw: bytes) -> bytes:
    out = bytearray()
    for b in raw:
        out += b"\x00\xff" if b == 0 else b"\xff\x00" if b == 0xFF else bytes([b])
    return bytes(out)


def test_crc_snappy_and_protobuf_helpers() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert unmask(mask(12345)) == 12345
    abc = bytes([12, 0x0C]) + b"abcd" + bytes([0x11, 0x04])
    assert decompress(abc, max_size=100) == b"abcdabcdabcd"
    for bad in (bytes([200, 1]) + b"x", bytes([4, 0x11, 0x09]), bytes([5, 0x10]) + b"hi"):
        with pytest.raises(CorruptCheckpointError):
            decompress(bad, max_size=100)
    with pytest.raises(CorruptCheckpointError, match="limit"):
        decompress(bytes([0xFF, 0xFF, 0xFF, 0x7F]), max_size=100)
    assert parse(b"\x08\x01\x12\x00") == {1: [1], 2: [b""]}
    for bad in (b"\x08", b"\x12\x05ab", b"\x0b", b"\x00\x01", b"\xff" * 11):
        with pytest.raises(CorruptCheckpointError):
            parse(bad)


# --------------------------------------------------------------------------- Keras / HDF5


def test_plain_hdf5_files_not_written_by_ckptvar_are_readable_by_sniffing(tmp_path: Path) -> None:
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        f["a/b"] = np.arange(6, dtype=">f4").reshape(2, 3)
        f.create_dataset("z", data=np.arange(100), compression="gzip", shuffle=True,
                         fletcher32=True, chunks=(10,))
        f["s"] = "a string"
        f["link"] = h5py.SoftLink("/a/b")
    with cv.open(path) as reader:
        assert reader.format == "hdf5"
        assert sorted(reader.keys()) == ["a/b", "z"]
        assert set(reader.skipped) == {"s", "link"}
        np.testing.assert_array_equal(reader["a/b"].read(), np.arange(6).reshape(2, 3))
        assert reader["a/b"].dtype == np.dtype("float32")
        np.testing.assert_array_equal(reader["z"][10:20:3], np.arange(100)[10:20:3])
        np.testing.assert_array_equal(reader["z"][::-7], np.arange(100)[::-7])


def _hostile_h5(tmp: Path, secret: Path) -> dict[str, Path]:
    files = {}
    p = tmp / "extlink.weights.h5"
    with h5py.File(p, "w") as f:
        f["layers/dense/vars/0"] = np.zeros(2, "f4")
        f["layers/dense/vars/1"] = h5py.ExternalLink(str(secret), "/data")
    files["external_link"] = p
    p = tmp / "extstore.h5"
    with h5py.File(p, "w") as f:
        f["ok"] = np.zeros(2)
        f.create_dataset("x", shape=(4,), dtype="f4", external=[(str(secret), 0, 16)])
    files["external_storage"] = p
    p = tmp / "virtual.h5"
    with h5py.File(p, "w") as f:
        layout = h5py.VirtualLayout(shape=(4,), dtype="f4")
        layout[:] = h5py.VirtualSource(str(secret), "data", shape=(4,))
        f.create_virtual_dataset("v", layout)
    files["virtual"] = p
    p = tmp / "legacy_ext.h5"
    with h5py.File(p, "w") as f:
        f.attrs["layer_names"] = np.array([b"dense"])
        g = f.create_group("dense")
        g.attrs["weight_names"] = np.array([b"dense/kernel:0"])
        g["dense"] = h5py.ExternalLink(str(secret), "/")
    files["legacy_external"] = p
    p = tmp / "filter.h5"
    with h5py.File(p, "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((4,))
        dcpl.set_filter(32001, h5py.h5z.FLAG_OPTIONAL, (0,))
        h5py.h5d.create(f.id, b"x", h5py.h5t.NATIVE_FLOAT, h5py.h5s.create_simple((4,)),
                        dcpl=dcpl)
    files["unknown_filter"] = p
    return files


CHILD = r"""
import json, sys
import ckptvar as cv
out = {}
for name, path in json.loads(sys.argv[1]).items():
    for fmt in (None, "hdf5", "keras"):
        try:
            with cv.open(path, format=fmt) as reader:
                [reader[k].read() for k in reader]
            out[f"{name}/{fmt}"] = "loaded"
        except cv.CkptError as exc:
            out[f"{name}/{fmt}"] = type(exc).__name__ + ": " + str(exc)
print(json.dumps(out))
"""


def _run_watching(
    args: list[str], fifo: Path, timeout: float, *, check: bool = True
) -> tuple[str, bool]:
    """Run a child; report its stdout and whether anyone opened ``fifo`` for reading."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    opened = False
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader has it open
            time.sleep(0.01)
            continue
        opened = True
        # the reader may have closed it already, or not drained what was written so far
        with contextlib.suppress(BrokenPipeError, BlockingIOError):
            os.write(fd, b"\0" * 64)
        os.close(fd)
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return "TIMEOUT " + err, opened
    assert proc.returncode == 0 or not check, err
    return out, opened


def test_hdf5_reach_outs_never_open_the_secret_file(tmp_path: Path) -> None:
    import json

    secret = tmp_path / "outside" / "secret"
    secret.parent.mkdir()
    os.mkfifo(secret)
    files = _hostile_h5(tmp_path, secret)
    out, opened = _run_watching(
        [sys.executable, "-c", CHILD, json.dumps({k: str(v) for k, v in files.items()})],
        secret, timeout=60,
    )
    assert not opened
    results = json.loads(out)
    assert len(results) == 15
    for name, outcome in results.items():
        assert outcome.startswith("CorruptCheckpointError"), (name, outcome)
    assert "external link" in results["external_link/None"]
    assert "external file" in results["external_storage/None"]
    assert "virtual" in results["virtual/None"]
    assert "filter 32001" in results["unknown_filter/None"]
    assert "external link" in results["legacy_external/keras"]


def test_positive_control_plain_h5py_does_open_the_secret(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    os.mkfifo(secret)
    path = _hostile_h5(tmp_path, secret)["external_storage"]
    code = f"import h5py; h5py.File({str(path)!r}, 'r')['x'][()]"
    _, opened = _run_watching([sys.executable, "-c", code], secret, timeout=30, check=False)
    assert opened


def test_sharded_checkpoint_reads_from_every_data_file(tmp_path: Path) -> None:
    prefix = _copy_tf(tmp_path, "tf2_sharded", "ckpt")
    shards = sorted(tmp_path.glob("ckpt.data-*"))
    assert len(shards) == 3
    with cv.open(prefix) as reader:
        values = {k: reader[k].read() for k in reader}
    assert sorted(values) == ["net/n", "net/v", "net/w"]
    shards[1].unlink()
    with pytest.raises(CheckpointNotFoundError, match="00001-of-00003"):
        cv.open(prefix)


def _patch_index_block(index: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` in the one data block of a TF ``.index`` table holding it, and restore
    that block's masked CRC32C (what a hostile writer would do)."""
    import struct

    from ckptvar.formats._sstable import _block, _entries, _handle

    data = bytearray(index.read_bytes())
    footer = bytes(data[-48:])
    _, _, pos = _handle(footer, 0, "t")
    index_off, index_size, _ = _handle(footer, pos, "t")
    for _, handle in _entries(_block(bytes(data), index_off, index_size, "t"), "t"):
        off, size, _ = _handle(handle, 0, "t")
        at = data.find(old, off, off + size)
        if at >= 0:
            data[at : at + len(old)] = new
            data[off + size + 1 : off + size + 5] = struct.pack(
                "<I", mask(crc32c(bytes(data[off : off + size + 1])))
            )
            index.write_bytes(bytes(data))
            return
    raise AssertionError(f"{old!r} is in no data block of {index}")


def test_partitioned_slices_that_overlap_are_refused(tmp_path: Path) -> None:
    """Slices were checked by element count only: a variable whose index lists the rows 4..6
    twice and 7..9 never (10 rows either way) opened, and a read returned rows 7..9 as
    whatever bytes the uninitialised buffer held."""
    for f in (FIXTURES / "tf1_saver").iterdir():
        shutil.copy(f, tmp_path / f.name)
    # embedding's third slice, rows [7, 10) (start 7, length 3), now says rows [4, 7)
    _patch_index_block(tmp_path / "model.ckpt.index", b"\x08\x07\x10\x03", b"\x08\x04\x10\x03")
    with pytest.raises(CorruptCheckpointError, match="'embedding'.*overlap"):
        with cv.open(tmp_path / "model.ckpt") as reader:
            reader.read("embedding")
