"""Hugging Face sharded safetensors: ``model.safetensors.index.json`` + its shards, as one checkpoint.

Owns: the ``hf-safetensors`` backend. The layout is the one ``transformers``
writes with ``save_pretrained(safe_serialization=True)``: a folder holding
``model-0000K-of-0000N.safetensors`` shards and an index
``{"metadata": {"total_size": N}, "weight_map": {key: shard file}}``, or, for a
model that fits one shard, a single ``model.safetensors`` and no index.

Reading takes the index file or the folder. The index is checked before
anything else (a JSON object with a ``weight_map`` of plain file names, each
shard present); a shard is opened (its header parsed and validated by the
safetensors reader) only when one of its values is first asked for, so a read
of one value opens one shard. A key the index places in a shard that does not
hold it is a ``CorruptCheckpointError`` naming both.

Writing (``format="hf-safetensors"``, ``max_shard_size``: bytes or ``"5GB"``)
fills shards in key order, starting a new one when the next value would pass
the limit (a larger value gets a shard of its own), with ``format: pt`` in each
shard's metadata, into a temporary sibling folder renamed onto the target.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, MissingKeyError, UnsupportedFormatError
from ..storage.base import ArrayInfo, Backend, LazyArray, Reader, Writer, verify_each
from ..storage.chunked import is_chunked
from ..storage.links import inside
from ._json import unique_keys
from ._safetensors import SafetensorsBackend, SafetensorsWriter, stored_nbytes

__all__ = ["HFShardedBackend", "HFShardedWriter", "parse_shard_size"]

INDEX_SUFFIX = ".safetensors.index.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: Largest index file read (a model with millions of tensors stays far below).
MAX_INDEX_BYTES = 64 * 1024 * 1024
#: transformers 4's default shard limit.
DEFAULT_SHARD_SIZE = 5 * 10**9
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_shard_size(size: int | str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"20KiB"`` -> 20480, as transformers reads ``max_shard_size``.

    >>> parse_shard_size("5GB"), parse_shard_size("20KiB"), parse_shard_size(4096)
    (5000000000, 20480, 4096)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise ValueError(f"max_shard_size {size!r} is not a size (like 5GB, 500MB, 20KiB).")
        value = int(float(m[1]) * _UNITS[(m[2] or "").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}.")
    return value


def _find_index(path: Path) -> Path | None:
    """The index file of ``path`` (the index itself or a folder holding one); ``None``."""
    if path.is_file():
        return path if path.name.endswith(INDEX_SUFFIX) else None
    if not path.is_dir():
        return None
    if (path / INDEX_NAME).is_file():
        return path / INDEX_NAME
    found = sorted(p for p in path.glob("*" + INDEX_SUFFIX) if p.is_file())
    return found[0] if len(found) == 1 else None


def _plain_name(name: Any, index: Path) -> str:
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
    ):
        raise CorruptCheckpointError(
            f"The index {str(index)!r} names the shard {name!r}, which is not a file name "
            "beside it; refused."
        )
    return name


def _read_index(index: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """``({key: shard file}, metadata)`` of an index file, checked."""
    try:
        size = index.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise CorruptCheckpointError(
                f"The index {str(index)!r} is {size} bytes (limit {MAX_INDEX_BYTES})."
            )
        text = index.read_bytes().decode("utf-8")
        obj = json.loads(text, object_pairs_hook=unique_keys)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"The index {str(index)!r} is refused: {exc}") from None
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"The index {str(index)!r} is not UTF-8: {exc}.") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"The index {str(index)!r} is not valid JSON: {exc}.") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise CorruptCheckpointError(
            f"The index {str(index)!r} is not a safetensors index (no 'weight_map' object)."
        )
    meta = obj.get("metadata", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"'metadata' in the index {str(index)!r} is not an object.")
    weight_map = {}
    for key, name in obj["weight_map"].items():
        weight_map[key] = _plain_name(name, index)
    return weight_map, dict(meta)


class HFShardedReader(Reader):
    """A read-only view of a sharded (or single-file) Hugging Face safetensors model.

    ``open_files`` lists the shard files opened so far, in the order they were opened.
    """

    format = "hf-safetensors"

    def __init__(self, path: Path, weight_map: dict[str, Path], metadata: dict[str, Any]) -> None:
        self.path = path
        self._map = weight_map
        self._meta = metadata
        self._strays: dict[str, list[tuple[str, Path]]] | None = None
        self._shards: dict[Path, Reader] = {}
        self.open_files: list[Path] = []
        self._first = next(iter(dict.fromkeys(weight_map.values())), None)

    def shard_reader(self, key: str) -> Reader:
        """The reader of the shard holding ``key`` (opened on first use)."""
        shard = self._shard_of(key)
        reader = self._open_shard(shard)
        if key not in reader:
            raise CorruptCheckpointError(
                f"The index of {str(self.path)!r} places {key!r} in {str(shard)!r}, which does "
                f"not hold it ({len(reader)} keys)."
            )
        return reader

    def _shard_of(self, key: str) -> Path:
        try:
            return self._map[key]
        except (KeyError, TypeError):
            sample = ", ".join(repr(k) for k in list(self._map)[:5])
            raise MissingKeyError(
                f"No key {key!r} in the hf-safetensors checkpoint {str(self.path)!r} "
                f"({len(self._map)} keys{', e.g. ' + sample if sample else ''})."
            ) from None

    def _open_shard(self, shard: Path) -> Reader:
        reader = self._shards.get(shard)
        if reader is None:
            if not shard.is_file():
                raise CorruptCheckpointError(
                    f"The shard {str(shard)!r} of {str(self.path)!r} is missing."
                )
            reader = SafetensorsBackend.open_reader(shard)
            self._shards[shard] = reader
            self.open_files.append(shard)
        return reader

    @property
    def skipped(self) -> dict[str, str]:  # type: ignore[override]
        """Values a shard holds that the index does not list (opens every shard's header).

        safetensors holds numbers only, so nothing else is ever skipped.
        """
        return {
            key: f"held by the shard {str(shard.name)!r} but not listed in the index"
            for key, places in self._stray_keys().items()
            if key not in self._map
            for _, shard in places[:1]
        }

    def _stray_keys(self) -> dict[str, list[tuple[str, Path]]]:
        """``{key: [(why, shard), ...]}`` for each key a shard holds where the index does not
        place it: not listed at all, or listed in another shard (a second copy)."""
        if self._strays is None:
            strays: dict[str, list[tuple[str, Path]]] = {}
            for shard in dict.fromkeys(self._map.values()):
                try:
                    held = list(self._open_shard(shard).keys())
                except CorruptCheckpointError:
                    continue  # a damaged shard fails each read of its values instead
                for key in held:
                    if self._map.get(key) != shard:
                        why = ("not listed in the index" if key not in self._map else
                               f"the index places it in {self._map[key].name!r}")
                        strays.setdefault(key, []).append((why, shard))
            self._strays = strays
        return self._strays

    def keys(self) -> Any:
        return self._map.keys()

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def info(self, key: str) -> ArrayInfo:
        return self.shard_reader(key).info(key)

    def __getitem__(self, key: str) -> LazyArray:
        return self.shard_reader(key)[key]  # reads that shard's header, no other

    def read(self, key: str, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        return self.shard_reader(key).read(key, out=out, verify=verify)

    def metadata(self) -> dict[str, Any]:
        """The first shard's metadata (``format``, ckptvar's own) and the index's."""
        meta: dict[str, Any] = {}
        if self._first is not None:
            meta.update(self._open_shard(self._first).metadata())
        meta.update(self._meta)
        return meta

    def verify_all(self) -> list[tuple[str, str]]:
        """Read and check every value, shard by shard; ``[(key, reason), ...]``, including
        each value a shard holds where the index does not place it (left out of every read)."""
        problems = verify_each(self, self._map)
        for key, places in self._stray_keys().items():
            for why, shard in places:
                problems.append((key, f"held by the shard {str(shard)!r}, but {why}"))
        return problems

    def verify(self, key: str) -> None:
        try:
            self.read(key, verify=True)
        except OSError as exc:
            raise CorruptCheckpointError(f"{key!r} of {str(self.path)!r}: {exc}") from None

    def close(self) -> None:
        for reader in self._shards.values():
            reader.close()
        self._shards.clear()

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __repr__(self) -> str:
        return f"<HFShardedReader {str(self.path)!r} ({len(self._map)} keys)>"


def _open(path: Path) -> Reader:
    index = _find_index(path)
    if index is None:
        single = path / SINGLE_NAME if path.is_dir() else None
        if single is None or not single.is_file():
            raise CorruptCheckpointError(
                f"{str(path)!r} holds no {INDEX_NAME} (nor a single {SINGLE_NAME})."
            )
        inside(path, single, "The file", hub=True)
        with SafetensorsBackend.open_reader(single) as one:
            keys = list(one.keys())
        return HFShardedReader(path, {k: single for k in keys}, {})
    weight_map, meta = _read_index(index)
    folder = index.parent
    shards = {name: folder / name for name in dict.fromkeys(weight_map.values())}
    for name, shard in shards.items():
        inside(folder, shard, f"The shard {name!r} of the index {str(index)!r},", hub=True)
        if not shard.is_file():
            raise CorruptCheckpointError(
                f"The index {str(index)!r} names the shard {name!r}, which is missing."
            )
    return HFShardedReader(index, {k: shards[v] for k, v in weight_map.items()}, meta)


def _is_layout_only(folder: Path) -> bool:
    """True for a folder holding nothing but safetensors shards and their index."""
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return False
    return bool(names) and all(n.endswith((".safetensors", INDEX_SUFFIX)) for n in names)


class HFShardedWriter(Writer):
    """Writes a Hugging Face model folder: shards of at most ``max_shard_size`` + the index."""

    def __init__(
        self,
        path: Path,
        *,
        max_shard_size: int | str = DEFAULT_SHARD_SIZE,
        metadata: Mapping[str, str] | None = None,
        ckptvar_metadata: bool = True,
        durable: bool = True,
    ) -> None:
        """``metadata``: string pairs for every shard's ``__metadata__`` (``format: pt`` is
        always written); ``ckptvar_metadata=False`` leaves out ckptvar's own keys."""
        self.path = Path(path)
        if self.path.name.endswith(INDEX_SUFFIX):
            raise UnsupportedFormatError(
                f"Cannot write {str(path)!r}: the hf-safetensors format writes a folder (its "
                f"shards and {INDEX_NAME}); name the folder, e.g. {str(self.path.parent)!r}."
            )
        self._limit = parse_shard_size(max_shard_size)
        self._extra = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
        self._own = ckptvar_metadata
        self._durable = durable
        self._items: dict[str, tuple[np.ndarray, Mapping[str, Any] | None]] = {}
        self._metadata: dict[str, Any] | None = None
        self._done = False

    def add(self, key: str, array: np.ndarray, attrs: Mapping[str, Any] | None = None) -> None:
        if key in self._items:
            raise ValueError(f"Key {key!r} was already added to {str(self.path)!r}.")
        # a Chunked value (a staged GPU tensor) stays one: its shard streams its pieces
        self._items[key] = (array if is_chunked(array) else np.asarray(array), attrs)

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        self._metadata = dict(metadata)

    def abort(self) -> None:
        self._items.clear()
        self._done = True

    def _groups(self) -> list[list[str]]:
        groups: list[list[str]] = [[]]
        size = 0
        for key, (array, _) in self._items.items():
            nbytes = stored_nbytes(array)  # as the shard holds it (sub-byte values packed)
            if groups[-1] and size + nbytes > self._limit:
                groups.append([])
                size = 0
            groups[-1].append(key)
            size += nbytes
        return groups

    def commit(self) -> Path:
        if self._done:
            raise ValueError(f"The writer of {str(self.path)!r} was already closed.")
        from ..storage.atomic import check_destination, publish, temporary_sibling

        check_destination(self.path, directory=True, replaceable=_is_layout_only)
        groups = self._groups()
        n = len(groups)
        names = (
            [SINGLE_NAME]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        with temporary_sibling(self.path) as tmp:
            os.mkdir(tmp)
            weight_map: dict[str, str] = {}
            for name, keys in zip(names, groups, strict=True):
                shard = SafetensorsWriter(
                    tmp / name,
                    metadata=self._extra,
                    ckptvar_metadata=self._own,
                    durable=self._durable,
                )
                for key in keys:
                    array, attrs = self._items[key]
                    shard.add(key, array, attrs)
                    weight_map[key] = name
                if self._metadata:
                    shard.set_metadata(self._metadata)
                shard.commit()
            if n > 1:
                total = sum(stored_nbytes(a) for a, _ in self._items.values())
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                text = json.dumps(index, indent=2, sort_keys=True) + "\n"
                fd = os.open(tmp / INDEX_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    view = memoryview(text.encode("utf-8"))
                    while len(view) > 0:
                        view = view[os.write(fd, view) :]
                    if self._durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            publish(tmp, self.path, durable=self._durable, replaceable=_is_layout_only)
        self._done = True
        self._items.clear()
        return self.path


class HFShardedBackend(
    Backend, name="hf-safetensors", suffixes=(INDEX_SUFFIX,), writer=HFShardedWriter
):
    """Hugging Face sharded safetensors (an index + shards, or a model folder); read and write."""

    @classmethod
    def sniff(cls, path: Path) -> bool:
        path = Path(path)
        if _find_index(path) is not None:
            return True
        return path.is_dir() and (path / SINGLE_NAME).is_file()

    @classmethod
    def open_reader(cls, path: Path) -> Reader:
        return _open(Path(path))
