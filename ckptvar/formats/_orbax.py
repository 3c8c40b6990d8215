"""Orbax checkpoints (a step directory, per-array Zarr or OCDBT) read without JAX or Orbax.

Owns: the ``orbax`` backend. A step directory holds ``_CHECKPOINT_METADATA``
(JSON) and either ``_METADATA`` itself (one item, ``Checkpointer.save``) or one
folder per item (``CheckpointManager``: ``default/``, ...), each with
``_METADATA`` (JSON: the pytree's key paths and value types). An item's arrays
are Zarr v2 arrays named by their key path joined with ``.``: one folder per
array (``use_ocdbt=False``, the older layout), or keys of one OCDBT key-value
store (``manifest.ocdbt``, the default since Orbax 0.5), opened through
``tensorstore`` (the ``ckptvar[orbax]`` extra; without it a clear error names
the extra).

A ``CheckpointManager`` directory (numbered step folders) opens at its latest
finished step, as Orbax's ``latest_step()`` and TensorFlow's ``latest_checkpoint``
pick it; the reader's metadata says which (``orbax.latest_step``, ``orbax.steps``).

Items saved with ``use_zarr3=True`` hold Zarr v3 arrays (``zarr.json``), read
by :class:`ZarrV3Array`: regular grid, ``bytes``, ``sharding_indexed`` (index
checked against its CRC-32C), ``zstd``/``gzip``/``crc32c``.

Either way ckptvar parses each ``.zarray`` itself (shape, chunks, dtype
``bfloat16`` included, ``order``, compressor) and decompresses only the chunks
a read needs (a compressor from a fixed list, never one looked up by name:
numcodecs' registry holds codecs that unpickle). Keys are the pytree's
paths joined by ``/`` (``params/dense/kernel``); with several items, each key
starts with its item's name. Every declared size is checked before anything is
allocated, and a chunk whose decoded size is not its grid cell's is refused.
Orbax stores no checksums: values are reported as unchecked.
"""

from __future__ import annotations

import bz2
import itertools
import json
import lzma
import math
import re
import stat
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..storage.base import ArrayInfo, Backend, LazyArray, Reader
from ..storage.links import inside
from ._common import BoxArray, EntryReader, check_shape, not_regular

__all__ = ["OrbaxBackend"]

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ITEM_METADATA = "_METADATA"
MAX_JSON_BYTES = 64 * 1024 * 1024
#: Most chunks one value may be split into (a hostile ``chunks`` of ones is refused).
MAX_CHUNKS = 1 << 20
_ARRAY_TYPES = ("np.ndarray", "jax.Array", "scalar")
_EXTRA = "pip install 'ckptvar[orbax]'"
_STEP_NAME = re.compile(r"(?:.+_)?(\d+)")
#: The Zarr v2 compressors read: what tensorstore writes for Orbax (zstd by default,
#: zlib, gzip, bz2, blosc) and numcodecs' lz4 and lzma. Streams are inflated here to at
#: most a chunk's size; the others decode into a buffer of that size.
_STREAMS = ("zlib", "gzip", "bz2", "lzma")
_V2_COMPRESSORS = frozenset({*_STREAMS, "zstd", "blosc", "lz4"})

Fetch = Callable[[str, int], bytes | None]  # (key, most bytes expected) -> bytes, None: absent


def _json(raw: bytes | None, what: str) -> Any:
    if raw is None:
        raise CorruptCheckpointError(f"{what} is missing.")
    if len(raw) > MAX_JSON_BYTES:
        raise CorruptCheckpointError(f"{what} is {len(raw)} bytes (limit {MAX_JSON_BYTES}).")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{what} is not valid JSON: {exc}.") from None


def _dir_fetch(folder: Path, step: Path) -> Fetch:
    """Reads the files of ``folder``, an item of the Orbax step ``step`` (or the step
    itself); a symbolic link out of the step is refused."""

    def fetch(key: str, limit: int) -> bytes | None:
        path = folder / key
        try:
            inside(step, path, "The Orbax file")
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{str(path)!r} {not_regular(st.st_mode)}.")
            size = st.st_size
            if size > limit:
                raise CorruptCheckpointError(
                    f"{str(path)!r} is {size} bytes; at most {limit} are expected there."
                )
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    return fetch


def _ocdbt_fetch(folder: Path) -> Fetch:
    try:
        import tensorstore as ts
    except ImportError:
        raise UnsupportedFormatError(
            f"{str(folder)!r} is an Orbax OCDBT checkpoint; reading it needs tensorstore: "
            f"{_EXTRA}."
        ) from None
    try:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": folder.absolute().as_uri()}).result()
    except Exception as exc:  # noqa: BLE001 - tensorstore raises ValueError/OSError kinds
        raise CorruptCheckpointError(
            f"The OCDBT store in {str(folder)!r} cannot be opened: {exc}"
        ) from None

    def fetch(key: str, limit: int) -> bytes | None:
        try:
            result = kv.read(key).result()
        except Exception as exc:  # noqa: BLE001
            raise CorruptCheckpointError(
                f"{key!r} in the OCDBT store {str(folder)!r} cannot be read: {exc}"
            ) from None
        if result.state == "missing":
            return None
        if len(result.value) > limit:
            raise CorruptCheckpointError(
                f"{key!r} in the OCDBT store {str(folder)!r} is {len(result.value)} bytes; at "
                f"most {limit} are expected there."
            )
        return bytes(result.value)

    return fetch


def _dtype(name: Any, what: str) -> np.dtype:
    if not isinstance(name, str):
        raise UnsupportedFormatError(f"{what}: dtype {name!r} is not supported.")
    found = getattr(ml_dtypes, name, None)  # bfloat16, float8_*: no byte order in the name
    if found is not None:
        known: np.dtype = np.dtype(found)
        return known
    try:
        dt: np.dtype = np.dtype(name)
    except TypeError:
        raise UnsupportedFormatError(f"{what}: dtype {name!r} is not supported.") from None
    if dt.kind not in "biufc" or dt.fields is not None:
        raise UnsupportedFormatError(f"{what}: dtype {name!r} is not supported.")
    return dt


def _inflate(raw: bytes, nbytes: int, *, kind: str, what: str) -> bytes:
    """A zlib, gzip, bz2 or lzma stream decompressed to at most ``nbytes + 1`` bytes (a
    bomb stops there)."""
    try:
        if kind in ("zlib", "gzip"):
            out = zlib.decompressobj(31 if kind == "gzip" else 15).decompress(raw, nbytes + 1)
        elif kind == "bz2":
            out = bz2.BZ2Decompressor().decompress(raw, nbytes + 1)
        else:
            out = lzma.LZMADecompressor().decompress(raw, nbytes + 1)
    except (zlib.error, OSError, EOFError, lzma.LZMAError) as exc:
        raise CorruptCheckpointError(f"{what} cannot be decompressed: {exc}") from None
    return out


class ZarrV2Array(BoxArray):
    """One Zarr v2 array behind ``fetch``: chunks decoded only when a read needs them."""

    def __init__(self, key: str, name: str, fetch: Fetch, where: str) -> None:
        what = f"The array {name!r} of {where}"
        meta = _json(fetch(f"{name}/.zarray", MAX_JSON_BYTES), f"{what} (.zarray)")
        if not isinstance(meta, dict) or meta.get("zarr_format") != 2:
            raise CorruptCheckpointError(f"{what}: .zarray is not Zarr v2 array metadata.")
        shape = check_shape(meta.get("shape"), what=what, path=where)
        chunks = check_shape(meta.get("chunks"), what=what, path=where)
        if len(chunks) != len(shape) or (shape and 0 in chunks):
            raise CorruptCheckpointError(f"{what}: chunks {list(chunks)} do not fit {list(shape)}.")
        self._grid = tuple(-(-s // c) for s, c in zip(shape, chunks, strict=True))
        if math.prod(self._grid) > MAX_CHUNKS:
            raise CorruptCheckpointError(f"{what}: {math.prod(self._grid)} chunks (limit {MAX_CHUNKS}).")
        stored = _dtype(meta.get("dtype"), what)
        self._stored = stored
        dtype = stored.newbyteorder("=") if stored.byteorder not in ("=", "|") else stored
        self._fortran = meta.get("order", "C") == "F"
        if meta.get("filters"):
            raise UnsupportedFormatError(f"{what}: Zarr filters {meta['filters']!r} are not read.")
        self._codec_config = meta.get("compressor")
        self._sep = meta.get("dimension_separator", ".")
        if self._sep not in (".", "/"):
            raise CorruptCheckpointError(f"{what}: dimension_separator {self._sep!r}.")
        self._fill = meta.get("fill_value")
        self._chunks = chunks
        self._name, self._fetch, self._what = name, fetch, what
        self._codec: Any = None
        self.info = ArrayInfo(key=key, dtype=dtype, shape=shape, attrs={"name": key})

    def _decoder(self) -> Any:
        """The compressor's numcodecs codec (zstd, blosc, lz4: each decodes into a buffer of
        the cell's size), None for none or a stream inflated here; any other compressor is
        refused by name, never looked up (numcodecs' registry holds codecs that unpickle,
        and plugins)."""
        config = self._codec_config
        if config is None or self._codec is not None:
            return self._codec
        name = config.get("id") if isinstance(config, dict) else None
        if name not in _V2_COMPRESSORS:
            raise UnsupportedFormatError(
                f"{self._what}: the Zarr compressor {str(name)[:80]!r} is not read (ckptvar "
                f"reads {', '.join(sorted(_V2_COMPRESSORS))})."
            )
        if name in _STREAMS:
            return None
        import numcodecs

        try:
            self._codec = numcodecs.get_codec(dict(config))
        except (ValueError, TypeError, KeyError) as exc:
            raise UnsupportedFormatError(
                f"{self._what}: compressor {config!r} is not known: {exc}"
            ) from None
        return self._codec

    def _filled(self) -> np.ndarray:
        """A chunk the store left out: every element the declared fill value."""
        try:
            # one element seen as the whole chunk: a chunk of 2^30 elements costs nothing
            return np.broadcast_to(np.array(self._fill, dtype=self.info.dtype), self._chunks)
        except (TypeError, ValueError, OverflowError):
            raise CorruptCheckpointError(
                f"{self._what}: fill value {self._fill!r} does not fit {self.info.dtype}."
            ) from None

    def _chunk(self, index: tuple[int, ...]) -> np.ndarray:
        key = f"{self._name}/" + (self._sep.join(str(i) for i in index) if index else "0")
        nbytes = math.prod(self._chunks) * self._stored.itemsize
        raw = self._fetch(key, nbytes + nbytes // 8 + 65536)  # room for a codec's overhead
        if raw is None:
            if self._fill is None:
                raise CorruptCheckpointError(
                    f"{self._what} has lost its chunk {key!r} (and declares no fill value)."
                )
            return self._filled()
        codec = self._decoder()
        config = self._codec_config if isinstance(self._codec_config, dict) else {}
        if config.get("id") in _STREAMS:  # inflated at most to the cell's size
            raw = _inflate(raw, nbytes, kind=config["id"], what=f"{self._what}: chunk {key!r}")
        elif codec is not None:
            try:
                out = np.empty(nbytes, np.uint8)
                data = codec.decode(raw, out=out)
                decoded = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else data
            except Exception as exc:  # noqa: BLE001 - codecs raise many kinds
                raise CorruptCheckpointError(
                    f"{self._what}: chunk {key!r} cannot be decompressed: {exc}"
                ) from None
            raw = bytes(decoded) if not isinstance(decoded, np.ndarray) else decoded.tobytes()
        if len(raw) != nbytes:
            raise CorruptCheckpointError(
                f"{self._what}: chunk {key!r} holds {len(raw)} bytes; its "
                f"{list(self._chunks)} {self._stored} cell needs {nbytes}."
            )
        arr = np.frombuffer(raw, dtype=self._stored).reshape(
            self._chunks, order="F" if self._fortran else "C"
        )
        return arr.astype(self.info.dtype, copy=False)

    def fill(self, out: np.ndarray, lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
        shape = self.info.shape
        if not shape:
            out[()] = self._chunk(())[()] if self._chunks == () else self._chunk(())
            return
        ranges = [
            range(a0 // c, -(-h // c)) for a0, h, c in zip(lo, hi, self._chunks, strict=True)
        ]
        for index in itertools.product(*ranges):
            start = [i * c for i, c in zip(index, self._chunks, strict=True)]
            a = [max(x, s) for x, s in zip(lo, start, strict=True)]
            b = [
                min(h, s + c, d)
                for h, s, c, d in zip(hi, start, self._chunks, shape, strict=True)
            ]
            if any(x >= y for x, y in zip(a, b, strict=True)):
                continue
            part = self._chunk(tuple(index))
            src = tuple(slice(x - s, y - s) for x, y, s in zip(a, b, start, strict=True))
            dst = tuple(slice(x - z, y - z) for x, y, z in zip(a, b, lo, strict=True))
            out[dst] = part[src]


_NO_CHUNK = (1 << 64) - 1  # a sharding index entry for an inner chunk that was not written
_BYTES_CODECS = ("zstd", "gzip", "crc32c")


def _fill_value(value: Any, dtype: np.dtype, what: str) -> Any:
    """A Zarr v3 ``fill_value`` (number, bool, ``"NaN"``/``"Infinity"``, ``"0x…"`` bits)."""
    if isinstance(value, str):
        special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
        if value in special:
            return special[value]
        if value.startswith("0x"):
            try:
                bits = int(value, 16)
                return np.array(bits, dtype=f"<u{dtype.itemsize}").view(dtype)[()]
            except (ValueError, TypeError, OverflowError):
                pass
        raise CorruptCheckpointError(f"{what}: fill_value {value!r} is not understood.")
    if isinstance(value, list) and len(value) == 2:
        return complex(value[0], value[1])
    return value


def _codec(entry: Any, what: str) -> tuple[str, dict[str, Any]]:
    if isinstance(entry, str):
        return entry, {}
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise CorruptCheckpointError(f"{what}: codec {entry!r} is not a Zarr v3 codec.")
    config = entry.get("configuration") or {}
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{what}: codec {entry['name']!r} has a bad configuration.")
    return entry["name"], config


def _chain(codecs: Any, what: str) -> tuple[str, dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    """``(array-to-bytes name, its configuration, [bytes-to-bytes codecs])``, checked."""
    if not isinstance(codecs, list) or not codecs:
        raise CorruptCheckpointError(f"{what}: codecs {codecs!r} is not a list of codecs.")
    first = _codec(codecs[0], what)
    if first[0] not in ("bytes", "sharding_indexed"):
        raise UnsupportedFormatError(
            f"{what}: the Zarr v3 codec {first[0]!r} is not read (ckptvar reads bytes, "
            f"sharding_indexed, {', '.join(_BYTES_CODECS)})."
        )
    rest = [_codec(c, what) for c in codecs[1:]]
    for name, _ in rest:
        if name not in _BYTES_CODECS:
            raise UnsupportedFormatError(
                f"{what}: the Zarr v3 codec {name!r} is not read (ckptvar reads bytes, "
                f"sharding_indexed, {', '.join(_BYTES_CODECS)})."
            )
    return first[0], first[1], rest


def _undo(raw: bytes, codecs: list[tuple[str, dict[str, Any]]], nbytes: int, what: str) -> bytes:
    """Bytes-to-bytes codecs undone, last first; a CRC-32C is checked, a stream inflates
    to at most ``nbytes + 1`` bytes."""
    from ..storage.checksum import crc32c

    for name, _config in reversed(codecs):
        if name == "crc32c":
            if len(raw) < 4 or crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
                raise CorruptCheckpointError(f"{what} fails its CRC-32C.")
            raw = raw[:-4]
        elif name == "gzip":
            raw = _inflate(raw, nbytes, kind="gzip", what=what)
        else:  # zstd
            import numcodecs

            try:
                out = np.empty(nbytes, np.uint8)
                decoded = numcodecs.Zstd().decode(raw, out=out)
            except Exception as exc:  # noqa: BLE001 - codecs raise many kinds
                raise CorruptCheckpointError(f"{what} cannot be decompressed: {exc}") from None
            raw = np.asarray(decoded).tobytes()
    return raw


def _key_encoding(encoding: Any, what: str) -> tuple[str, str]:
    """``(prefix, separator)`` of chunk keys: ``c/0/0`` (default) or ``0.0`` (v2)."""
    encoding = encoding or {"name": "default"}
    if not isinstance(encoding, dict) or encoding.get("name") not in ("default", "v2"):
        raise UnsupportedFormatError(f"{what}: chunk_key_encoding {encoding!r} is not read.")
    default = encoding["name"] == "default"
    sep = (encoding.get("configuration") or {}).get("separator", "/" if default else ".")
    if sep not in (".", "/"):
        raise CorruptCheckpointError(f"{what}: chunk key separator {sep!r}.")
    return ("c" if default else ""), sep


class ZarrV3Array(ZarrV2Array):
    """One Zarr v3 array (``use_zarr3=True``) behind ``fetch``: plain chunks or shards
    (``sharding_indexed``), decoded only when a read needs them."""

    def __init__(self, key: str, name: str, fetch: Fetch, where: str) -> None:
        what = f"The array {name!r} of {where}"
        meta = _json(fetch(f"{name}/zarr.json", MAX_JSON_BYTES), f"{what} (zarr.json)")
        if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
            raise CorruptCheckpointError(f"{what}: zarr.json is not Zarr v3 array metadata.")
        shape = check_shape(meta.get("shape"), what=what, path=where)
        grid = meta.get("chunk_grid")
        if not isinstance(grid, dict) or grid.get("name") != "regular":
            raise UnsupportedFormatError(f"{what}: chunk grid {grid!r} is not read (only regular).")
        outer = check_shape((grid.get("configuration") or {}).get("chunk_shape"), what=what, path=where)
        if len(outer) != len(shape) or (shape and 0 in outer):
            raise CorruptCheckpointError(f"{what}: chunks {list(outer)} do not fit {list(shape)}.")
        dtype = _dtype(meta.get("data_type"), what)
        kind, config, self._codecs = _chain(meta.get("codecs"), what)
        self._per_shard: tuple[int, ...] | None = None
        chunks = outer
        if kind == "sharding_indexed":
            chunks, config = self._sharding(config, outer, what, where)
        endian = config.get("endian", "little")
        if endian not in ("little", "big"):
            raise CorruptCheckpointError(f"{what}: endian {endian!r}.")
        self._stored = dtype.newbyteorder("<" if endian == "little" else ">") if dtype.itemsize > 1 else dtype
        self._grid = tuple(-(-s // c) for s, c in zip(shape, chunks, strict=True))
        if math.prod(self._grid) > MAX_CHUNKS:
            raise CorruptCheckpointError(f"{what}: {math.prod(self._grid)} chunks (limit {MAX_CHUNKS}).")
        self._prefix, self._sep = _key_encoding(meta.get("chunk_key_encoding"), what)
        self._fill = _fill_value(meta.get("fill_value"), dtype, what)
        self._fortran = False
        self._chunks = chunks
        self._outer = outer
        self._name, self._fetch, self._what = name, fetch, what
        self._codec_config = None
        self._codec = None
        self._shard_cache: tuple[tuple[int, ...], bytes | None] | None = None
        self.info = ArrayInfo(key=key, dtype=dtype, shape=shape, attrs={"name": key})

    def _sharding(
        self, config: dict[str, Any], outer: tuple[int, ...], what: str, where: str
    ) -> tuple[tuple[int, ...], dict[str, Any]]:
        """The inner chunk shape and its ``bytes`` codec's configuration; sets the index layout."""
        chunks = check_shape(config.get("chunk_shape"), what=what, path=where)
        if len(chunks) != len(outer) or any(c == 0 or o % c for o, c in zip(outer, chunks, strict=True)):
            raise CorruptCheckpointError(
                f"{what}: inner chunks {list(chunks)} do not divide shards {list(outer)}."
            )
        if self._codecs:
            raise UnsupportedFormatError(f"{what}: codecs after sharding_indexed are not read.")
        kind, inner, self._codecs = _chain(config.get("codecs"), f"{what} (inner chunks)")
        if kind != "bytes":
            raise UnsupportedFormatError(f"{what}: nested sharding is not read.")
        index_kind, _, index_codecs = _chain(config.get("index_codecs", ["bytes"]), f"{what} (index)")
        if index_kind != "bytes" or [n for n, _ in index_codecs] not in ([], ["crc32c"]):
            raise UnsupportedFormatError(f"{what}: shard index codecs {index_codecs!r} are not read.")
        self._index_crc = bool(index_codecs)
        location = config.get("index_location", "end")
        if location not in ("start", "end"):
            raise CorruptCheckpointError(f"{what}: index_location {location!r}.")
        self._index_at_end = location == "end"
        self._per_shard = tuple(o // c for o, c in zip(outer, chunks, strict=True))
        return chunks, inner

    def _key(self, index: tuple[int, ...]) -> str:
        if self._prefix:
            return f"{self._name}/c" + "".join(f"{self._sep}{i}" for i in index)
        return f"{self._name}/" + (self._sep.join(str(i) for i in index) if index else "0")

    def _decode(self, raw: bytes, where: str) -> np.ndarray:
        nbytes = math.prod(self._chunks) * self._stored.itemsize
        raw = _undo(raw, self._codecs, nbytes, where)
        if len(raw) != nbytes:
            raise CorruptCheckpointError(
                f"{where} holds {len(raw)} bytes; its {list(self._chunks)} {self._stored} cell "
                f"needs {nbytes}."
            )
        arr = np.frombuffer(raw, dtype=self._stored).reshape(self._chunks)
        return arr.astype(self.info.dtype, copy=False)

    def _chunk(self, index: tuple[int, ...]) -> np.ndarray:
        cell = math.prod(self._chunks) * self._stored.itemsize
        if self._per_shard is None:
            key = self._key(index)
            raw = self._fetch(key, cell + cell // 8 + 65536)
            return self._filled() if raw is None else self._decode(raw, f"{self._what}: chunk {key!r}")
        shard_at = tuple(i // p for i, p in zip(index, self._per_shard, strict=True))
        key = self._key(shard_at)
        if self._shard_cache is None or self._shard_cache[0] != shard_at:
            n = math.prod(self._per_shard)
            self._shard_cache = (shard_at, self._fetch(key, n * (cell + cell // 8 + 1024) + 65536))
        shard = self._shard_cache[1]
        if shard is None:
            return self._filled()
        where = f"{self._what}: shard {key!r}"
        n = math.prod(self._per_shard)
        size = 16 * n + (4 if self._index_crc else 0)
        if len(shard) < size:
            raise CorruptCheckpointError(f"{where} is {len(shard)} bytes, shorter than its index.")
        index_raw = shard[-size:] if self._index_at_end else shard[:size]
        if self._index_crc:
            index_raw = _undo(index_raw, [("crc32c", {})], size - 4, f"{where} (index)")
        table = np.frombuffer(index_raw, dtype="<u8").reshape(n, 2)
        inner = tuple(i % p for i, p in zip(index, self._per_shard, strict=True))
        offset, nbytes = (int(v) for v in table[np.ravel_multi_index(inner, self._per_shard)])
        if offset == _NO_CHUNK and nbytes == _NO_CHUNK:
            return self._filled()
        if offset + nbytes > len(shard):
            raise CorruptCheckpointError(
                f"{where}: inner chunk {list(inner)} at [{offset}, {offset + nbytes}) lies "
                f"outside its {len(shard)} bytes."
            )
        return self._decode(shard[offset : offset + nbytes], f"{where}, inner chunk {list(inner)}")


class OrbaxReader(EntryReader):
    """A read-only view of one Orbax step directory."""

    def __init__(
        self, path: Path, arrays: dict[str, LazyArray], metadata: dict[str, Any], skipped: dict[str, str]
    ) -> None:
        super().__init__(path, "orbax", arrays, skipped=skipped, metadata=metadata)


def _items(step: Path) -> list[tuple[str, Path]]:
    if (step / ITEM_METADATA).is_file():
        return [("", step)]
    items = sorted(p for p in step.iterdir() if p.is_dir() and (p / ITEM_METADATA).is_file())
    if not items:
        raise CorruptCheckpointError(
            f"The Orbax step {str(step)!r} has no item (no {ITEM_METADATA} in it or its folders)."
        )
    if len(items) == 1:
        return [("", items[0])]
    return [(p.name + "/", p) for p in items]


def _item_arrays(
    prefix: str, folder: Path, step: Path, arrays: dict[str, LazyArray], skipped: dict[str, str]
) -> None:
    where = repr(str(folder))
    meta = _json(
        _dir_fetch(folder, step)(ITEM_METADATA, MAX_JSON_BYTES), f"{str(folder / ITEM_METADATA)!r}"
    )
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"{str(folder / ITEM_METADATA)!r} has no tree_metadata.")
    array_type = ZarrV3Array if meta.get("use_zarr3") else ZarrV2Array
    ocdbt = (folder / "manifest.ocdbt").is_file() or bool(meta.get("use_ocdbt"))
    fetch = _ocdbt_fetch(folder) if ocdbt else _dir_fetch(folder, step)
    for entry in tree.values():
        if not isinstance(entry, dict) or not isinstance(entry.get("key_metadata"), list):
            raise CorruptCheckpointError(f"{where}: a tree_metadata entry has no key_metadata.")
        parts = []
        for part in entry["key_metadata"]:
            if not isinstance(part, dict) or not isinstance(part.get("key"), str | int):
                raise CorruptCheckpointError(f"{where}: a key_metadata entry {part!r} is bad.")
            parts.append(str(part["key"]))
        name = ".".join(parts)
        if not name or ".." in name.split("/") or name.startswith("/") or "\\" in name:
            raise CorruptCheckpointError(f"{where}: the parameter name {name!r} is refused.")
        key = prefix + "/".join(parts)
        if key in arrays or key in skipped:  # {"a/b": x, "a": {"b": y}}: both join to a/b
            skipped[f"{key} {tuple(parts)!r}"] = (
                f"its pytree path {tuple(parts)!r} joins with '/' to the key {key!r} of "
                "another value, which is read under it")
            continue
        value = entry.get("value_metadata") or {}
        kind = value.get("value_type") if isinstance(value, dict) else None
        if isinstance(value, dict) and value.get("skip_deserialize"):
            skipped[key] = "saved with skip_deserialize (its value is not in the checkpoint)"
        elif kind not in _ARRAY_TYPES:
            skipped[key] = f"an Orbax {kind!r} value, not an array"
        else:
            arrays[key] = array_type(key, name, fetch, where)


def _is_step(folder: Path) -> bool:
    """Whether ``folder`` is a finished Orbax step (its metadata, or an item's, is there)."""
    if (folder / CHECKPOINT_METADATA).is_file() or (folder / ITEM_METADATA).is_file():
        return True
    try:
        return any(p.is_dir() and (p / ITEM_METADATA).is_file() for p in folder.iterdir())
    except OSError:
        return False


def steps(run: Path) -> dict[int, Path]:
    """The finished steps of a ``CheckpointManager`` directory: ``{step: folder}``.

    A step folder is named by its number (``5``, ``00005``, or ``prefix_5`` with
    ``step_prefix``), as Orbax names them; unfinished saves (``5.orbax-checkpoint-tmp-...``)
    and folders without a step's metadata are left out, as Orbax leaves them out.
    """
    found: dict[int, Path] = {}
    try:
        children = sorted(run.iterdir())
    except OSError:
        return found
    for child in children:
        number = _STEP_NAME.fullmatch(child.name)
        if number is not None and child.is_dir() and _is_step(child):
            found.setdefault(int(number.group(1)), child)
    return found


def _open(path: Path) -> Reader:
    step = path.parent if path.name in (CHECKPOINT_METADATA, ITEM_METADATA) else path
    run_note: dict[str, Any] = {}
    if step.is_dir() and not _is_step(step):
        found = steps(step)
        if not found:
            raise CorruptCheckpointError(
                f"{str(step)!r} is neither an Orbax step nor a run directory with finished steps."
            )
        latest = max(found)
        run_note = {"orbax.latest_step": latest, "orbax.steps": sorted(found)}
        step = inside(step, found[latest], "The Orbax step")  # never another run's step
    arrays: dict[str, LazyArray] = {}
    skipped: dict[str, str] = {}
    for prefix, folder in _items(step):
        _item_arrays(prefix, folder, step, arrays, skipped)
    metadata: dict[str, Any] = {}
    raw = _dir_fetch(step, step)(CHECKPOINT_METADATA, MAX_JSON_BYTES)
    if raw is not None:
        top = _json(raw, repr(str(step / CHECKPOINT_METADATA)))
        if isinstance(top, dict):
            custom = top.get("custom_metadata")
            if isinstance(custom, dict):
                metadata.update(custom)
            if top.get("metrics"):
                metadata["metrics"] = top["metrics"]
    metadata.update(run_note)
    return OrbaxReader(step, arrays, metadata, skipped)


class OrbaxBackend(Backend, name="orbax", suffixes=()):
    """Orbax step directories (per-array Zarr, or OCDBT through tensorstore), read-only."""

    @classmethod
    def sniff(cls, path: Path) -> bool:
        path = Path(path)
        if path.name in (CHECKPOINT_METADATA, ITEM_METADATA) and path.is_file():
            return True
        if not path.is_dir():
            return False
        if (path / CHECKPOINT_METADATA).is_file() or (path / ITEM_METADATA).is_file():
            return True
        return bool(steps(path))  # a CheckpointManager directory: its latest step

    @classmethod
    def open_reader(cls, path: Path) -> Reader:
        return _open(Path(path))
