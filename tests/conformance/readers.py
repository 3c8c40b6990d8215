"""ReaderTests: the conformance suite every reader of another tool's files runs.

A foreign reader gets the whole suite by subclassing :class:`ReaderTests` and naming
its fixture (``fixture``: a file of fixtures/manifest.json, made by the producing
library, and ``fmt``). Hooks, each with a default a format may replace:

- :meth:`ReaderTests.source`: the file to open (default: a copy of the fixture);
- :meth:`ReaderTests.expected`: ``{key: (shape, dtype, sha256)}`` (default: the manifest);
- :meth:`ReaderTests.damaged`: a copy with a value damaged, and that key (default: the
  file cut in half); ``checksummed`` formats flip one byte of the key's value instead,
  and the damage must be caught by its checksum.

The claims: it opens with its format and closes its files; it lists what the producer wrote;
shapes and dtypes come without reading; every value is bit-exact (also into ``out=``);
lazy slices equal slices of the whole; a missing key is named; damage is refused with
a ``CorruptCheckpointError``; hostile input (flipped and cut bytes) loads or raises a
``CkptError``, and never allocates far beyond the file.
"""

from __future__ import annotations

import gc
import hashlib
import json
import random
import shutil
import time
import tracemalloc
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import CkptError, CorruptCheckpointError, MissingKeyError
from ckptvar.storage import SupportsShapeAndDtype, backend_for

__all__ = ["FIXTURES", "MANIFEST", "ReaderTests", "flip", "sha256"]

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "manifest.json").read_text())["files"]
#: Producer dtype names -> NumPy names.
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
           "I64": "int64", "BOOL": "bool", "U8": "uint8", "I32": "int32"}
#: A TensorFlow object checkpoint's keys are shown without this suffix.
_TF_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
#: Hostile input may not make a reader allocate more than this beyond the file's size.
_ALLOC_SLACK = 64 << 20


def sha256(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def flip(path: Path, offset: int, xor: int = 0x10) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= xor
    path.write_bytes(bytes(raw))


def _open_below(folder: Path) -> list[str]:
    """The files below ``folder`` this process has open (Linux: /proc/self/fd)."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = fd.readlink()
        except OSError:
            continue
        if str(target).startswith(str(folder)):
            found.append(str(target))
    return found


def _read_all(path: Path) -> dict[str, np.ndarray]:
    with cv.open(path) as reader:
        return {k: reader[k].read() for k in reader}


class ReaderTests:
    """The claims of a reader of another tool's files (see the module docstring)."""

    fixture: ClassVar[str]
    fmt: ClassVar[str]
    #: Whether each value carries a checksum the reader checks (TF CRC-32C, zip CRC-32).
    checksummed: ClassVar[bool] = False

    # -- hooks
    def source(self, tmp: Path) -> Path:
        """The file (or TensorFlow prefix) to open: a copy of the fixture in ``tmp``."""
        src = FIXTURES / self.fixture
        if src.is_dir():  # a folder checkpoint (Hugging Face shards, DCP, Orbax)
            shutil.copytree(src, tmp / src.name)
        elif src.exists():
            shutil.copy(src, tmp / src.name)
        else:  # a prefix: copy its siblings
            for f in src.parent.glob(src.name + ".*"):
                shutil.copy(f, tmp / f.name)
        return tmp / src.name

    def expected(self) -> dict[str, tuple[tuple[int, ...], str, str]]:
        """``{key: (shape, dtype, sha256)}`` as the producing library wrote them."""
        entry = MANIFEST[self.fixture]
        out = {}
        for key, t in entry["tensors"].items():
            shown = key[: -len(_TF_SUFFIX)] if key.endswith(_TF_SUFFIX) else key
            out[shown] = (tuple(t["shape"]), _DTYPES.get(t["dtype"], t["dtype"]), t["sha256"])
        return out

    def data_files(self, path: Path) -> list[Path]:
        """The files that hold the values of ``path`` (for a prefix: its data files)."""
        if path.is_dir():  # a folder: its largest files hold the values
            files = [p for p in path.rglob("*") if p.is_file()]
            return sorted(files, key=lambda p: p.stat().st_size, reverse=True)
        if path.exists():
            return [path]
        return sorted(p for p in path.parent.glob(path.name + ".data-*"))

    def damaged(self, tmp: Path) -> tuple[Path, str | None]:
        """A damaged copy and the key damaged (``None``: some value): cut in half."""
        path = self.source(tmp)
        victim = self.data_files(path)[0]
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
        return path, None

    # -- the claims
    def test_opens_with_its_format_and_closes(self, tmp_path: Path) -> None:
        path = self.source(tmp_path)
        assert backend_for(path).name == self.fmt
        with cv.open(path) as reader:
            assert reader.format == self.fmt
            reader[next(iter(reader))].read()
        if self.fmt == "orbax":  # an OCDBT store's files are opened and closed by
            # tensorstore on its own threads: released with the reader, closed a moment later
            deadline = time.monotonic() + 5
            while _open_below(tmp_path) and time.monotonic() < deadline:
                gc.collect()
                time.sleep(0.02)
        assert not _open_below(tmp_path), "closing the reader left a file open"

    def test_lists_what_the_producer_wrote(self, tmp_path: Path) -> None:
        with cv.open(self.source(tmp_path)) as reader:
            assert sorted(reader.keys()) == sorted(self.expected())
            assert len(reader) == len(self.expected())

    def test_shape_and_dtype_come_without_reading(self, tmp_path: Path) -> None:
        with cv.open(self.source(tmp_path)) as reader:
            for key, (shape, dtype, _) in self.expected().items():
                info = reader.info(key)
                assert (info.shape, str(info.dtype)) == (shape, dtype), key
                assert info.attrs["name"] == key
                if isinstance(reader, SupportsShapeAndDtype):
                    assert reader.shape_and_dtype(key) == (info.shape, info.dtype)

    def test_every_value_is_bit_exact(self, tmp_path: Path) -> None:
        with cv.open(self.source(tmp_path)) as reader:
            for key, (shape, dtype, digest) in self.expected().items():
                value = reader[key].read()
                assert (value.shape, str(value.dtype)) == (shape, dtype), key
                assert sha256(value) == digest, key
                out = np.full(shape, 1, dtype=value.dtype)
                reader.read(key, out=out)
                assert sha256(out) == digest, key

    def test_lazy_slices_equal_slices_of_the_whole(self, tmp_path: Path) -> None:
        with cv.open(self.source(tmp_path)) as reader:
            for key in reader:
                lazy = reader[key]
                whole = lazy.read()
                if whole.ndim == 0:
                    np.testing.assert_array_equal(lazy[()], whole)
                    continue
                indexes: list[Any] = [slice(0, 1), slice(1, None, 2), slice(None, None, -1)]
                if whole.shape[0]:
                    indexes.append(-1)
                if whole.ndim > 1 and whole.shape[-1]:
                    indexes.append((Ellipsis, 0))
                for index in indexes:
                    np.testing.assert_array_equal(lazy[index], whole[index],
                                                  err_msg=f"{key}[{index}]")

    def test_a_missing_key_is_named(self, tmp_path: Path) -> None:
        with cv.open(self.source(tmp_path)) as reader, \
                pytest.raises(MissingKeyError, match="no/such/key"):
            reader["no/such/key"]

    def test_damage_is_refused(self, tmp_path: Path) -> None:
        path, key = self.damaged(tmp_path)
        with pytest.raises(CorruptCheckpointError):
            _read_all(path)
        if not self.checksummed:
            return
        assert key is not None
        with cv.open(path) as reader:  # caught by the value's checksum, however it is read
            assert reader.info(key).checksum is not None
            for index in (Ellipsis, slice(None), (slice(None), 0), ()):
                with pytest.raises(CorruptCheckpointError, match="CRC"):
                    reader[key][index]
            with pytest.raises(CorruptCheckpointError, match="CRC"):
                np.asarray(reader[key])
            # A slice of some rows reads only them, unverified (docs/formats.md says so).
            assert reader[key][0:1].shape[0] == 1
            assert [k for k, _ in reader.verify_all()] == [key]

    def test_hostile_input_loads_or_raises_and_stays_bounded(self, tmp_path: Path) -> None:
        rng = random.Random(self.fixture)
        for trial in range(12):
            where = tmp_path / f"t{trial}"
            where.mkdir()
            path = self.source(where)
            files = (sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir()
                     else [path] if path.exists() else sorted(where.glob(path.name + ".*")))
            size = sum(f.stat().st_size for f in files)
            victim = rng.choice(files)
            data = bytearray(victim.read_bytes())
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= rng.randint(1, 255)
            if trial % 3 == 0:
                data = data[: rng.randrange(len(data))]
            victim.write_bytes(bytes(data))
            tracemalloc.start()
            try:
                _read_all(path)
            except CkptError:
                pass
            finally:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            assert peak < 4 * size + _ALLOC_SLACK, f"trial {trial}: {peak} bytes allocated"
