"""Zip archives checked before anything in them is read: shared by the torch, npz and Keras readers.

Owns: :class:`ZipArchive` (opens a zip and refuses, before reading any member,
a member count that disagrees with the end record, duplicate names, names that
climb out of the archive (absolute, ``..``, backslashes, drive letters),
encrypted members, compression methods other than stored/deflated, and local
headers naming another member), bounded member reads (declared size limits and
a deflate-ratio zip-bomb check), and the zip CRC-32 check of a whole member.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

from ..errors import CorruptCheckpointError
from ._common import FileHandle

__all__ = [
    "MAX_DEFLATE_RATIO",
    "ZIP_ERRORS",
    "ZipArchive",
    "check_member_size",
    "check_zip_entry_count",
    "read_member_range",
    "unsafe_name",
    "zip_crc_check",
    "zip_member_data_offset",
]

#: What ``zipfile``/``zlib`` raise on a damaged archive (all mapped to CorruptCheckpointError).
ZIP_ERRORS: tuple[type[BaseException], ...] = (
    zipfile.BadZipFile,
    OSError,
    EOFError,
    ValueError,
    NotImplementedError,
    RuntimeError,  # e.g. an "encrypted" flag bit
    OverflowError,
    struct.error,
    zlib.error,
)

#: Deflate cannot expand beyond ~1032:1; a member declaring more is a zip bomb.
MAX_DEFLATE_RATIO = 1100


def zip_crc_check(
    info: zipfile.ZipInfo, prefix: bytes, what: str
) -> Callable[[bytes | memoryview], None]:
    """A check that the member's bytes (``prefix`` + the value's bytes) match its zip CRC-32."""

    def check(data: bytes | memoryview) -> None:
        actual = zlib.crc32(data, zlib.crc32(prefix)) & 0xFFFFFFFF
        if actual != info.CRC:
            raise CorruptCheckpointError(
                f"{what} fails its zip CRC-32 check (stored {info.CRC:#010x}, computed "
                f"{actual:#010x}): the archive is damaged."
            )

    return check


def check_zip_entry_count(fh: FileHandle, count: int, path: Path) -> None:
    """Refuse a zip whose central directory lists fewer/more members than its end record says.

    ``zipfile`` does not compare them, so a damaged name length can silently hide members.
    """
    tail_size = min(fh.size, 65536 + 22)
    tail = fh.pread(fh.size - tail_size, tail_size, "zip end record")
    pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 or pos + 22 > len(tail):
        raise CorruptCheckpointError(f"{str(path)!r} has no zip end-of-directory record.")
    (total,) = struct.unpack_from("<H", tail, pos + 10)
    if total not in (0xFFFF, count):
        raise CorruptCheckpointError(
            f"The zip directory of {str(path)!r} lists {count} members; its end record says "
            f"{total}. The archive is damaged."
        )


def zip_member_data_offset(fh: FileHandle, info: zipfile.ZipInfo, path: Path) -> int:
    """Where member ``info``'s data starts, after checking its local header (which must
    name the same member); encrypted members are refused."""
    if info.flag_bits & 0x1:
        raise CorruptCheckpointError(
            f"Zip member {info.filename!r} in {str(path)!r} is encrypted; not supported."
        )
    header = fh.pread(info.header_offset, 30, f"zip local header of {info.filename!r}")
    if header[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(
            f"Bad zip local header for {info.filename!r} in {str(path)!r}."
        )
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    name = fh.pread(info.header_offset + 30, name_len, f"zip local header of {info.filename!r}")
    if name != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
        raise CorruptCheckpointError(
            f"Zip member {info.filename!r} in {str(path)!r} is named {name!r} in its local "
            "header; the archive is damaged."
        )
    return int(info.header_offset) + 30 + int(name_len) + int(extra_len)


def check_member_size(info: zipfile.ZipInfo, limit: int, path: Path) -> None:
    """Refuse a member larger than ``limit`` or larger than deflate could produce."""
    if info.file_size > limit:
        raise CorruptCheckpointError(
            f"{info.filename!r} in {str(path)!r} declares {info.file_size} bytes (limit {limit})."
        )
    if info.compress_type != zipfile.ZIP_STORED and info.file_size > max(
        1 << 16, info.compress_size * MAX_DEFLATE_RATIO
    ):
        raise CorruptCheckpointError(
            f"{info.filename!r} in {str(path)!r} declares {info.file_size} bytes from "
            f"{info.compress_size} compressed bytes: a zip bomb, refused."
        )


def read_member_range(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, offset: int, size: int, what: str
) -> bytes:
    """``size`` bytes at ``offset`` of a (compressed) member, decompressing up to there.

    A damaged or truncated member raises ``CorruptCheckpointError`` naming ``what``.
    """
    try:
        with zf.open(info) as member:
            left = offset
            while left > 0 and (chunk := member.read(min(left, 1 << 22))):
                left -= len(chunk)
            data = member.read(size)
    except ZIP_ERRORS as exc:
        raise CorruptCheckpointError(f"{what} is damaged: {exc}") from None
    if len(data) != size:
        raise CorruptCheckpointError(f"{what} is truncated.")
    return data


def unsafe_name(name: str) -> bool:
    """Whether a member name points outside the archive (absolute, a drive, ``..``,
    backslashes, NUL): refused on reading, so never written.

    >>> unsafe_name("a/b.npy"), unsafe_name("../b.npy"), unsafe_name("C:b.npy")
    (False, True, True)
    """
    if name.startswith(("/", "\\")) or "\\" in name or "\x00" in name:
        return True
    if len(name) >= 2 and name[1] == ":":  # a drive letter
        return True
    return any(part == ".." for part in name.split("/"))


class ZipArchive:
    """A zip opened for reading after every member's name, method and local header is checked.

    ``members`` maps names to ``ZipInfo``; ``read(name, limit)`` returns a whole
    member (at most ``limit`` bytes, CRC-checked by ``zipfile``). The archive
    owns a :class:`FileHandle` (``fh``) for in-place reads of stored members.
    """

    def __init__(self, path: Path, *, kind: str = "zip") -> None:
        self.path = path
        self.fh = FileHandle(path)
        try:
            try:
                self.zf = zipfile.ZipFile(path)
            except ZIP_ERRORS as exc:
                raise CorruptCheckpointError(
                    f"{str(path)!r} is not a readable {kind}: {exc}"
                ) from None
            try:
                infos = self.zf.infolist()
                check_zip_entry_count(self.fh, len(infos), path)
                self.members: dict[str, zipfile.ZipInfo] = {}
                for info in infos:
                    if info.filename in self.members:
                        raise CorruptCheckpointError(
                            f"{str(path)!r} has two members named {info.filename!r}."
                        )
                    if unsafe_name(info.filename):
                        raise CorruptCheckpointError(
                            f"{str(path)!r} holds a member named {info.filename!r}, which "
                            "points outside the archive; refused."
                        )
                    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                        raise CorruptCheckpointError(
                            f"{info.filename!r} in {str(path)!r} uses zip compression method "
                            f"{info.compress_type} (only stored and deflated members are read)."
                        )
                    zip_member_data_offset(self.fh, info, path)  # damaged names must not hide
                    self.members[info.filename] = info
            except BaseException:
                self.zf.close()
                raise
        except BaseException:
            self.fh.close()
            raise

    def read(self, name: str, limit: int) -> bytes:
        """The whole member ``name`` (``limit`` bytes at most), its CRC-32 checked."""
        info = self.members[name]
        check_member_size(info, limit, self.path)
        try:
            data = self.zf.read(info)
        except ZIP_ERRORS as exc:
            raise CorruptCheckpointError(f"{name!r} in {str(self.path)!r}: {exc}") from None
        if len(data) != info.file_size:
            raise CorruptCheckpointError(f"{name!r} in {str(self.path)!r} is truncated.")
        return data

    def data_offset(self, name: str) -> int:
        """Where a member's bytes start in the file (for in-place reads of stored members)."""
        return zip_member_data_offset(self.fh, self.members[name], self.path)

    def close(self) -> None:
        self.zf.close()
        self.fh.close()
