"""NumPy ``.npz`` archives: a reader that never unpickles, and an atomic writer.

Owns: the ``npz`` backend and ``.npy`` header parsing. Each ``<key>.npy``
member's header (magic, version 1/2/3, a Python-literal dict with ``descr``,
``fortran_order``, ``shape``) is parsed with ``ast.literal_eval`` and checked:
only plain numeric/bool dtypes are accepted (object, structured, string and
datetime arrays are refused, so nothing is ever unpickled), the declared size
must match the member size, and deflated members are refused as zip bombs when
their declared size is impossible for their compressed size. Stored members
are read in place (only the rows a slice needs); deflated ones are decompressed
as a stream, never beyond their declared size.

bfloat16 (and the ml_dtypes float8 types) have no ``.npy`` spelling that NumPy
can read back, so the writer stores their raw bits as unsigned integers
(``<u2``/``|u1``) and records the real dtype in a ``__ckptvar__.json`` member;
ckptvar reads them back as bfloat16, and NumPy users get the bits
(``np.load(f)["k"].view(ml_dtypes.bfloat16)``).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._dtypes import SUPPORTED_DTYPES, dtype_to_str, str_to_dtype
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..storage.base import ArrayInfo, Backend, LazyArray, Reader
from ..storage.chunked import is_chunked
from ._common import (
    CollectingWriter,
    EntryReader,
    FileArray,
    FileHandle,
    check_key_utf8,
    check_shape,
    little_endian,
)
from ._json import jsonable, loads_json
from ._zip import (
    MAX_DEFLATE_RATIO,
    ZIP_ERRORS,
    ZipArchive,
    read_member_range,
    unsafe_name,
    zip_crc_check,
    zip_member_data_offset,
)

__all__ = ["NotNumbersError", "NpzBackend", "NpzWriter", "parse_npy_header"]

_MAGIC = b"\x93NUMPY"
_DESCR = re.compile(r"^[<>|=]?(b1|[iu][1248]|f[248]|c(8|16))$")
_SIDECAR = "__ckptvar__.json"
_MAX_NPY_HEADER = 1 << 20
#: The NumPy dtypes a ``.npy`` member may hold, in any byte order: ckptvar's supported
#: dtypes that NumPy has built in (bfloat16, float8 and int4 are stored as their bits).
_PLAIN = {
    dt.newbyteorder(o) for dt in SUPPORTED_DTYPES.values() if dt.isbuiltin == 1
    for o in ("<", ">", "=")
}


def _npy_preamble(head: bytes, *, what: str) -> tuple[int, int, int]:
    """``(major version, header start, header length)`` of a ``.npy`` member."""
    if len(head) < 10 or head[:6] != _MAGIC:
        raise CorruptCheckpointError(f"{what} is not a .npy array (bad magic {head[:6]!r}).")
    major = head[6]
    if major == 1:
        (hlen,) = struct.unpack_from("<H", head, 8)
        return major, 10, int(hlen)
    if major in (2, 3):
        if len(head) < 12:
            raise CorruptCheckpointError(f"{what}: truncated .npy header.")
        (hlen,) = struct.unpack_from("<I", head, 8)
        return major, 12, int(hlen)
    raise CorruptCheckpointError(f"{what}: unknown .npy format version {major}.")


class NotNumbersError(UnsupportedFormatError):
    """A ``.npy`` member holding no plain numbers (object, string, structured ...)."""

    def __init__(self, reason: str, what: str) -> None:
        super().__init__(f"{what}: {reason}.")
        self.reason = reason


def _plain_dtype(descr: Any, *, what: str) -> np.dtype:
    """The dtype a ``descr`` names, if it is a plain numeric one (nothing is unpickled)."""
    if not isinstance(descr, str):
        raise NotNumbersError(
            f"structured dtype {str(descr)[:200]} refused (only plain numeric arrays are read)",
            what,
        )
    dtype = np.dtype(descr) if _DESCR.match(descr) else None
    if dtype is None or dtype not in _PLAIN:
        raise NotNumbersError(
            f"dtype {descr[:200]!r} refused (object, string, void and datetime arrays are "
            "not read; nothing is ever unpickled)",
            what,
        )
    return dtype


def parse_npy_header(head: bytes, *, what: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """``(dtype, shape, fortran_order, header_size)`` from the start of a ``.npy`` member.

    ``head`` must hold at least the whole header (the first 64 KiB + 10 bytes suffice
    for any header ckptvar accepts).
    """
    major, start, hlen = _npy_preamble(head, what=what)
    if hlen > _MAX_NPY_HEADER or start + hlen > len(head):
        raise CorruptCheckpointError(
            f"{what}: .npy header of {hlen} bytes is truncated or too big."
        )
    raw = head[start : start + hlen]
    try:
        text = raw.decode("utf-8" if major == 3 else "latin1")
        meta = ast.literal_eval(text)
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{what}: .npy header is not a literal dict: {exc}.") from None
    if not isinstance(meta, dict) or set(meta) != {"descr", "fortran_order", "shape"}:
        raise CorruptCheckpointError(f"{what}: .npy header {text.strip()[:200]!r} is malformed.")
    dtype = _plain_dtype(meta["descr"], what=what)
    if not isinstance(meta["fortran_order"], bool):
        raise CorruptCheckpointError(f"{what}: fortran_order is not a bool.")
    if not isinstance(meta["shape"], tuple):
        raise CorruptCheckpointError(f"{what}: shape {meta['shape']!r} is not a tuple.")
    shape = check_shape(meta["shape"], what=what, path="")
    return dtype, shape, meta["fortran_order"], start + hlen


class _Member:
    """Byte access into one zip member (stored: in place; deflated: a bounded stream)."""

    def __init__(
        self, zf: zipfile.ZipFile, info: zipfile.ZipInfo, fh: FileHandle, path: Path
    ) -> None:
        self.zf, self.info, self.fh = zf, info, fh
        self.what = f"member {info.filename!r} of {str(path)!r}"
        self.stored = info.compress_type == zipfile.ZIP_STORED
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise CorruptCheckpointError(
                f"The {self.what} uses zip compression method {info.compress_type} "
                "(only stored and deflated members are read)."
            )
        self.start = zip_member_data_offset(fh, info, path)  # also checks the member's name
        if self.stored:
            if self.start + info.file_size > fh.size or info.compress_size != info.file_size:
                raise CorruptCheckpointError(f"The {self.what} runs past the end of the file.")
        elif info.file_size > max(1 << 16, info.compress_size * MAX_DEFLATE_RATIO):
            raise CorruptCheckpointError(
                f"The {self.what} declares {info.file_size} bytes from {info.compress_size} "
                "compressed bytes: a zip bomb, refused."
            )

    def fetch(self, offset: int, size: int) -> bytes:
        if offset + size > self.info.file_size:
            raise CorruptCheckpointError(f"The {self.what} is shorter than its header says.")
        if self.stored:
            return self.fh.pread(self.start + offset, size, self.what)
        return read_member_range(self.zf, self.info, offset, size, f"The {self.what}")

    def readinto(self, buf: memoryview, offset: int) -> None:
        self.fh.readinto(buf, self.start + offset, self.what)


def _read_sidecar(archive: ZipArchive, path: Path) -> dict[str, Any]:
    """ckptvar's ``__ckptvar__.json`` member (dtypes, attributes, metadata), if present."""
    info = archive.members.get(_SIDECAR)
    if info is None:
        return {}
    if info.file_size > 64 << 20:
        raise CorruptCheckpointError(f"{_SIDECAR} in {str(path)!r} is too large.")
    member = _Member(archive.zf, info, archive.fh, path)
    try:  # (loads_json: the inverse of the writer's jsonable, bytes included)
        sidecar = loads_json(bytes(member.fetch(0, info.file_size)).decode("utf-8"),
                             f"{path} ({_SIDECAR})")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"{_SIDECAR} in {path}: {exc}") from None
    if not isinstance(sidecar, dict):
        raise CorruptCheckpointError(f"{_SIDECAR} in {str(path)!r} is not an object.")
    return sidecar


def _shown_dtype(stored: np.dtype, real: Any, what: str) -> np.dtype:
    """The dtype a value is read as: the recorded one (bfloat16 stored as bits) or ``stored``."""
    shown = little_endian(stored)
    if real is None:
        return shown
    try:
        target = str_to_dtype(real)
    except TypeError:
        raise CorruptCheckpointError(f"{what}: unknown dtype {real!r}.") from None
    if target.itemsize != shown.itemsize:
        raise CorruptCheckpointError(f"{what}: recorded dtype {real} does not fit stored {stored}.")
    return target


def _array(
    archive: ZipArchive, info: zipfile.ZipInfo, path: Path, sidecar: dict[str, Any]
) -> FileArray:
    """The lazy array of one ``.npy`` member, its header and size checked."""
    key = info.filename[: -len(".npy")]
    member = _Member(archive.zf, info, archive.fh, path)
    what = f"{key!r} in {str(path)!r}"
    head = member.fetch(0, min(info.file_size, 65536 + 12))
    dtype, shape, fortran, hsize = parse_npy_header(head, what=what)
    size = math.prod(shape)
    if hsize + size * dtype.itemsize != info.file_size:
        raise CorruptCheckpointError(
            f"{what}: member holds {info.file_size - hsize} data bytes; shape "
            f"{shape} of {dtype} needs {size * dtype.itemsize}."
        )
    dtypes = sidecar.get("dtypes", {}) if isinstance(sidecar.get("dtypes", {}), dict) else {}
    attrs_all = sidecar.get("attrs", {}) if isinstance(sidecar.get("attrs", {}), dict) else {}
    shown = _shown_dtype(dtype, dtypes.get(key), what)
    attrs = {"name": key}
    if isinstance(attrs_all.get(key), dict):
        attrs.update(attrs_all[key])
    return FileArray(
        ArrayInfo(key=key, dtype=shown, shape=shape, attrs=attrs, checksum=info.CRC),
        stored_dtype=dtype,
        offset=hsize,
        fetch=member.fetch,
        readinto=member.readinto if member.stored and dtype.byteorder in "=|" else None,
        check=zip_crc_check(info, head[:hsize], what),
        fortran=fortran and len(shape) > 1,
    )


def _open(path: Path) -> Reader:
    archive = ZipArchive(path, kind=".npz")
    try:
        sidecar = _read_sidecar(archive, path)
        arrays: dict[str, LazyArray] = {}
        skipped: dict[str, str] = {}
        for info in archive.members.values():
            if info.filename.endswith(".npy") and not info.is_dir():
                try:
                    arrays[info.filename[: -len(".npy")]] = _array(archive, info, path, sidecar)
                except NotNumbersError as exc:  # a user value, not damage: listed, not read
                    skipped[info.filename[: -len(".npy")]] = exc.reason
            elif info.filename != _SIDECAR and not info.is_dir():
                skipped[info.filename] = "a zip member that is not a .npy array"
        for name in set(arrays) & set(skipped):  # np.load would return the plain member
            raise CorruptCheckpointError(
                f"{str(path)!r} holds both the members {name!r} and {name + '.npy'!r}; "
                "which one is the value is ambiguous."
            )
    except BaseException:
        archive.close()
        raise

    meta = sidecar.get("metadata", {})
    return EntryReader(
        path, "npz", arrays, skipped=skipped, metadata=meta if isinstance(meta, dict) else {},
        on_close=archive.close,
    )


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    text = repr(
        {
            "descr": np.lib.format.dtype_to_descr(dtype),
            "fortran_order": False,
            "shape": tuple(shape),
        }
    )
    # Pad so that data starts on a 64-byte boundary, as numpy does.
    total = len(_MAGIC) + 2 + 2 + len(text) + 1
    text += " " * (-total % 64) + "\n"
    raw = text.encode("latin1")
    if len(raw) < 65536:
        return _MAGIC + b"\x01\x00" + struct.pack("<H", len(raw)) + raw
    return _MAGIC + b"\x02\x00" + struct.pack("<I", len(raw)) + raw


def _write_pieces(out: Any, value: Any) -> None:
    """Write a :class:`~ckptvar.storage.Chunked` value's bytes a piece at a time."""
    pos = 0
    for piece in value.byte_chunks():
        view = memoryview(piece).cast("B")
        out.write(view)
        pos += len(view)
    if pos != value.nbytes:
        raise ValueError(f"A chunked value of {value.nbytes} bytes gave {pos} bytes.")


#: The longest member name a zip header holds (its length is a 16-bit field), in bytes.
_MAX_MEMBER_NAME = 0xFFFF


class NpzWriter(CollectingWriter):
    """Writes an uncompressed ``.npz`` atomically, streaming each array's buffer."""

    def add(self, key: str, array: np.ndarray, attrs: Mapping[str, Any] | None = None) -> None:
        if not isinstance(key, str) or not key or key == _SIDECAR[:-5] or "\x00" in key:
            why = (f": {_SIDECAR[:-5]} names ckptvar's own member" if key == _SIDECAR[:-5]
                   else ": a member name is a non-empty string without NUL")
            raise ValueError(f"Invalid npz key {key!r}{why}; rename it (ckpt convert --rename).")
        check_key_utf8(key, "npz")
        if unsafe_name(key + ".npy"):  # the reader refuses such a member: never written
            raise ValueError(
                f"Invalid npz key {key!r}: its member name would point outside the archive "
                "(absolute, a drive letter, '..' or a backslash); rename it "
                "(ckpt convert --rename).")
        member = len((key + ".npy").encode("utf-8"))
        if member > _MAX_MEMBER_NAME:  # a zip header holds a name's length in 16 bits
            raise ValueError(
                f"Invalid npz key {key[:40]!r}... ({len(key)} characters): its member name "
                f"would be {member} bytes, more than a zip archive holds ({_MAX_MEMBER_NAME}); "
                "rename it (ckpt convert --rename).")
        if not is_chunked(array):  # a Chunked value's pieces are streamed at commit
            array = np.asarray(array)
        dt = little_endian(np.dtype(array.dtype))
        if dt != array.dtype:  # big-endian: stored little-endian, by value (as in h5 and Zarr)
            array = array.astype(dt)
        if dt not in SUPPORTED_DTYPES.values():
            raise UnsupportedFormatError(f"Cannot write {key!r} of dtype {array.dtype} to npz.")
        self._collect(key, array, attrs)

    def commit(self) -> Path:
        self._check_open()
        from ..storage.atomic import check_destination, publish, temporary_sibling

        check_destination(self.path, directory=False)

        recorded: dict[str, str] = {}
        attrs = self._stored_attrs()
        with temporary_sibling(self.path) as tmp:
            with (
                open(tmp, "xb") as raw,
                zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED, allowZip64=True) as zf,
            ):
                for key, (given, _) in self._items.items():
                    dt = np.dtype(given.dtype)
                    stored = dt
                    if dt.isbuiltin == 2:  # bfloat16, float8, int4, ... (ml_dtypes): the bits
                        recorded[key] = dtype_to_str(dt)
                        stored = np.dtype(f"<u{dt.itemsize}")
                    info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
                    info.compress_type = zipfile.ZIP_STORED
                    info.external_attr = 0o644 << 16
                    # stored: the CRC is computed as the bytes pass, so a Chunked value
                    # goes a piece at a time (never whole on the host)
                    with zf.open(info, "w", force_zip64=True) as out:
                        if is_chunked(given):
                            out.write(_npy_header(stored.newbyteorder("<"), tuple(given.shape)))
                            _write_pieces(out, given)
                            continue
                        array = given if stored is dt else given.view(stored)
                        buf = np.require(array, requirements="C")  # keeps 0-d arrays 0-d
                        out.write(_npy_header(buf.dtype, buf.shape))
                        if buf.nbytes:
                            out.write(buf.reshape(-1).view(np.uint8).data)
                side: dict[str, Any] = {"format": "ckptvar-npz", "version": 1}
                if recorded:
                    side["dtypes"] = recorded
                if attrs:
                    side["attrs"] = attrs
                if self._metadata is not None:
                    side["metadata"] = self._metadata
                if len(side) > 2:
                    info = zipfile.ZipInfo(_SIDECAR, date_time=(1980, 1, 1, 0, 0, 0))
                    info.external_attr = 0o644 << 16
                    zf.writestr(info, json.dumps(side, default=jsonable))
                zf.close()
                raw.flush()
                if self._durable:
                    os.fsync(raw.fileno())
            publish(tmp, self.path, durable=self._durable)
        self._done = True
        self._items.clear()
        return self.path


class NpzBackend(Backend, name="npz", suffixes=(".npz",), writer=NpzWriter):
    """NumPy ``.npz`` archives (read and write; never unpickles)."""


    @classmethod
    def sniff(cls, path: Path) -> bool:
        try:
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
        except ZIP_ERRORS:
            return False
        return bool(names) and all(n.endswith(".npy") or n == _SIDECAR for n in names)

    @classmethod
    def open_reader(cls, path: Path) -> Reader:
        return _open(Path(path))
