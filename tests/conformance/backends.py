"""BackendTests: the conformance suite of ckptvar's own writable containers.

A backend gets the whole suite by subclassing :class:`BackendTests` and filling its
hooks (``fmt``, ``suffix``, ``max_files_for_small_values``, ``value_at``,
``record_at``); tests/test_storage_backends.py does it for HDF5 and Zarr.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
import pytest

from ckptvar._dtypes import SUPPORTED_DTYPES
from ckptvar.errors import CheckpointNotFoundError, CorruptCheckpointError, MissingKeyError
from ckptvar.storage import backend_for
from ckptvar.storage._container import ContainerReader
from ckptvar.storage._record import BLOCK_SIZE
from ckptvar.storage.atomic import is_partial

__all__ = ["ODD_KEYS", "BackendTests", "sample"]

ODD_KEYS = [
    "..", ".", "/", "a//b", "%", "%2E", "_ckptvar/record", "zarr.json", "x/zarr.json",
    "Ünïcødé/名前", "A", "a", "sp ace:colon\\back", "n" * 300, "n" * 300 + "x", "__dunder",
    "model", "model/kernel", "",
]


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = SUPPORTED_DTYPES[dtype]
    n = int(np.prod(shape))
    if dt.kind == "b":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dt.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt).reshape(shape)
    if dt.kind in "iu":
        return rng.integers(0, 100, n).astype(dt).reshape(shape)
    return rng.standard_normal(n).astype(dt).reshape(shape)


class BackendTests:
    """The claims every writable ckptvar container makes; a backend subclasses it and
    fills the hooks (where a value's bytes and the root record are), no ``if fmt``."""

    fmt: ClassVar[str]
    suffix: ClassVar[str]
    #: At most this many files hold 2000 small values (they are packed together).
    max_files_for_small_values: ClassVar[int]

    # -- hooks: where things are on disk, for the damage tests
    def value_at(self, path: Path, key: str) -> tuple[Path, int]:
        """The file holding the first byte of value ``key``, and that byte's offset."""
        raise NotImplementedError

    def record_at(self, path: Path) -> tuple[Path, int, int]:
        """The file holding the root record, its offset and length."""
        raise NotImplementedError

    def path(self, tmp_path: Path, name: str = "ck") -> Path:
        return tmp_path / f"{name}{self.suffix}"

    def write(self, path: Path, values: dict[str, Any], metadata: Any = None,
              attrs: dict[str, Any] | None = None, **options: Any) -> Path:
        w = backend_for(path, mode="w").open_writer(path, **options)
        for k, v in values.items():
            w.add(k, v, (attrs or {}).get(k))
        if metadata is not None:
            w.set_metadata(metadata)
        return w.commit()

    def reader(self, path: Path) -> ContainerReader:
        r = backend_for(path).open_reader(path)
        assert r.format == self.fmt
        return r  # type: ignore[return-value]

    def roundtrip(self, tmp_path: Path, values: dict[str, Any], **options: Any) -> dict[str, Any]:
        p = self.write(self.path(tmp_path), values, **options)
        with self.reader(p) as r:
            assert list(r.keys()) == list(values)
            return {k: r.read(k) for k in r.keys()}

    # -- round trips
    @pytest.mark.parametrize("dtype", sorted(SUPPORTED_DTYPES))
    @pytest.mark.parametrize("pack", [0, 1 << 20], ids=["arrays", "packed"])
    def test_every_dtype_round_trips(self, tmp_path: Path, dtype: str, pack: int) -> None:
        values = {"v": sample(dtype, (5, 7)), "s": sample(dtype, ()), "e": sample(dtype, (0, 3))}
        back = self.roundtrip(tmp_path, values, pack_threshold=pack)
        for k, v in values.items():
            assert back[k].dtype == SUPPORTED_DTYPES[dtype]
            assert back[k].shape == v.shape
            assert back[k].tobytes() == v.tobytes()

    def test_noncontiguous_and_big_endian_inputs(self, tmp_path: Path) -> None:
        base = np.arange(2000, dtype=np.float64).reshape(40, 50)
        values = {"t": base.T, "s": base[::3, 1::2], "be": base.astype(">f8"),
                  "bes": np.arange(30000, dtype=">i4")}
        back = self.roundtrip(tmp_path, values, pack_threshold=1024)
        for k, v in values.items():
            np.testing.assert_array_equal(back[k], v)
            assert back[k].dtype.isnative

    def test_bfloat16_stays_bfloat16(self, tmp_path: Path) -> None:
        v = np.linspace(-3, 3, 70000).astype(ml_dtypes.bfloat16).reshape(700, 100)
        back = self.roundtrip(tmp_path, {"w": v})
        assert back["w"].dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(back["w"].view(np.uint16), v.view(np.uint16))

    def test_odd_keys_round_trip_and_stay_inside(self, tmp_path: Path) -> None:
        values = {k: np.full((i % 3 + 1) * 20000, i, np.int32) for i, k in enumerate(ODD_KEYS)}
        values.update({f"small/{k}": np.array([i]) for i, k in enumerate(ODD_KEYS)})
        outside = set(os.listdir(tmp_path))
        back = self.roundtrip(tmp_path, values)
        for k, v in values.items():
            np.testing.assert_array_equal(back[k], v)
        assert set(os.listdir(tmp_path)) - outside == {self.path(tmp_path).name}

    def test_attrs_and_metadata_round_trip(self, tmp_path: Path) -> None:
        meta = {"step": 7, "graph": {"children": [["model", 1]]}, "blob": b"\x00\x01", "f": 1.5,
                "none": None, "nested": [[1, 2], {"x": "y"}]}
        attrs = {"w": {"name": "dense/kernel:0", "trainable": False, "extra": [1, 2]}}
        p = self.write(self.path(tmp_path), {"w": np.ones((300, 300), np.float32),
                                              "b": np.ones(3)}, meta, attrs)
        with self.reader(p) as r:
            assert r.metadata() == meta
            assert dict(r.info("w").attrs) == attrs["w"]
            assert r.info("w").checksum is not None
            assert r.info("b").attrs == {}

    def test_many_small_values_are_packed_into_one_object(self, tmp_path: Path) -> None:
        # more values than the default packs none of (docs/FORMAT.md, "Packing")
        values = {f"l{i}/v": np.full(i % 17, i, np.float32) for i in range(3000)}
        p = self.write(self.path(tmp_path), values)
        with self.reader(p) as r:
            got = dict(r.read_many(r.keys()))
        for k, v in values.items():
            np.testing.assert_array_equal(got[k], v)
        files = 1 if p.is_file() else sum(len(f) for _, _, f in os.walk(p))
        assert files <= self.max_files_for_small_values

    # -- partial and in-place reads
    def test_lazy_slicing_reads_only_covered_bytes(self, tmp_path: Path) -> None:
        v = np.arange(1000 * 1000, dtype=np.float32).reshape(1000, 1000)
        p = self.write(self.path(tmp_path), {"w": v})
        block = BLOCK_SIZE  # the slice's bytes, then the rest of the blocks that hold them
        with self.reader(p) as r:
            lazy = r["w"]
            assert lazy.shape == (1000, 1000) and lazy.dtype == np.float32
            calls: list[list[int]] = []
            orig = os.preadv

            def counting(fd: int, bufs: Any, off: int) -> int:
                calls[-1].append(sum(len(b) for b in bufs))
                return orig(fd, bufs, off)

            def read(index: Any) -> np.ndarray:
                calls.append([])
                os.preadv = counting  # count bytes through the real syscall
                try:
                    return lazy[index]  # type: ignore[no-any-return]
                finally:
                    os.preadv = orig

            np.testing.assert_array_equal(read(5), v[5])
            np.testing.assert_array_equal(read((slice(10, 20), slice(3, 7))), v[10:20, 3:7])
            np.testing.assert_array_equal(read(slice(30, 10, -4)), v[30:10:-4])
            assert read((999, 998)) == v[999, 998]
            np.testing.assert_array_equal(read((..., 2)), v[..., 2])
            row, rect, _, item, _ = calls
            assert row[0] == 4000 and sum(row) == block  # straight into the result
            # rows 10..19: bytes 40,000..80,000, and the rest of the blocks that hold them
            touched = (80_000 - 1) // block - 40_000 // block + 1
            assert rect[0] == 40000 and sum(rect) == touched * block
            assert item[0] == 4 and sum(item) == v.nbytes % block  # the short last block
            with pytest.raises(IndexError):
                lazy[1000]

    def test_read_into_out_buffer(self, tmp_path: Path) -> None:
        v = sample("float32", (500, 300))
        p = self.write(self.path(tmp_path), {"w": v, "s": np.arange(4)})
        with self.reader(p) as r:
            out = np.zeros_like(v)
            assert r.read("w", out=out) is out
            np.testing.assert_array_equal(out, v)
            with pytest.raises(ValueError, match="shape"):
                r.read("w", out=np.zeros((3,), np.float32))

    def test_missing_key_and_missing_file(self, tmp_path: Path) -> None:
        p = self.write(self.path(tmp_path), {"kernel": np.ones(3)})
        with self.reader(p) as r, pytest.raises(MissingKeyError, match="kernel"):
            r["kernal"]
        with pytest.raises(CheckpointNotFoundError):
            backend_for(self.path(tmp_path, "nope")).open_reader(self.path(tmp_path, "nope"))

    def test_reader_is_read_only(self, tmp_path: Path) -> None:
        p = self.write(self.path(tmp_path), {"w": np.ones(3)})
        with self.reader(p) as r:
            with pytest.raises(TypeError):
                r["w"] = np.zeros(3)  # type: ignore[index]
            with pytest.raises(TypeError):
                del r["w"]  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="closed"):
            r.read("w")

    # -- damage
    def damage_value(self, path: Path, key: str) -> None:
        target, off = self.value_at(path, key)
        with open(target, "r+b") as f:
            f.seek(off + 3)
            b = f.read(1)
            f.seek(off + 3)
            f.write(bytes([b[0] ^ 0x10]))

    @pytest.mark.parametrize("key", ["big", "small"])
    def test_flipped_byte_in_a_value_is_caught(self, tmp_path: Path, key: str) -> None:
        p = self.write(self.path(tmp_path), {"big": np.ones(100000, np.float32),
                                              "small": np.ones(10, np.float32), "ok": np.ones(3)})
        self.damage_value(p, key)
        with self.reader(p) as r:
            with pytest.raises(CorruptCheckpointError, match=key) as ei:
                r.read(key)
            assert str(p) in str(ei.value)
            with pytest.raises(CorruptCheckpointError):
                dict(r.read_many(r.keys()))
            assert [k for k, _ in r.verify_all()] == [key]
            r.read("ok")
            assert r.read(key, verify=False).shape == (100000,) if key == "big" else True

    def test_flipped_byte_in_the_record_is_caught(self, tmp_path: Path) -> None:
        p = self.write(self.path(tmp_path), {"w": np.ones(3)}, {"step": 1})
        f, off, n = self.record_at(p)
        with open(f, "r+b") as fh:
            fh.seek(off + n // 2)
            b = fh.read(1)
            fh.seek(off + n // 2)
            fh.write(bytes([b[0] ^ 1]))
        with pytest.raises(CorruptCheckpointError, match="record"):
            self.reader(p)

    def test_truncation_is_caught(self, tmp_path: Path) -> None:
        p = self.write(self.path(tmp_path), {"w": np.ones(100000, np.float32)})
        target, _ = self.value_at(p, "w")
        size = target.stat().st_size
        for cut in (size - 1, size // 2, 600, 10):
            os.truncate(target, cut)
            with pytest.raises(CorruptCheckpointError):
                with self.reader(p) as r:
                    r.read("w")

    def test_swapped_values_are_caught(self, tmp_path: Path) -> None:
        a, b = np.ones(100000, np.float32), np.full(100000, 2, np.float32)
        p = self.write(self.path(tmp_path), {"a": a, "b": b})
        target, at = self.value_at(p, "a")
        with open(target, "r+b") as f:  # b's bytes where a's were
            f.seek(at)
            f.write(b.tobytes())
        with self.reader(p) as r:
            with pytest.raises(CorruptCheckpointError, match="'a'"):
                r.read("a")

    # -- atomicity
    def test_abort_and_failed_commit_leave_nothing(self, tmp_path: Path) -> None:
        p = self.path(tmp_path)
        w = backend_for(p, mode="w").open_writer(p)
        w.add("w", np.ones(3))
        w.abort()
        with pytest.raises(ValueError):
            w.commit()
        w = backend_for(p, mode="w").open_writer(p)
        w.add("w", np.ones(3))
        w.set_metadata({"bad": object()})
        with pytest.raises(TypeError):
            w.commit()
        assert os.listdir(tmp_path) == []

    def test_overwrite_replaces_atomically(self, tmp_path: Path) -> None:
        p = self.path(tmp_path)
        self.write(p, {"old": np.ones(100000)})
        self.write(p, {"new": np.zeros(5)})
        with self.reader(p) as r:
            assert list(r.keys()) == ["new"]
        assert [n for n in os.listdir(tmp_path) if is_partial(n)] == []
        assert os.listdir(tmp_path) == [p.name]

    def test_unsupported_dtype_is_refused(self, tmp_path: Path) -> None:
        p = self.path(tmp_path)
        w = backend_for(p, mode="w").open_writer(p)
        with pytest.raises(TypeError, match="Unsupported"):
            w.add("o", np.array(["a"], dtype=object))
        with pytest.raises(ValueError, match="already"):
            w.add("x", np.ones(1))
            w.add("x", np.ones(1))

    def test_durable_false_still_round_trips(self, tmp_path: Path) -> None:
        back = self.roundtrip(tmp_path, {"w": np.ones((256, 256))}, durable=False)
        assert back["w"].sum() == 256 * 256
