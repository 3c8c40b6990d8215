"""The seam between a container reader and its read engines: how a value's bytes are reached.

Owns :class:`ValueAccess`, the protocol :class:`.reader.ContainerReader`
implements and the engines (:mod:`.bulk`, :mod:`.transfer`, :mod:`.stream`)
receive, and the rules every one of them applies the same way: which values are
read in parallel pieces (:func:`parallel`), what a destination buffer must be
(:func:`destination`), and how damage is reported (:meth:`ValueAccess.corrupt`,
:func:`compare`). The engines import this module, never the reader, so the
reader sits above them and no import runs in a circle.

>>> corrupt("m.h5", "w", "is truncated")
CorruptCheckpointError("Checkpoint 'm.h5': value 'w' is truncated.")
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ...errors import CorruptCheckpointError
from .. import rawio as _rawio
from .._record import ARRAY, PACKED, Entry, ValueRows
from . import source as _src
from .layout import Source
from .source import RemoteFile

__all__ = [
    "PARALLEL_FROM",
    "ValueAccess",
    "check_source",
    "compare",
    "corrupt",
    "destination",
    "entries",
    "parallel",
]

#: Values at least this large are read on the I/O threads, in pieces.
PARALLEL_FROM = 1 << 20


@runtime_checkable
class ValueAccess(Protocol):
    """What the read engines need of a container reader: entries, byte sources, reads."""

    #: The checkpoint's path (a ``Path``) or URL (a ``str``), for messages.
    path: Any
    #: Whether the bytes are in an object store (read by streamed ranged GETs).
    remote: bool

    def entry(self, key: str) -> Entry:
        """The record's entry of ``key``; ``MissingKeyError`` naming close keys if none."""

    def entry_list(self, keys: list[str]) -> list[Entry]:
        """:meth:`entry` of each key, in one pass."""

    def value_rows(self, keys: list[str]) -> ValueRows:
        """The record's columns of ``keys``, in their order (read-only; no entry made)."""

    def check_open(self) -> None:
        """Raise ``ValueError`` if the reader is closed."""

    def source(self, key: str, entry: Entry) -> Source:
        """Where an ``array`` or ``packed`` value's bytes are (opening checks their size)."""

    def corrupt(self, key: str, what: str) -> CorruptCheckpointError:
        """The error saying value ``key`` ``what`` (a backend may add where its bytes are)."""

    def packed_source(self) -> tuple[int | RemoteFile, int]:
        """``(fd, byte_offset_of_blob_start)``: a descriptor or a remote byte source."""

    def read(self, key: str, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        """One whole value (into ``out`` when given), verified unless ``verify`` is false."""

    def verify(self, key: str) -> None:
        """Raise ``CorruptCheckpointError`` if ``key`` is damaged."""


def parallel(e: Entry) -> bool:
    """Whether a value is read in pieces on the I/O threads (large, and in a file)."""
    kind, _, _, nbytes = e.loc
    return nbytes >= PARALLEL_FROM and kind in (ARRAY, PACKED)


def check_source(access: ValueAccess, key: str, e: Entry) -> None:
    """Open and close the value's source: opening checks the stored size against the
    record, so a forged record declaring a huge value is refused before allocating."""
    src = access.source(key, e)
    if src.owned:
        _src.close(src.fd)


def corrupt(path: Any, key: str, what: str) -> CorruptCheckpointError:
    """The error saying value ``key`` of the checkpoint at ``path`` ``what``."""
    return CorruptCheckpointError(f"Checkpoint {str(path)!r}: value {key!r} {what}.")


def compare(access: ValueAccess, key: str, e: Entry, computed: int) -> None:
    """Raise ``access.corrupt`` unless ``computed`` is the checksum the record stores."""
    if computed != e.checksum:
        raise access.corrupt(
            key,
            f"fails its checksum (stored {e.checksum:#010x}, computed {computed:#010x}); "
            "the checkpoint is damaged",
        )


def destination(key: str, e: Entry, out: np.ndarray | None,
                src: Source | None = None) -> np.ndarray:
    """``out`` checked to take the value (same shape and dtype, writeable C order), or a
    fresh array when ``out`` is None: one a large value's bytes in the local file ``src``
    can be read into with ``O_DIRECT`` (its address in phase with their offset)."""
    if out is None:
        if src is None or src.fd.__class__ is not int or e.nbytes < PARALLEL_FROM:
            return np.empty(e.shape, e.np_dtype)
        phase = src.offset % _rawio.DIRECT_ALIGN
        return _rawio.aligned_empty(e.shape, e.np_dtype, phase if phase % 64 == 0 else 0)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out= must be a NumPy array, got {type(out).__name__}.")
    if out.shape != e.shape or out.dtype != e.np_dtype:
        raise ValueError(
            f"out= for {key!r} has shape {out.shape} and dtype {out.dtype}; the stored "
            f"value has shape {e.shape} and dtype {e.dtype}."
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out= for {key!r} must be a writeable C-contiguous array.")
    return out


def entries(access: ValueAccess, keys: Iterable[str]) -> list[tuple[str, Entry]]:
    """``[(key, entry), ...]`` in the order of ``keys``."""
    keys = list(keys)
    return list(zip(keys, access.entry_list(keys), strict=True))
