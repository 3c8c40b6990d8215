"""The root record: one msgpack map that describes every stored value (docs/FORMAT.md).

Encoding is plain msgpack (``use_bin_type=True``). Decoding is strict, because
the record comes from a file that may be damaged or hostile: bounded sizes and
nesting, no ext types, no duplicate map keys, strict UTF-8, and exact schema
validation (types, dtype names from the explicit list, non-negative dims, sizes
that do not overflow). Every violation is a :class:`CorruptCheckpointError`
naming the file and the key.

>>> rec = Record(container="h5", values={"w": Entry("float32", (2,), 7, {}, ("packed", 0, 8))})
>>> back = decode(encode(rec), "f.h5", container="h5")
>>> back.values["w"].shape, back.values["w"].nbytes, back.format_version
((2,), 8, (1, 0))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from .._dtypes import SUPPORTED_DTYPES
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ._paths import is_valid_container_path

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_DEPTH",
    "MAX_NDIM",
    "MAX_RECORD_NBYTES",
    "Entry",
    "Record",
    "check_plain",
    "decode",
    "encode",
]

FORMAT_NAME = "ckptvar"
#: (major, minor). A reader refuses a newer major version; minor additions are ignorable.
FORMAT_VERSION = (1, 0)
#: Largest record a reader accepts (about 5 million values).
MAX_RECORD_NBYTES = 1 << 30
#: Deepest nesting of maps/arrays accepted in the record, metadata included.
MAX_DEPTH = 64
MAX_NDIM = 64
_MAX_NBYTES = 1 << 62
_LIBRARY = "ckptvar 0.1.0"


@dataclass(frozen=True, slots=True)
class Entry:
    """One value: dtype name, shape, checksum, writer attrs and where its bytes are.

    ``loc`` is ``("array", container_path, byte_offset)`` for a value stored as its
    own array (``byte_offset`` is absolute in an HDF5 file, 0 in a Zarr chunk),
    ``("packed", offset, nbytes)`` for a value inside ``_ckptvar/packed``, or
    ``("zarr", container_path)`` for a compressed Zarr array read through zarr.
    """

    dtype: str
    shape: tuple[int, ...]
    checksum: int
    attrs: Mapping[str, Any]
    loc: tuple[Any, ...]

    @property
    def np_dtype(self) -> np.dtype:
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * SUPPORTED_DTYPES[self.dtype].itemsize


@dataclass
class Record:
    """The decoded root record."""

    container: str
    values: dict[str, Entry] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: ``(container_path, byte_offset, nbytes)`` of the packed blob, or None.
    packed: tuple[str, int, int] | None = None
    format_version: tuple[int, int] = FORMAT_VERSION
    library: str = _LIBRARY


def encode(record: Record) -> bytes:
    """The msgpack bytes of ``record``."""
    values = {
        key: {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "checksum": e.checksum,
            "attrs": dict(e.attrs),
            "loc": list(e.loc),
        }
        for key, e in record.values.items()
    }
    doc = {
        "format": FORMAT_NAME,
        "format_version": list(FORMAT_VERSION),
        "library": _LIBRARY,
        "container": record.container,
        "packed": list(record.packed) if record.packed is not None else None,
        "values": values,
        "metadata": dict(record.metadata),
    }
    try:
        return msgpack.packb(doc, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"Checkpoint metadata or attrs must be msgpack-able (dict, list, str, bytes, "
            f"int, float, bool, None): {exc}"
        ) from None


def _pairs_hook(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _Bad(f"duplicate map key {dup!r}")
    return out


class _Bad(ValueError):
    pass


def check_plain(obj: Any, where: str, *, max_depth: int = MAX_DEPTH) -> None:
    """Raise ``_Bad`` unless ``obj`` holds only plain msgpack types, nested at most ``max_depth``."""
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise _Bad(f"{where} is nested deeper than {max_depth} levels")
        if isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str):
                    raise _Bad(f"{where} has a non-string map key {k!r}")
                stack.append((v, depth + 1))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif item is None or isinstance(item, bool | int | float | str | bytes):
            continue
        else:
            raise _Bad(f"{where} holds an unsupported {type(item).__name__}")


def decode(data: bytes, path: Any, *, container: str, file_size: int | None = None) -> Record:
    """Parse and validate record bytes read from ``path`` (strict; see the module docstring)."""
    where = str(path)
    if len(data) > MAX_RECORD_NBYTES:
        raise CorruptCheckpointError(
            f"Checkpoint {where!r}: the root record is {len(data)} bytes, more than the "
            f"{MAX_RECORD_NBYTES} accepted."
        )
    try:
        doc = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=_pairs_hook,
            max_ext_len=0,
        )
    except Exception as exc:  # noqa: BLE001 - every msgpack failure means a bad record
        raise CorruptCheckpointError(
            f"Checkpoint {where!r}: the root record is not valid msgpack ({exc})."
        ) from None
    try:
        return _validate(doc, container, file_size)
    except _Bad as exc:
        raise CorruptCheckpointError(f"Checkpoint {where!r}: bad root record: {exc}.") from None


def _validate(doc: Any, container: str, file_size: int | None) -> Record:
    if not isinstance(doc, dict):
        raise _Bad("the record is not a map")
    if doc.get("format") != FORMAT_NAME:
        raise _Bad(f"'format' is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    version = doc.get("format_version")
    if (
        not isinstance(version, list)
        or len(version) != 2
        or not all(type(v) is int and 0 <= v < 1 << 16 for v in version)
    ):
        raise _Bad(f"'format_version' is {version!r}, expected [major, minor]")
    if version[0] > FORMAT_VERSION[0]:
        raise UnsupportedFormatError(
            f"The checkpoint has format version {version[0]}.{version[1]}, newer than the "
            f"{FORMAT_VERSION[0]}.x this ckptvar reads; upgrade ckptvar to read it."
        )
    if doc.get("container") != container:
        raise _Bad(f"'container' is {doc.get('container')!r}, expected {container!r}")
    library = doc.get("library", "")
    if not isinstance(library, str):
        raise _Bad("'library' is not a string")
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise _Bad("'metadata' is not a map")
    check_plain(metadata, "'metadata'")
    packed = doc.get("packed")
    if packed is not None:
        if (
            not isinstance(packed, list)
            or len(packed) != 3
            or not isinstance(packed[0], str)
            or not is_valid_container_path(packed[0])
            or not _is_count(packed[1])
            or not _is_count(packed[2])
        ):
            raise _Bad(f"'packed' is {packed!r}, expected [path, offset, nbytes]")
        if file_size is not None and packed[1] + packed[2] > file_size:
            raise _Bad(
                f"the packed region [{packed[1]}, {packed[1] + packed[2]}) ends past the end "
                f"of the file ({file_size} bytes; truncated?)"
            )
        packed = (packed[0], packed[1], packed[2])
    raw_values = doc.get("values")
    if not isinstance(raw_values, dict):
        raise _Bad("'values' is not a map")
    values: dict[str, Entry] = {}
    packed_nbytes = packed[2] if packed is not None else 0
    for key, raw in raw_values.items():
        values[key] = _entry(key, raw, packed_nbytes, container)
    return Record(
        container=container,
        values=values,
        metadata=metadata,
        packed=packed,
        format_version=(version[0], version[1]),
        library=library,
    )


def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v < _MAX_NBYTES


def _entry(key: str, raw: Any, packed_nbytes: int, container: str) -> Entry:
    if not isinstance(raw, dict):
        raise _Bad(f"the entry of {key!r} is not a map")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES:
        raise _Bad(f"{key!r} has unsupported dtype {dtype!r}")
    shape = raw.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise _Bad(f"{key!r} has shape {shape!r}, expected a list of at most {MAX_NDIM} dims")
    nbytes = SUPPORTED_DTYPES[dtype].itemsize
    for d in shape:
        if not _is_count(d):
            raise _Bad(f"{key!r} has a bad dimension {d!r} in shape {shape!r}")
        nbytes *= d
        if nbytes >= _MAX_NBYTES:
            raise _Bad(f"{key!r} declares shape {shape!r}, too large to exist")
    checksum = raw.get("checksum")
    if type(checksum) is not int or not 0 <= checksum < 1 << 32:
        raise _Bad(f"{key!r} has checksum {checksum!r}, expected a 32-bit unsigned int")
    attrs = raw.get("attrs", {})
    if not isinstance(attrs, dict):
        raise _Bad(f"{key!r} has attrs that are not a map")
    if attrs:
        check_plain(attrs, f"the attrs of {key!r}")
    loc = raw.get("loc")
    if not isinstance(loc, list) or not loc:
        raise _Bad(f"{key!r} has no location")
    kind = loc[0]
    if kind == "array" and len(loc) == 3:
        if not isinstance(loc[1], str) or not is_valid_container_path(loc[1]):
            raise _Bad(f"{key!r} has an unsafe container path {loc[1]!r}")
        if not _is_count(loc[2]):
            raise _Bad(f"{key!r} has a bad byte offset {loc[2]!r}")
    elif kind == "packed" and len(loc) == 3:
        if not _is_count(loc[1]) or loc[2] != nbytes:
            raise _Bad(
                f"{key!r} is packed with {loc[2]!r} bytes, but dtype {dtype} and shape "
                f"{tuple(shape)} need {nbytes}"
            )
        if loc[1] + nbytes > packed_nbytes:
            raise _Bad(f"{key!r} lies outside the packed blob ({packed_nbytes} bytes)")
    elif kind == "zarr" and len(loc) == 2 and container == "zarr":
        if not isinstance(loc[1], str) or not is_valid_container_path(loc[1]):
            raise _Bad(f"{key!r} has an unsafe container path {loc[1]!r}")
    else:
        raise _Bad(f"{key!r} has an unknown location {loc!r}")
    return Entry(dtype, tuple(shape), checksum, attrs, tuple(loc))
