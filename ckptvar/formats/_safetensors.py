"""``.safetensors`` files: a strictly validated reader and a zero-copy writer.

Owns: the ``safetensors`` backend. Layout: an 8-byte little-endian header
length ``N``, ``N`` bytes of UTF-8 JSON (``{key: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``), then the data
buffer. The reader checks everything before reading any value: the header
length against the file, unique keys, known dtypes, non-negative shapes,
offsets inside the buffer, byte counts matching shape x dtype, and that the
values tile the buffer exactly (no gaps, no overlaps). Values are then read
lazily, only the rows a slice needs.

Sub-byte dtypes (``F4``, ``F6_E2M3``, ``F6_E3M2``) are packed as the safetensors
library stores them: the header keeps the logical shape, the data is a
little-endian bit stream (see :func:`pack_bits`); in memory they are one per byte.

The writer streams each array's own buffer after the header (no concatenated
copy), to a temporary sibling that is fsynced and renamed onto the final path.

``__metadata__``: string-to-string metadata (``{"format": "pt"}``, which Hugging
Face transformers requires) is written at the top level as it was given.
ckptvar's own metadata lives under keys starting with ``ckptvar``: per-value
attributes in ``ckptvar.attrs`` and the rest of the metadata dict (values that
are not strings) in ``ckptvar.metadata``, both JSON strings other tools ignore.
``ckptvar_metadata=False`` writes none of ckptvar's own keys and keeps the
string-to-string ones. Whenever ``__metadata__`` is written it has a ``format``
(``pt`` unless the caller gave one), as ``ckpt convert`` and Hugging Face's own
converter write it. The reader merges them back into one dict.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..storage.base import ArrayInfo, Backend, LazyArray, Reader
from ..storage.chunked import as_host, is_chunked
from . import _common
from ._json import jsonable, loads_json, unique_keys

__all__ = [
    "PACKED_BITS",
    "SAFETENSORS_DTYPES",
    "SafetensorsBackend",
    "SafetensorsWriter",
    "pack_bits",
    "stored_nbytes",
    "unpack_bits",
]

#: The safetensors dtype names NumPy / ml_dtypes can hold.
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("bool"),
    "U8": np.dtype("uint8"),
    "I8": np.dtype("int8"),
    "U16": np.dtype("uint16"),
    "I16": np.dtype("int16"),
    "U32": np.dtype("uint32"),
    "I32": np.dtype("int32"),
    "U64": np.dtype("uint64"),
    "I64": np.dtype("int64"),
    "F16": np.dtype("float16"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("float32"),
    "F64": np.dtype("float64"),
    "C64": np.dtype("complex64"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F4": np.dtype(ml_dtypes.float4_e2m1fn),
    "F6_E2M3": np.dtype(ml_dtypes.float6_e2m3fn),
    "F6_E3M2": np.dtype(ml_dtypes.float6_e3m2fn),
}
#: Sub-byte dtypes and their width in bits: packed in the file, one per byte in memory.
PACKED_BITS: dict[str, int] = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_NAME_OF = {dt: name for name, dt in SAFETENSORS_DTYPES.items()}
_BITS_OF = {SAFETENSORS_DTYPES[name]: bits for name, bits in PACKED_BITS.items()}
MAX_HEADER = 100 * 1024 * 1024  # the limit the reference implementation applies
_METADATA = "__metadata__"
_OWN = "ckptvar"  # the prefix of every __metadata__ key ckptvar writes for itself
_ATTRS = "ckptvar.attrs"
_OWN_METADATA = "ckptvar.metadata"


def stored_nbytes(array: Any) -> int:
    """The bytes ``array`` takes in a safetensors file: packed for the sub-byte dtypes.

    >>> stored_nbytes(np.zeros(64, ml_dtypes.float4_e2m1fn)), stored_nbytes(np.zeros(3))
    (32, 24)
    """
    bits = _BITS_OF.get(np.dtype(array.dtype))
    if bits is None:
        return int(array.nbytes)
    return int(math.prod(array.shape)) * bits // 8


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``bits``-wide codes (one per byte, C order) into a little-endian bit stream.

    Value ``i`` occupies bits ``bits*i .. bits*i + bits - 1`` of the stream, counting from
    the least significant bit of byte 0: for 4 bits, the first value of each pair is
    the low nibble (torch's ``float4_e2m1fn_x2``); for 6 bits, four values fill three
    bytes. The count times ``bits`` must be a multiple of 8.
    """
    flat = codes.reshape(-1).view(np.uint8) & np.uint8((1 << bits) - 1)
    if bits == 4:
        return np.asarray(flat[0::2] | (flat[1::2] << np.uint8(4)), dtype=np.uint8)
    group = flat.reshape(-1, 4).astype(np.uint32)
    word = group[:, 0] | (group[:, 1] << 6) | (group[:, 2] << 12) | (group[:, 3] << 18)
    out = np.empty((len(word), 3), dtype=np.uint8)
    for i in range(3):
        out[:, i] = (word >> (8 * i)) & 0xFF
    return out.reshape(-1)


def unpack_bits(raw: bytes | bytearray | memoryview, count: int, bits: int) -> np.ndarray:
    """The inverse of :func:`pack_bits`: ``count`` codes, one per byte (uint8)."""
    data = np.frombuffer(raw, dtype=np.uint8)
    out = np.empty(count, dtype=np.uint8)
    if bits == 4:
        out[0::2] = data & 0x0F
        out[1::2] = data >> 4
        return out
    group = data.reshape(-1, 3).astype(np.uint32)
    word = group[:, 0] | (group[:, 1] << 8) | (group[:, 2] << 16)
    for i in range(4):
        out[i::4] = (word >> (6 * i)) & 0x3F
    return out


class _PackedArray(LazyArray):
    """A sub-byte value (``F4``/``F6_*``): read whole, unpacked to one byte per value, then sliced."""

    def __init__(
        self, info: ArrayInfo, *, bits: int, offset: int, fetch: Callable[[int, int, str], bytes]
    ) -> None:
        self.info = info
        self._bits, self._offset, self._fetch = bits, offset, fetch

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        shape, n = self.info.shape, self.info.size
        if out is not None and (out.shape != shape or out.dtype != self.info.dtype):
            raise ValueError(
                f"out for {self.info.key!r} must have shape {shape} and dtype "
                f"{self.info.dtype}; got {out.shape} {out.dtype}."
            )
        raw = self._fetch(self._offset, n * self._bits // 8, "data") if n else b""
        arr = unpack_bits(raw, n, self._bits).view(self.info.dtype).reshape(shape)
        if out is not None:
            out[...] = arr
            return out
        return arr

    def __getitem__(self, index: Any) -> np.ndarray:
        result = self.read()[index]
        return np.array(result, copy=True) if isinstance(result, np.ndarray) else result


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogates), as a header must."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_Entry = tuple[np.dtype, tuple[int, ...], int, int]  # (dtype, shape, begin, end)


def _header_json(head: bytes, where: str) -> dict[str, Any]:
    """The header as a JSON object (UTF-8, starting with ``{``, no duplicate keys)."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"The {where} is not UTF-8: {exc}.") from None
    if not text.startswith("{"):
        raise CorruptCheckpointError(f"The {where} does not start with '{{'.")
    try:
        obj = json.loads(text, object_pairs_hook=unique_keys)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"The {where} is refused: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"The {where} is not valid JSON: {exc}.") from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"The {where} is not a JSON object.")
    return obj


def _entry(key: str, spec: Any, buffer_size: int, where: str, path: Path | str) -> _Entry:
    """One tensor's header entry, checked: dtype, shape, and offsets that fit its size."""
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise CorruptCheckpointError(
            f"Tensor {key!r} in the {where}: expected exactly dtype, shape and data_offsets, "
            f"found {sorted(spec) if isinstance(spec, dict) else type(spec).__name__}."
        )
    dtype = SAFETENSORS_DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise CorruptCheckpointError(
            f"Tensor {key!r} in the {where} has unsupported dtype {spec['dtype']!r} "
            f"(known: {', '.join(SAFETENSORS_DTYPES)})."
        )
    shape = _common.check_shape(spec["shape"], what=f"Tensor {key!r}", path=path)
    offsets = spec["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise CorruptCheckpointError(
            f"Tensor {key!r} in the {where}: data_offsets {offsets!r} is not [begin, end]."
        )
    begin, end = offsets
    if not 0 <= begin <= end <= buffer_size:
        raise CorruptCheckpointError(
            f"Tensor {key!r} in the {where}: data_offsets [{begin}, {end}] fall outside the "
            f"{buffer_size}-byte data buffer."
        )
    n = math.prod(shape)
    bits = n * PACKED_BITS.get(spec["dtype"], 8 * dtype.itemsize)
    if bits % 8:
        raise CorruptCheckpointError(
            f"Tensor {key!r} in the {where}: {n} values of {spec['dtype']} are {bits} bits, "
            "which do not end at a byte boundary."
        )
    if end - begin != bits // 8:
        raise CorruptCheckpointError(
            f"Tensor {key!r} in the {where}: {end - begin} bytes for shape {list(shape)} of "
            f"{spec['dtype']} (needs {bits // 8})."
        )
    return dtype, shape, begin, end


def parse_header(
    head: bytes, buffer_size: int, path: Path | str
) -> tuple[dict[str, _Entry], dict[str, str]]:
    """Validate a header; returns ``{key: (dtype, shape, begin, end)}`` and ``__metadata__``."""
    where = f"safetensors header of {str(path)!r}"
    obj = _header_json(head, where)
    meta = obj.pop(_METADATA, {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptCheckpointError(f"{_METADATA} in the {where} must map strings to strings.")
    entries = {key: _entry(key, spec, buffer_size, where, path) for key, spec in obj.items()}
    pos = 0
    for key, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != pos:
            raise CorruptCheckpointError(
                f"Tensor {key!r} in the {where} starts at {begin}, expected {pos}: the values "
                + ("overlap." if begin < pos else "leave a gap.")
            )
        pos = end
    if pos != buffer_size:
        raise CorruptCheckpointError(
            f"The values in the {where} cover {pos} bytes of a {buffer_size}-byte data buffer."
        )
    return entries, meta


def _open(path: Path) -> Reader:
    fh = _common.FileHandle(path)
    try:
        if fh.size < 8:
            raise CorruptCheckpointError(
                f"{str(path)!r} is {fh.size} bytes: too short for a safetensors header."
            )
        (n,) = struct.unpack("<Q", fh.pread(0, 8, "header length"))
        if n > MAX_HEADER or n > fh.size - 8:
            raise CorruptCheckpointError(
                f"{str(path)!r} declares a {n}-byte safetensors header; the file has "
                f"{fh.size - 8} bytes after the length (limit {MAX_HEADER})."
            )
        entries, meta = parse_header(fh.pread(8, n, "header"), fh.size - 8 - n, path)
    except BaseException:
        fh.close()
        raise
    attrs_all: dict[str, Any] = {}
    metadata: dict[str, Any] = {k: v for k, v in meta.items() if not k.startswith(_OWN)}
    if _ATTRS in meta:
        attrs_all = loads_json(meta[_ATTRS], path)
    if _OWN_METADATA in meta:
        own = loads_json(meta[_OWN_METADATA], path)
        if not isinstance(own, dict):
            raise CorruptCheckpointError(f"{_OWN_METADATA} in {str(path)!r} is not an object.")
        metadata.update(own)
    base = 8 + n
    arrays: dict[str, LazyArray] = {}
    for key, (dtype, shape, begin, _end) in entries.items():
        attrs = {"name": key}
        extra = attrs_all.get(key) if isinstance(attrs_all, dict) else None
        if isinstance(extra, dict):
            attrs.update(extra)
        info = ArrayInfo(key=key, dtype=dtype, shape=shape, attrs=attrs)
        if dtype in _BITS_OF:
            arrays[key] = _PackedArray(
                info, bits=_BITS_OF[dtype], offset=base + begin, fetch=fh.pread
            )
            continue
        stored = dtype.newbyteorder("<") if dtype.kind in "biufc" and dtype.itemsize > 1 else dtype
        arrays[key] = _common.FileArray(
            info,
            stored_dtype=stored,
            offset=base + begin,
            fetch=fh.pread,
            readinto=fh.readinto if stored.byteorder in ("=", "|") else None,
        )
    return _common.EntryReader(path, "safetensors", arrays, metadata=metadata, on_close=fh.close)


def _little() -> bool:
    import sys

    return sys.byteorder == "little"


class SafetensorsWriter(_common.CollectingWriter):
    """Writes ``.safetensors`` atomically, streaming each array's buffer as it is."""

    def __init__(
        self,
        path: Path,
        *,
        metadata: Mapping[str, str] | None = None,
        ckptvar_metadata: bool = True,
        durable: bool = True,
    ) -> None:
        """``metadata``: string pairs written at the top level of ``__metadata__``.

        ``ckptvar_metadata=False`` writes none of ckptvar's own keys (``ckptvar.*``:
        attributes, non-string metadata); string pairs, such as ``format``, are kept.
        """
        super().__init__(path, durable=durable)
        self._own = ckptvar_metadata
        self._extra = dict(metadata or {})

    def add(self, key: str, array: np.ndarray, attrs: Mapping[str, Any] | None = None) -> None:
        if not isinstance(key, str) or key == _METADATA or not key:
            why = (f": {_METADATA} names the header's metadata" if key == _METADATA
                   else ": a safetensors name is a non-empty string")
            raise ValueError(f"Invalid safetensors key {key!r}{why}; rename it "
                             "(ckpt convert --rename).")
        _common.check_key_utf8(key, "safetensors")
        if not is_chunked(array) or np.dtype(array.dtype) in _BITS_OF:
            array = np.asarray(as_host(array))  # packed sub-byte values: made whole
        dt = _common.little_endian(np.dtype(array.dtype))
        if dt not in _NAME_OF:
            raise UnsupportedFormatError(
                f"Cannot write {key!r} of dtype {array.dtype} to safetensors "
                f"(supported: {', '.join(str(d) for d in _NAME_OF)})."
            )
        if dt in _BITS_OF and (array.size * _BITS_OF[dt]) % 8:
            raise UnsupportedFormatError(
                f"Cannot write {key!r} to safetensors: {array.size} values of {dt} are "
                f"{array.size * _BITS_OF[dt]} bits, and safetensors packs {_NAME_OF[dt]} "
                f"values so that each tensor ends at a byte boundary (the count must be a "
                f"multiple of {8 // math.gcd(8, _BITS_OF[dt])})."
            )
        self._collect(key, array, attrs)

    def _header(self) -> tuple[bytes, list[Any]]:
        header: dict[str, Any] = {}
        meta: dict[str, str] = {}
        own: dict[str, Any] = {}
        extra = {str(k): str(v) for k, v in self._extra.items()}
        for k, v in [*(self._metadata or {}).items(), *extra.items()]:
            if (isinstance(k, str) and isinstance(v, str) and not k.startswith(_OWN)
                    and _utf8(k) and _utf8(v)):
                meta[k] = v  # as it was: {"format": "pt"} stays where other tools look
            else:  # in ckptvar's own JSON entry (a string not UTF-8 would break the header)
                own[str(k)] = v
        attrs = self._stored_attrs()
        if self._own and attrs:
            meta[_ATTRS] = json.dumps(attrs, default=jsonable, sort_keys=True)
        if self._own and own:
            meta[_OWN_METADATA] = json.dumps(own, default=jsonable)
        if meta:
            # Hugging Face loaders refuse a header whose metadata names no format;
            # a format the caller gave is kept as it is.
            meta.setdefault("format", "pt")
            header[_METADATA] = meta
        buffers = []
        pos = 0
        for key, (array, _) in self._items.items():
            if is_chunked(array):  # its pieces are written at commit, one at a time
                n = int(array.nbytes)
                header[key] = {"dtype": _NAME_OF[_common.little_endian(np.dtype(array.dtype))],
                               "shape": list(array.shape), "data_offsets": [pos, pos + n]}
                pos += n
                buffers.append(array)
                continue
            dt = (
                array.dtype.newbyteorder("=")
                if array.dtype.byteorder not in ("=", "|")
                else (array.dtype)
            )
            little = (
                array.astype(dt.newbyteorder("<"))
                if dt.kind in "biufc"
                and (
                    array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and not _little())
                )
                else array
            )
            buf = np.require(little, requirements="C")  # keeps 0-d arrays 0-d
            shape = list(buf.shape)
            if dt in _BITS_OF:
                buf = pack_bits(buf, _BITS_OF[dt])
            n = buf.nbytes
            header[key] = {
                "dtype": _NAME_OF[dt],
                "shape": shape,
                "data_offsets": [pos, pos + n],
            }
            pos += n
            buffers.append(buf)
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw, buffers

    def commit(self) -> Path:
        self._check_open()
        head, buffers = self._header()
        from ..storage.atomic import check_destination, publish, temporary_sibling

        check_destination(self.path, directory=False)

        with temporary_sibling(self.path) as tmp:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, memoryview(head))
                for buf in buffers:
                    if is_chunked(buf):
                        _write_pieces(fd, buf)
                    elif buf.nbytes:
                        _write_all(fd, buf.reshape(-1).view(np.uint8).data)
                if self._durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            publish(tmp, self.path, durable=self._durable)
        self._done = True
        self._items.clear()
        return self.path


#: Bytes per ``write`` call. The kernel copies a call's bytes in chunks that it halves
#: each time a source page is not mapped yet, for the rest of that call: from a buffer
#: that is a file's mapping (``ckpt convert``'s scratch file) one call per tensor
#: degraded to page-sized chunks, and the file's ``fsync`` took longer too.
_WRITE_PIECE = 8 << 20


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        n = os.write(fd, view[:_WRITE_PIECE])
        view = view[n:]


def _write_pieces(fd: int, value: Any) -> None:
    """Write a :class:`~ckptvar.storage.Chunked` value's bytes a piece at a time."""
    pos = 0
    for piece in value.byte_chunks():
        view = memoryview(piece).cast("B")
        _write_all(fd, view)
        pos += len(view)
    if pos != value.nbytes:
        raise ValueError(f"A chunked value of {value.nbytes} bytes gave {pos} bytes.")


class SafetensorsBackend(
    Backend,
    name="safetensors",
    suffixes=(".safetensors",),
    writer=SafetensorsWriter,
    hands_over_unrecognised=True,  # a model folder named "x.safetensors" is hf-safetensors
):
    """Hugging Face ``.safetensors`` files (read and write)."""


    @classmethod
    def sniff(cls, path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                head = f.read(9)
                f.seek(0, 2)
                size = f.tell()
        except OSError:
            return False
        if len(head) < 9 or head[8:9] != b"{":
            return False
        (n,) = struct.unpack("<Q", head[:8])
        return bool(n <= min(MAX_HEADER, size - 8))

    @classmethod
    def open_reader(cls, path: Path) -> Reader:
        return _open(Path(path))
