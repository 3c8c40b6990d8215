"""The storage layer's house rules: doctests, declared abilities, sniffing, exact reads.

Declared reader abilities, the order readers sniff in, the hand-over of files that are
not ours, one lazy-slice arithmetic, and the one exact-read helper."""

from __future__ import annotations

import ast
import doctest
import gc
import importlib
import os
import pkgutil
from pathlib import Path

import h5py
import numpy as np
import pytest

import ckptvar as cv
import ckptvar.storage as st
from ckptvar.storage import (
    SupportsReadIntoMany,
    SupportsRuns,
    SupportsShapeAndDtype,
    SupportsVerifyAll,
    SupportsVerifyMany,
    backend_for,
)
from ckptvar.storage import rawio as _rawio
from ckptvar.storage.slicing import element_span

STORAGE = Path(st.__file__).parent
ABILITIES = (SupportsShapeAndDtype, SupportsReadIntoMany, SupportsRuns, SupportsVerifyMany,
             SupportsVerifyAll)


def _storage_modules() -> list[str]:
    return ["ckptvar.storage"] + [
        m.name for m in pkgutil.walk_packages(st.__path__, "ckptvar.storage.")
    ]


@pytest.mark.parametrize("module", _storage_modules())
def test_doctests_of_every_storage_module_pass(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_the_container_package_never_imports_the_core() -> None:
    core = {"device", "graph", "variables", "trackable", "module", "initializers"}
    for path in (STORAGE / "_container").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in core, (path.name, node.module)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_own_readers_declare_every_ability(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"m{suffix}"
    cv.save(path, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    with backend_for(path).open_reader(path) as reader:
        for ability in ABILITIES:
            assert isinstance(reader, ability), ability.__name__
        assert reader.shape_and_dtype("w") == ((2, 3), np.dtype(np.float32))
        out = np.empty((2, 3), np.float32)
        reader.read_into_many([("w", out)])
        assert out.tolist() == [[0, 1, 2], [3, 4, 5]]
        reader.verify_many(["w"])
        assert reader.verify_all() == []


def test_a_reader_without_an_ability_does_not_claim_it(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    cv.save(path, {"w": np.zeros(3, np.float32)})
    with backend_for(path).open_reader(path) as reader:
        assert not isinstance(reader, SupportsReadIntoMany)
        assert isinstance(reader, SupportsVerifyAll)  # every foreign reader checks its CRCs
        assert reader.read("w").tolist() == [0.0, 0.0, 0.0]


def test_backend_for_hands_an_h5_file_it_did_not_write_to_another_reader(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours.h5", tmp_path / "theirs.h5"
    cv.save(ours, {"w": np.ones(2, np.float32)})
    with h5py.File(theirs, "w") as f:
        f["w"] = np.arange(3, dtype=np.float64)
    assert backend_for(ours).name == "h5"
    other = backend_for(theirs)
    assert other.name != "h5"
    with other.open_reader(theirs) as reader:
        assert reader.format != "h5"
        assert [float(x) for x in reader.read(next(iter(reader.keys())))] == [0.0, 1.0, 2.0]
    # Asked for by name, the h5 backend refuses it with a clear error.
    with pytest.raises(cv.UnsupportedFormatError, match="did not write"):
        st._h5.H5Backend.open_reader(theirs)


INDICES = [
    0, -1, 5, slice(None), slice(3, 17), slice(None, None, -1), slice(20, 2, -3),
    slice(5, 5), (slice(5, 5), 3), (slice(7, 2), Ellipsis, 1), (2, slice(1, 9, 2)),
    (Ellipsis, 4), (-3, -2, 1), (slice(None), 0, slice(2, 4)), (1, Ellipsis),
    (np.int64(3), slice(None, None, 2)), True, None, (0, None), [1, 4], (slice(2, 4), [0, 3]),
]


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_lazy_slices_read_what_numpy_would(tmp_path: Path, suffix: str) -> None:
    full = np.arange(40 * 16 * 500, dtype=np.float32).reshape(40, 16, 500)  # 1.28 MB: sliced
    path = tmp_path / f"m{suffix}"
    cv.save(path, {"w": full})
    with backend_for(path).open_reader(path) as reader:
        lazy = reader["w"]
        for index in INDICES:
            want = full[index]
            got = lazy[index]
            assert np.shape(got) == np.shape(want), index
            assert np.array_equal(got, want), index
        for bad in [40, (0, 16), (0, 0, 0, 0), (Ellipsis, 0, Ellipsis)]:
            with pytest.raises(IndexError):
                full[bad]
            with pytest.raises(IndexError):
                lazy[bad]


def test_element_span_is_the_run_numpy_indexing_touches() -> None:
    full = np.arange(3 * 4 * 5).reshape(3, 4, 5)
    for index in [(1,), (1, 2), (1, slice(1, 3)), (slice(2, 0, -1),), (2, 3, 4), ()]:
        span = element_span(index, full.shape)
        assert span is not None
        flat = full.reshape(-1)[span.start : span.start + span.count]
        assert np.array_equal(flat.reshape(span.shape)[span.index], full[index])
        touched = np.unique(full[index])
        assert span.count == 0 or (flat.min() <= touched.min() and touched.max() <= flat.max())
    assert element_span((1, 2), full.shape).byte_range(4) == ((20 + 10) * 4, 5 * 4)  # type: ignore[union-attr]
    assert element_span(np.array([1]), full.shape) is None
    assert element_span(0, ()) is None


def test_exact_reads_name_what_is_truncated(tmp_path: Path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(b"0123456789")
    fd = os.open(p, os.O_RDONLY)
    try:
        assert _rawio.pread_exact(fd, 2, 3, what="The header", path=p) == b"234"
        with pytest.raises(cv.CorruptCheckpointError, match=r"The header in .*truncated"):
            _rawio.pread_exact(fd, 8, 4, what="The header", path=p)
        with pytest.raises(cv.CorruptCheckpointError, match="invalid byte range"):
            _rawio.pread_exact(fd, -1, 4, what="The header", path=p)
        buf = bytearray(4)
        _rawio.pread_into_exact(fd, memoryview(buf), 6, what="A value", path=p)
        assert bytes(buf) == b"6789"
        with pytest.raises(cv.CorruptCheckpointError, match=r"A value in .*ended after 3"):
            _rawio.pread_into_exact(fd, memoryview(buf), 7, what="A value", path=p)
    finally:
        os.close(fd)


def test_paused_gc_and_snapshot_are_public() -> None:
    with st.paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    a = np.arange(4)
    (b,) = st.snapshot([a])
    assert np.array_equal(a, b) and not np.shares_memory(a, b)


def test_scatter_reads_stop_short_at_the_end_of_the_file(tmp_path: Path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(100)))
    fd = os.open(p, os.O_RDWR)
    try:
        bufs = [bytearray(30), bytearray(30), bytearray(60)]
        assert _rawio.preadv_all(fd, [memoryview(b) for b in bufs], 0) == 100
        assert bytes(bufs[1]) == bytes(range(30, 60))
        assert bytes(bufs[2][:40]) == bytes(range(60, 100))
        parts = [np.arange(5, dtype=np.uint8), memoryview(b"xyz")]
        assert _rawio.pwritev_all(fd, parts, 200) == 8
        assert os.pread(fd, 8, 200) == b"\x00\x01\x02\x03\x04xyz"
    finally:
        os.close(fd)


def test_which_reader_sniffs_first_is_declared_not_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptvar.storage import registry
    from ckptvar.storage.base import Backend

    order = [c.name for c in registry.sniff_order()]
    assert order[:3] == ["h5", "sharded", "zarr"] and order[-1] == "hdf5"
    plain = tmp_path / "m"  # no suffix: the format is sniffed
    cv.save(plain, {"w": np.zeros(2, np.float32)}, format="h5")

    def claims_all(name: str, priority: int) -> type[Backend]:
        class Greedy(Backend, name=name, suffixes=(), sniff_priority=priority):
            """Claims every path."""

            @classmethod
            def sniff(cls, path: Path) -> bool:
                return True

            @classmethod
            def open_reader(cls, path: Path) -> st.Reader:
                raise NotImplementedError

        return Greedy

    late = claims_all("greedy-late", 95)  # registered last, sniffs last: not chosen
    monkeypatch.setitem(registry._BACKENDS, late.name, late)
    assert backend_for(plain).name == "h5"
    early = claims_all("greedy-early", 0)  # registered last, declared first: chosen
    monkeypatch.setitem(registry._BACKENDS, early.name, early)
    assert backend_for(plain) is early
