"""Hostile inputs across formats: huge declared sizes, names, symlinks, terminal escapes.

What the format owners' own tests do not cover, checked across every parser we own:

- a small file declaring an enormous value (native record, safetensors header, .npy
  header in an .npz) is refused with a ``CkptError`` before anything that size is
  allocated (tracemalloc peak and RSS stay flat);
- awkward names (``..``, absolute, NUL, backslashes, empty segments, Unicode
  normalisation and case twins, Zarr metadata names, the reserved ``_ckptvar``)
  round-trip exactly or are refused, and nothing is written outside the target path;
- a symlink planted inside a Zarr store is never followed, and saving over a path that
  is a symlink replaces the link rather than writing through it;
- ``ckpt inspect`` / ``verify`` / ``ls`` print control characters escaped.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
import unicodedata
import zipfile
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.storage import _record
from ckptvar.storage import checksum as _checksum

MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def refused_flat(fn, *args):  # type: ignore[no-untyped-def]
    """``fn(*args)`` raises a CkptError with at most a few MiB allocated on the way."""
    rss0 = _rss() if os.path.exists("/proc/self/statm") else 0
    tracemalloc.start()
    try:
        with pytest.raises(cv.CkptError) as info:
            fn(*args)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MiB, f"{peak} bytes allocated while refusing: {info.value}"
    if rss0:
        assert _rss() - rss0 < 64 * MiB
    return info.value


def load_all(path: Path) -> dict[str, np.ndarray]:
    return cv.load(path)


# --------------------------------------------------------------------------- huge sizes


def _rewrite_native_record(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Change the root record of a native checkpoint and re-checksum it (a forger's file)."""
    if path.is_dir():
        rec_file = next((path / "_ckptvar" / "record").glob("c*"))
        raw = rec_file.read_bytes()
        rec = _record.decode(raw, path, container="zarr")
        edit(rec)
        new = _record.encode(rec)
        rec_file.write_bytes(new)
        meta = json.loads((path / "zarr.json").read_text())
        meta["attributes"]["ckptvar"]["record_nbytes"] = len(new)
        meta["attributes"]["ckptvar"]["record_crc32c"] = _checksum.crc(new)
        (path / "zarr.json").write_text(json.dumps(meta))
        return
    from ckptvar.storage._h5 import make_userblock, read_userblock

    fd = os.open(path, os.O_RDONLY)
    try:
        _, _, off, n, _ = read_userblock(fd, path)
    finally:
        os.close(fd)
    data = path.read_bytes()
    rec = _record.decode(data[off: off + n], path, container="h5")
    edit(rec)
    new = _record.encode(rec)
    with open(path, "r+b") as f:
        f.seek(len(data))
        f.write(new)
        f.seek(0)
        f.write(make_userblock(len(data), new))


def _set_shape(rec: _record.Record, key: str, shape: tuple[int, ...]) -> None:
    import dataclasses

    rec.values[key] = dataclasses.replace(rec.values[key], shape=shape)


HUGE = {
    "2^40 elements": (1 << 40,),
    "2^20 x 2^20": (1 << 20, 1 << 20),
    "2^31 - 1 elements": ((1 << 31) - 1,),
    "overflowing product": (1 << 31, 1 << 31, 1 << 31),
}


def _huge_params() -> list[object]:
    out = []
    for fmt in ("h5", "zarr"):
        for key in ("w", "s"):  # a value of its own, and a packed one
            for shape in HUGE:
                out.append(pytest.param(fmt, key, shape, id=f"{fmt}-{key}-{shape}"))
    return out


@pytest.mark.parametrize(("format_", "key", "shape"), _huge_params())
def test_native_record_declaring_a_huge_value(format_: str, tmp_path: Path, shape: str,
                                              key: str) -> None:
    """A re-checksummed record that declares a huge shape is refused, memory flat."""
    p = cv.save(tmp_path / f"x.{format_}", {"w": np.ones(20000, np.float32), "s": np.ones(3)})
    _rewrite_native_record(Path(p), lambda r: _set_shape(r, key, HUGE[shape]))
    refused_flat(load_all, p)
    refused_flat(cv.load_variable, p, key)
    with _opened(p) as r:  # lazy slicing refuses too (when opening did not already)
        if r is not None:
            refused_flat(lambda: r[key][0:2])


class _opened:
    """cv.open that may already refuse (then the body gets None)."""

    def __init__(self, p: Path) -> None:
        self.p = p
        self.r = None

    def __enter__(self):  # type: ignore[no-untyped-def]
        try:
            self.r = cv.open(self.p)
        except cv.CkptError:
            self.r = None  # refused; the caller sees None
        return self.r

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        if self.r is not None:
            self.r.close()


def test_h5_user_block_declaring_a_huge_record(tmp_path: Path) -> None:
    from ckptvar.storage._h5 import _UB, MAGIC

    p = cv.save(tmp_path / "x.h5", {"w": np.ones(3)})
    for off, n in [(512, 1 << 40), (1 << 62, 100), (512, (1 << 30) + 1)]:
        head = _UB.pack(MAGIC, 1, 0, off, n, 0)
        head += struct.pack("<I", _checksum.crc(head))
        with open(p, "r+b") as f:
            f.write(head)
        refused_flat(load_all, p)


def _safetensors(header: dict, data: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize("case", [
    {"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]}},
    {"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 8]}},
    {"w": {"dtype": "F32", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 8]}},
    {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}},
    {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 1 << 62]}},
], ids=["huge-offsets", "huge-shape", "overflow", "negative", "offset-past-end"])
def test_safetensors_header_declaring_huge_values(tmp_path: Path, case: dict) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(_safetensors(case, b"\0" * 8))
    refused_flat(load_all, p)


def test_safetensors_header_length_huge(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    refused_flat(load_all, p)


def _npy(header: str, payload: bytes = b"") -> bytes:
    h = header.encode("latin1")
    h += b" " * (-(len(h) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + payload


@pytest.mark.parametrize("header", [
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1048576, 1048576), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (-5,), }",
    "{'descr': '|O', 'fortran_order': False, 'shape': (2,), }",
    "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "1, " * 5000 + "), }",
], ids=["2^40", "2^20x2^20", "negative", "object", "structured", "deep-shape"])
@pytest.mark.parametrize("compressed", [False, True])
def test_npz_member_declaring_huge_or_unsafe_values(tmp_path: Path, header: str,
                                                    compressed: bool) -> None:
    p = tmp_path / "x.npz"
    method = zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED
    with zipfile.ZipFile(p, "w", method) as zf:
        zf.writestr("w.npy", _npy(header, b"\0" * 16))
    if "'|O'" in header or "[(" in header:  # not numbers: listed in skipped, never read
        with cv.open(p) as reader:
            assert list(reader) == [] and "refused" in reader.skipped["w"]
        return
    refused_flat(load_all, p)


def test_npz_encrypted_member(tmp_path: Path) -> None:
    """A member flagged "encrypted" (found by the npz fuzz harness) is a CkptError."""
    p = tmp_path / "enc.npz"
    np.savez_compressed(p, w=np.arange(4.0))
    data = bytearray(p.read_bytes())
    for sig, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # local, central headers
        i = data.find(sig)
        data[i + flag_at] |= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(cv.CkptError):
        cv.load(p)


def test_npz_zip_bomb_is_refused_flat(tmp_path: Path) -> None:
    """A deflated member that expands far beyond what its header promises."""
    p = tmp_path / "bomb.npz"
    payload = _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", b"\0" * (64 * MiB))
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("w.npy", payload)
    assert p.stat().st_size < 2 * MiB
    refused_flat(load_all, p)


# --------------------------------------------------------------------------- names

NAMES = [
    "..", "../escape", "a/../../b", "/abs/path", "/", "nul\0byte", "back\\slash", "a//b", "a/",
    "/a", "", ".", "./x", "zarr.json", "a/zarr.json", ".zattrs", ".zarray", ".zgroup",
    "c", "c.0", "w/c", "_ckptvar", "_ckptvar/record", "__x", "%2E", "%z", "%t1", "a%2Fb",
    "caf\u00e9", "cafe\u0301", "CASE", "case", "Case", "\u212b", "\u00c5", "x" * 300,
    "emoji/\U0001f600", "tab\there", "new\nline", "\x1b[31mred", "con", "aux.txt", " lead",
    "trail ", "\u202eevil", "\ufeffbom",
]


def _outside_snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_awkward_names_round_trip_or_are_refused(fmt: str, tmp_path: Path) -> None:
    """Every awkward key round-trips exactly (both formats); nothing lands outside."""
    work = tmp_path / "w"
    work.mkdir()
    arrays = {name: np.full(3, i, np.int32) for i, name in enumerate(NAMES)}
    before = _outside_snapshot(tmp_path)
    target = work / f"names.{fmt}"
    try:
        cv.save(target, arrays)
    except (cv.CkptError, ValueError) as exc:  # refusing as a whole is allowed
        assert _outside_snapshot(tmp_path) == before, "a refused save left files behind"
        pytest.skip(f"{fmt} refuses this set of names: {exc}")
    after = _outside_snapshot(tmp_path)
    new = after - before
    assert all(n == f"w/names.{fmt}" or n.startswith(f"w/names.{fmt}/") for n in new), (
        sorted(n for n in new if not n.startswith(f"w/names.{fmt}"))
    )
    for p in (tmp_path.rglob("*") if fmt == "zarr" else []):  # nothing resolves outside
        assert Path(os.path.realpath(p)).is_relative_to(tmp_path.resolve())
    got = cv.load(target)
    assert set(got) == set(NAMES), sorted(set(NAMES) ^ set(got))
    for name, arr in arrays.items():
        assert got[name].tobytes() == arr.tobytes(), name
    # the twins stay distinct values, in the file and in listings
    listed = [k for k, _, _ in cv.list_variables(target)]
    assert sorted(listed) == sorted(NAMES)
    assert unicodedata.normalize("NFC", "cafe\u0301") == "caf\u00e9"  # they are twins


def test_awkward_names_through_the_object_graph(fresh_graph: cv.Graph, fmt: str,
                                                tmp_path: Path) -> None:
    """Dict keys of a checkpointed object are path segments: they round-trip too."""
    names = [n for n in NAMES if "/" not in n and n and "\0" not in n]
    table = {n: cv.Variable(np.full(2, i, np.float32)) for i, n in enumerate(names)}
    ck = cv.Checkpoint(table=table)
    p = ck.write(tmp_path / f"g.{fmt}")
    fresh = {n: cv.Variable(np.zeros(2, np.float32)) for n in names}
    cv.Checkpoint(table=fresh).restore(p).assert_consumed()
    for i, n in enumerate(names):
        assert fresh[n].numpy().tolist() == [i, i], n
    assert {q.name for q in tmp_path.iterdir()} == {f"g.{fmt}"}


# --------------------------------------------------------------------------- symlinks


@pytest.fixture
def zarr_ckpt(tmp_path: Path) -> Path:
    return Path(cv.save(tmp_path / "c.zarr", {"model/w": np.arange(20000, dtype=np.float32),
                                              "b": np.ones(3)}, pack_threshold=64 << 10))


def _secret(tmp_path: Path, nbytes: int) -> Path:
    s = tmp_path / "outside" / "secret.bin"
    s.parent.mkdir()
    s.write_bytes(b"S" * nbytes)
    return s


def test_symlinked_chunk_is_not_followed(zarr_ckpt: Path, tmp_path: Path) -> None:
    chunk = next((zarr_ckpt / "model" / "w").glob("c*"))
    secret = _secret(tmp_path, chunk.stat().st_size)
    chunk.unlink()
    chunk.symlink_to(secret)
    exc = refused_flat(load_all, zarr_ckpt)
    assert "'model/w'" in str(exc)
    with cv.open(zarr_ckpt) as r:
        with pytest.raises(cv.CkptError):
            r["model/w"][0:3]


def test_symlinked_directory_is_not_followed(zarr_ckpt: Path, tmp_path: Path) -> None:
    secret_dir = tmp_path / "outside"
    (zarr_ckpt / "model").rename(secret_dir)  # the real bytes now live outside
    (zarr_ckpt / "model").symlink_to(secret_dir, target_is_directory=True)
    refused_flat(load_all, zarr_ckpt)


@pytest.mark.parametrize("inner", ["_ckptvar/record", "_ckptvar/packed", "_ckptvar"])
def test_symlinked_record_or_packed_is_not_followed(zarr_ckpt: Path, tmp_path: Path,
                                                    inner: str) -> None:
    target = zarr_ckpt / inner
    moved = tmp_path / ("moved-" + inner.replace("/", "-"))
    target.rename(moved)
    target.symlink_to(moved, target_is_directory=True)
    refused_flat(load_all, zarr_ckpt)


def test_saving_over_a_symlink_replaces_the_link(fmt: str, tmp_path: Path) -> None:
    """``save(path)`` where ``path`` is a symlink to elsewhere never writes through it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / f"keep.{fmt}"
    cv.save(victim, {"v": np.ones(2)})
    before = {p: p.stat().st_mtime_ns for p in elsewhere.rglob("*")}
    link = tmp_path / f"link.{fmt}"
    link.symlink_to(victim, target_is_directory=(fmt == "zarr"))
    cv.save(link, {"w": np.zeros(3)})
    assert not link.is_symlink()
    assert set(cv.load(link)) == {"w"}
    assert {p: p.stat().st_mtime_ns for p in elsewhere.rglob("*")} == before
    assert set(cv.load(victim)) == {"v"}


# --------------------------------------------------------------------------- terminal escapes

EVIL = ["\x1b[2J\x1b[31mred", "bell\x07", "cr\roverwrite", "bidi\u202eevil", "nul-ish\x00x",
        "del\x7f", "c1\x9bcsi", "zw\u200bspace"]


def ckpt(*args: str | Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "ckptvar", *map(str, args)],
                          capture_output=True, timeout=60,
                          env=dict(os.environ, PYTHONWARNINGS="error", COLUMNS="200"))


def _clean(out: bytes) -> None:
    text = out.decode("utf-8")
    bad = sorted({hex(ord(c)) for c in text
                  if (unicodedata.category(c) in ("Cc", "Cf") and c != "\n")})
    assert not bad, f"raw control/format characters in output: {bad}"


def _main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, bytes, bytes]:
    from ckptvar.cli import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out.encode(), out.err.encode()


def test_ckpt_commands_escape_control_characters(fmt: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    arrays = {name: np.ones(2) for name in EVIL}
    d = tmp_path / "runs"
    d.mkdir()
    p = cv.save(d / f"ckpt-1.{fmt}", arrays,
                metadata={"note\x1b]0;title\x07": "v\x1b[1mbold\r", "k": ["\u202e"]})
    proc = ckpt("inspect", p)  # once through a real process and its stdout
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    _clean(proc.stdout)
    _clean(proc.stderr)
    for args in (["inspect", p, "--tree"], ["inspect", p, "--stats"], ["verify", p],
                 ["ls", d], ["diff", p, p]):
        code, out, err = _main(capsys, *args)
        assert code == 0, (args, err)
        _clean(out)
        _clean(err)
    code, out, _ = _main(capsys, "inspect", p, "--json")
    _clean(out)
    doc = json.loads(out)
    assert sorted(v["key"] for v in doc["variables"]) == sorted(EVIL)
    # a hostile file name is escaped too
    evil_path = tmp_path / f"evil\x1b[31m.{fmt}"
    os.rename(p, evil_path)
    for args in (["inspect", evil_path], ["verify", evil_path], ["inspect", tmp_path / "no\x1bpe"]):
        _, out, err = _main(capsys, *args)
        _clean(out)
        _clean(err)
