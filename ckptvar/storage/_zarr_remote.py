"""ckptvar's own Zarr v3 checkpoints on an object store, read by ranged GETs.

Owns :class:`RemoteZarrReader`: the root ``zarr.json`` and the record by one GET
each, each value from its chunk object (or the packed blob) through a
:class:`._container.source.RemoteFile`, a row delta's from its base's chunk object and
its patch objects; the reads themselves are the container reader's, as for a local
directory.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from . import checksum as _checksum
from . import rawio as _rawio
from ._container import PACKED_PATH, ContainerReader, Source
from ._container.delta import decode_patch, fold, in_base
from ._container.source import Patched, RemoteFile
from ._record import PACKED, Entry, Record, decode
from ._zarr import RECORD_PATH, ZarrReader, chunk_key, zarr_api
from ._zarr_chunks import in_row_chunks
from ._zarr_files import piece_key, root_record_ref

__all__ = ["RemoteZarrReader"]

#: Chunk objects of a compressed value fetched at once (about 4 MiB each).
_FETCH_AHEAD = 8


class RemoteZarrReader(ZarrReader):
    """A ckptvar ``.zarr`` checkpoint on an object store: the root ``zarr.json`` and the
    record by one GET each, values by ranged GETs of their chunk objects."""

    def __init__(self, url: str, location: Any, prefix: str) -> None:
        self._loc = location
        self._prefix = prefix
        self._packed_rf: RemoteFile | None = None
        #: CRC-32C of the root record's bytes (what a commit marker binds).
        self.record_crc = 0
        #: a delta value's patches, read and checked (folded into one when laid twice)
        self._folded: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        record = self._load_remote_record(url)
        ContainerReader.__init__(self, url, record)

    def _obj(self, rel: str) -> str:
        return f"{self._prefix}/{rel}" if self._prefix else rel

    def _load_remote_record(self, url: str) -> Record:
        try:
            raw = self._loc.read(self._obj("zarr.json"))
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"No checkpoint at {url!r} (no zarr.json).") from None
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(
                f"{url!r}: the root zarr.json is not valid JSON ({exc})."
            ) from None
        n, crc = root_record_ref(doc, url, not_ours=UnsupportedFormatError)
        key = self._obj(f"{RECORD_PATH}/{chunk_key(1)}")
        try:
            data = self._loc.read(key)
        except CheckpointNotFoundError:
            raise CorruptCheckpointError(
                f"Checkpoint {url!r}: the root record ({key}) is missing."
            ) from None
        if len(data) != n or _checksum.crc(data) != crc:
            raise CorruptCheckpointError(
                f"Checkpoint {url!r}: the root record ({key}) fails its checksum or length "
                f"check (expected {n} bytes); the checkpoint is damaged."
            )
        self.record_crc = crc
        return decode(data, url, container="zarr")

    def _open_array(self, key: str, entry: Entry) -> Source:
        self.check_open()
        if self._record.pieces and key in self._record.pieces:
            raise UnsupportedFormatError(
                f"Checkpoint {self.path!r}: {key!r} is stored as several chunk files (a "
                "local incremental step, format 1.4), which ckptvar reads from a local "
                "directory only; copy the step to a disk, or `ckpt convert` it there first."
            )
        if self._record.deltas and key in self._record.deltas:
            return Source(self._patched(key, entry), 0, True)
        rel = f"{entry.loc.path}/{chunk_key(len(entry.shape))}"
        return Source(RemoteFile(self._loc, self._obj(rel), entry.nbytes), 0, False)

    def _patched(self, key: str, entry: Entry) -> Patched:
        """A row delta (format 1.5): its base's chunk object, read by ranged GETs, with its
        patches (each one object, fetched whole in parallel and checked) laid over it;
        the base's size is checked first, so an object that is gone or cut short is named."""
        d = self._record.deltas[key]
        expect = self.base_expect(key, entry)
        base_rel = f"{d.base[1]}/{chunk_key(len(entry.shape))}"
        folded = self._folded.get(key)
        if folded is None:
            tasks: list[Callable[[], Any]] = [
                functools.partial(self._patch, key, entry, p[1], p[3], p[4]) for p in d.patches]
            tasks.append(functools.partial(self._sized, key, base_rel, entry.nbytes))
            parts = _rawio.wait_all(_rawio.start_all(tasks))[:-1]
            # verified by its parts, the patches are laid once: in order, no fold first
            folded = self._folded[key] = (parts if expect is not None else
                                          [fold(parts, entry.shape[0])])
        base = RemoteFile(self._loc, self._obj(base_rel), entry.nbytes)
        return Patched(base, 0, entry.nbytes, entry.nbytes // entry.shape[0], folded,
                       expect=expect)

    def _sized(self, key: str, rel: str, nbytes: int) -> None:
        """Refuse (naming it) ``key``'s base object ``rel`` when it is gone or not ``nbytes``
        long."""
        full = self._loc.join(self._obj(rel))
        try:
            size = self._loc.size(self._obj(rel))
        except CheckpointNotFoundError:
            raise self._damaged(key, f"has lost its base object {full}") from None
        if size != nbytes:
            raise self._damaged(key, f"has a base object of {size} bytes, expected {nbytes} "
                                     f"({full})")

    def _patch(self, key: str, entry: Entry, path: str, n: int, crc: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """``key``'s row patch of ``n`` rows at ``path``, fetched whole and checked
        (:func:`.delta.decode_patch`)."""
        rel = self._obj(f"{path}/{chunk_key(1)}")
        try:
            raw = self._loc.read(rel)
        except CheckpointNotFoundError:
            raise self._damaged(key, f"has lost its row patch object {self._loc.join(rel)}"
                                ) from None
        try:
            return decode_patch(raw, n, entry.nbytes // entry.shape[0], entry.shape[0], crc=crc,
                                seed=_checksum.header_crc(key, entry.dtype, entry.shape))
        except ValueError as exc:
            raise self._damaged(key, f"has a row patch {self._loc.join(rel)} that {exc}; the "
                                     "checkpoint is damaged") from None

    def shared(self) -> dict[str, list[str]]:
        """Empty: a Zarr step on an object store shares no object with another (what an
        incremental step takes from its base is a server-side copy, a row delta's base
        and patches too); ``deltas()`` says which step wrote a delta's base."""
        return {}

    def packed_source(self) -> tuple[int | RemoteFile, int]:
        self.check_open()
        if self._packed_rf is None:
            assert self._record.packed is not None
            self._packed_rf = RemoteFile(
                self._loc, self._obj(f"{PACKED_PATH}/{chunk_key(1)}"), self._record.packed[2]
            )
        return self._packed_rf, 0

    def _other_rows(self, key: str, entry: Entry, rows: tuple[int, int] | None) -> np.ndarray:
        """A value stored as a Zarr array of its own (compressed, say), all of it or
        ``rows``: its objects fetched through the location, so a store that does not
        answer is a ``StorageError`` or a timeout naming the request, then decoded by
        zarr-python from memory, where any failure is damage. A value in chunks of rows
        is fetched and decoded a few chunks at a time (:func:`._zarr_chunks.decode_rows`)."""
        zarr = zarr_api()
        rel = entry.loc.path or ""
        names = [o.key for o in self._loc.list(self._obj(rel))]
        if entry.nbytes and all(n.endswith("/zarr.json") for n in names):
            raise self.corrupt(key, f"has lost its chunk objects under {rel!r}")
        start = len(self._prefix) + 1 if self._prefix else 0
        proto = zarr.core.buffer.default_buffer_prototype()
        meta = self._obj(f"{rel}/zarr.json")

        def fetch(objs: list[str]) -> dict[str, Any]:
            tasks: list[Callable[[], bytes]] = [functools.partial(self._loc.read, n) for n in objs]
            blobs = _rawio.wait_all(_rawio.start_all(tasks))
            return {n[start:]: proto.buffer.from_bytes(b) for n, b in zip(objs, blobs, strict=True)}

        def array(objects: dict[str, Any]) -> Any:
            store = zarr.storage.MemoryStore(objects, read_only=True)
            return zarr.open_array(store=store, path=rel, mode="r")

        doc = fetch([meta]) if meta in names else {}
        arr = self._decode(key, lambda: array(doc)) if doc else None
        chunks = () if arr is None else tuple(
            getattr(arr.metadata.chunk_grid, "chunk_shape", ()) or ())
        if arr is None or not in_row_chunks(tuple(arr.shape), chunks) or not entry.nbytes:
            objects = fetch(names)  # decoded whole
            data = np.asarray(self._decode(key, lambda: array(objects)[...]))
            data = self._checked_value(key, entry, data)
            return data if rows is None else data[rows[0]:rows[1]]
        rows_of = self._chunk_window(key, entry, rel, chunks[0], held=set(names),
                                     fetch=lambda objs: {**doc, **fetch(objs)}, array=array)
        return self._decoded(key, entry, arr, rows, rows_of)

    def _chunk_window(self, key: str, entry: Entry, rel: str, chunk_rows: int, *,
                      held: set[str], fetch: Callable[[list[str]], dict[str, Any]],
                      array: Callable[[dict[str, Any]], Any]
                      ) -> Callable[[int, int, int], np.ndarray]:
        """``rows_of`` for :func:`._zarr_chunks.decode_rows`: chunk ``i`` decoded from its
        object, fetched with the next few (:data:`_FETCH_AHEAD`) and dropped once used.
        ``fetch(objects)`` gives a store's objects (the array's ``zarr.json`` among them)."""
        start = len(self._prefix) + 1 if self._prefix else 0
        window: dict[int, str] = {}
        objects: dict[str, Any] = {}

        def rows_of(i: int, a: int, b: int) -> np.ndarray:
            if i not in window:  # the next few chunks fetched together
                want = {j: self._obj(f"{rel}/{piece_key(len(entry.shape), j)}")
                        for j in range(i, i + _FETCH_AHEAD) if j * chunk_rows < entry.shape[0]}
                lost = [n for n in want.values() if n not in held]
                if lost:
                    raise self.corrupt(key, f"has lost its chunk object {self._loc.join(lost[0])}")
                objects.clear()
                objects.update(fetch(list(want.values())))
                window.clear()
                window.update(want)
            one = window.pop(i)[start:]
            store = {n: v for n, v in objects.items() if n == one or n.endswith("zarr.json")}
            objects.pop(one)
            return np.asarray(self._decode(key, lambda: array(store)[a:b]))

        return rows_of

    def corrupt(self, key: str, what: str) -> CorruptCheckpointError:
        e = self._values.get(key)
        where = ""
        if e is not None:
            rel = (
                f"{PACKED_PATH}/{chunk_key(1)}"
                if e.loc.kind == PACKED
                else f"{e.loc.path}/{chunk_key(len(e.shape))}"
            )
            if self._record.deltas and key in self._record.deltas:  # damage in its base
                d = self._record.deltas[key]
                rel = f"{d.base[1]}/{chunk_key(len(e.shape))}"
                what = in_base(what, d, self.path.rpartition("/")[2])
            where = f" (object {self._loc.join(self._obj(rel))})"
        return self._damaged(key, what + where)

    def _damaged(self, key: str, what: str) -> CorruptCheckpointError:
        """The error saying value ``key`` ``what`` (which names the object)."""
        return CorruptCheckpointError(f"Checkpoint {self.path!r}: value {key!r} {what}.")

    def close(self) -> None:
        ContainerReader.close(self)
