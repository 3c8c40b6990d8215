"""Saving a local checkpoint to a location as one committed step (data, then the marker).

:func:`upload_step` streams a file (HDF5: one object, by multipart upload with
bounded memory) or a directory tree (Zarr: one object per file, the root's
``zarr.json`` last) below ``step``, then calls :func:`commit` with an index
checksum that binds every byte uploaded (a :class:`~._publish.Binding`
``bytes-crc32c:<hex>``): for a file, of its bytes; for a tree, of the sorted
``key size crc32c`` lines of its files. A failure at any point leaves no marker: the step is not visible.
A tree may take some of its objects as server-side copies of committed ones
(``copies``: an incremental step, docs/checkpoints.md); its marker then binds the
checkpoint's own index, which names every value's checksum.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c as _crc32c

from ._base import DEFAULT_PART_SIZE, Location
from ._commit import CommitRecord, commit, refuse_committed
from ._publish import Binding

__all__ = ["tree_checksum", "upload_step", "upload_tree"]


def tree_checksum(entries: list[tuple[str, int, int]]) -> str:
    """The index checksum of a tree: CRC-32C of its sorted ``key size crc`` lines."""
    text = "".join(f"{k} {n} {c:08x}\n" for k, n, c in sorted(entries))
    return str(Binding("bytes", _crc32c.crc32c(text.encode())))


def upload_step(
    location: Location,
    local: str | os.PathLike[str],
    step: str,
    *,
    part_size: int | None = None,
    threads: int = 4,
    index_checksum: str | None = None,
    before_commit: Callable[[], None] | None = None,
    copies: Sequence[tuple[str, str]] = (),
) -> CommitRecord:
    """Upload a local checkpoint file or directory as ``step`` and commit it.

    The marker binds ``index_checksum`` when given (a checkpoint's own index, e.g. its
    root record's checksum, which readers check when they open it), else the checksum
    of every byte uploaded (see the module docstring).

    Raises ``CheckpointExistsError`` (naming the step) if the step is already
    committed: checked before any byte is sent, and again by the create-only marker.
    ``before_commit`` runs just before the marker (a claim's check that it still holds).
    ``copies``: ``(source key, path below step)`` objects a tree takes by server-side copy
    (requires ``index_checksum``: the bytes copied are not read here).
    """
    if copies and (index_checksum is None or Path(local).is_file()):
        raise ValueError("upload_step: copies need a directory and an index_checksum")
    src = Path(local)
    refuse_committed(location, step)
    if src.is_file():
        crc = location.upload_file(os.fspath(src), step, part_size=part_size)
        binding = index_checksum or str(Binding("bytes", crc))
    else:
        entries = upload_tree(location, src, step, part_size=part_size, threads=threads,
                              copies=copies)
        binding = index_checksum or tree_checksum(entries)
    if before_commit is not None:
        before_commit()
    return commit(location, step, binding)


def upload_tree(
    location: Location,
    local: str | os.PathLike[str],
    prefix: str,
    *,
    part_size: int | None = None,
    threads: int = 4,
    copies: Sequence[tuple[str, str]] = (),
) -> list[tuple[str, int, int]]:
    """Upload every file below the local directory ``local`` to ``prefix/<relative path>``,
    and copy on the server each ``(source key, relative path)`` of ``copies`` there.

    The root ``zarr.json``, if any, goes last (a tree is complete once its root is there).
    Returns ``(relative key, size, crc32c)`` of each file uploaded (not the copies);
    commits nothing.
    """
    src = Path(local)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    root_meta = [p for p in files if p.relative_to(src).as_posix() == "zarr.json"]
    rest = [p for p in files if p not in root_meta]

    def send(path: Path) -> tuple[str, int, int]:
        rel = path.relative_to(src).as_posix()
        key = f"{prefix}/{rel}"
        if path.stat().st_size <= (part_size or DEFAULT_PART_SIZE):
            data = path.read_bytes()
            location.put(key, data)
            return rel, len(data), _crc32c.crc32c(data)
        crc = location.upload_file(os.fspath(path), key, part_size=part_size)
        return rel, path.stat().st_size, crc

    def copy(pair: tuple[str, str]) -> None:
        location.copy(pair[0], f"{prefix}/{pair[1]}")

    with ThreadPoolExecutor(max(1, threads)) as pool:
        entries = list(pool.map(send, rest))
        list(pool.map(copy, copies))
    entries += [send(p) for p in root_meta]  # the root metadata last: the tree is complete
    return entries
