"""Bulk reads of packed values: verify_many, read_into_many, read_many, restore paths."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.checkpoint._apply import apply_values

VALUES = {
    "a": np.arange(10, dtype=np.float32),
    "b": np.ones((3, 5), ml_dtypes.bfloat16),
    "empty": np.zeros((0, 4), np.int64),
    "s": np.array(7, np.int8),
    "big": np.arange(40000, dtype=np.float64),  # its own array (above the pack threshold)
    "c": np.arange(6, dtype=np.complex64).reshape(2, 3),
}


def _flip(path: Path, data: bytes) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("c*") if p.is_file()]
    for f in files:
        raw = bytearray(f.read_bytes())
        at = raw.find(data)
        if at >= 0:
            raw[at] ^= 0xFF
            f.write_bytes(bytes(raw))
            return
    raise AssertionError("value bytes not found")


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_read_into_many_and_verify_many(tmp_path: Path, fmt: str) -> None:
    p = cv.save(tmp_path / f"x.{fmt}", VALUES)
    with cv.open(p) as r:
        r.verify_many(list(VALUES))
        outs = {k: np.full_like(v, 1) for k, v in VALUES.items()}
        pairs = [(k, outs[k]) for k in ["c", "a", "b", "empty", "s", "big"]]
        pairs.append(("a", np.zeros_like(VALUES["a"])))  # one key into two buffers
        r.read_into_many(pairs, verify=True)
        for k, v in VALUES.items():
            np.testing.assert_array_equal(outs[k], v)
        np.testing.assert_array_equal(pairs[-1][1], VALUES["a"])
        with pytest.raises(ValueError, match="shape"):
            r.read_into_many([("a", np.zeros(3, np.float32))])


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_bulk_paths_catch_a_flipped_packed_value(tmp_path: Path, fmt: str) -> None:
    p = cv.save(tmp_path / f"x.{fmt}", VALUES)
    _flip(p, VALUES["c"].tobytes())
    with cv.open(p) as r:
        with pytest.raises(cv.CorruptCheckpointError, match="'c'"):
            r.verify_many(list(VALUES))
        with pytest.raises(cv.CorruptCheckpointError, match="'c'"):
            r.read_into_many([("c", np.empty_like(VALUES["c"]))], verify=True)
        with pytest.raises(cv.CorruptCheckpointError, match="'c'"):
            dict(r.read_many(list(VALUES)))
        r.verify_many(["a", "b", "s"])  # the others are fine


@pytest.mark.parametrize("budget", [0, None])
def test_restore_in_place_is_all_or_nothing_on_damage(tmp_path: Path, budget: int | None) -> None:
    p = cv.save(tmp_path / "x.h5", VALUES)
    _flip(p, VALUES["c"].tobytes())
    variables = {k: cv.Variable(np.zeros_like(v), name=k) for k, v in VALUES.items()}
    before = {k: v.numpy() for k, v in variables.items()}
    with cv.open(p) as r:
        infos = {k: r.info(k) for k in r.keys()}
        with pytest.raises(cv.CorruptCheckpointError, match="'c'"):
            apply_values(r, list(variables.items()), infos, budget=budget)
    for k, v in variables.items():
        np.testing.assert_array_equal(v.numpy(), before[k])


@pytest.mark.parametrize("budget", [0, None])
def test_restore_in_place_and_fresh_share_nothing(tmp_path: Path, budget: int | None) -> None:
    p = cv.save(tmp_path / "x.zarr", VALUES)
    existing = cv.Variable(np.zeros(10, np.float32), name="a1")
    existing.numpy()
    fresh1 = cv.Variable(lambda: np.zeros(10, np.float32), dtype="float32", shape=(10,))
    fresh2 = cv.Variable(lambda: np.zeros(10, np.float32), dtype="float32", shape=(10,))
    buf = existing.value()
    with cv.open(p) as r:
        infos = {k: r.info(k) for k in r.keys()}
        apply_values(r, [("a", existing), ("a", fresh1), ("a", fresh2)], infos, budget=budget)
    assert existing.value() is buf  # restored in place
    for v in (existing, fresh1, fresh2):
        np.testing.assert_array_equal(v.numpy(), VALUES["a"])
    fresh1.assign(np.full(10, 5, np.float32))
    np.testing.assert_array_equal(fresh2.numpy(), VALUES["a"])  # no shared buffer


def _chunk_opens(monkeypatch: pytest.MonkeyPatch, call: object) -> int:
    """How many times ``call()`` opens a Zarr chunk file (``c.0``): ``os.open`` is wrapped,
    every call still reaching the real system call."""
    import os

    real = os.open
    opened: list[str] = []

    def counting(path: object, *args: object, **kwargs: object) -> int:
        opened.append(os.fsdecode(path))  # type: ignore[arg-type]
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", counting)
    try:
        call()  # type: ignore[operator]
    finally:
        monkeypatch.setattr(os, "open", real)
    return sum(1 for p in opened if p.startswith("c."))


def test_zarr_load_opens_each_chunk_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # values of 1 and 9 MiB (read in pieces on the I/O threads), and small ones
    arrays = {f"w{i}": np.full(1 << 18, i, np.float32) for i in range(8)}
    arrays["x"] = np.arange(9 << 18, dtype=np.float32)
    arrays["s"] = np.arange(5, dtype=np.int16)
    path = tmp_path / "m.zarr"
    cv.save(path, arrays)
    got: dict[str, np.ndarray] = {}
    # the record's chunk, then each value's chunk once: the size check's descriptor is
    # the one the read uses (it was opened twice, once to check and once to read)
    assert _chunk_opens(monkeypatch, lambda: got.update(cv.load(path))) == 1 + len(arrays)
    for k, v in arrays.items():
        np.testing.assert_array_equal(got[k], v)
    with cv.open(path) as r:
        assert _chunk_opens(monkeypatch, lambda: r.read("x")) == 1
        np.testing.assert_array_equal(r.read("x"), arrays["x"])


def test_zarr_load_still_refuses_a_resized_chunk(tmp_path: Path) -> None:
    arrays = {f"w{i}": np.full(1 << 18, i, np.float32) for i in range(3)}
    path = tmp_path / "m.zarr"
    cv.save(path, arrays)
    chunk = path / "w1" / "c.0"
    chunk.write_bytes(chunk.read_bytes()[:-8])
    with pytest.raises(cv.CorruptCheckpointError, match="w1"):
        cv.load(path)
    with cv.open(path) as r, pytest.raises(cv.CorruptCheckpointError, match="w1"):
        r.read("w1")


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_stage_into_many_verifies_everything_before_any_buffer_changes(
    tmp_path: Path, fmt: str
) -> None:
    p = cv.save(tmp_path / f"x.{fmt}", VALUES)
    outs = {k: np.zeros_like(v) for k, v in VALUES.items()}
    with cv.open(p) as r:
        assert isinstance(r, cv.storage.SupportsStageIntoMany)
        commit = r.stage_into_many(list(outs.items()))
        assert not any(o.any() for o in outs.values())  # staged: nothing copied yet
        commit()
        with pytest.raises(ValueError, match="'a'"):  # a wrong buffer is refused up front
            r.stage_into_many([("a", np.zeros(9, np.float32))])
    for k, v in VALUES.items():  # bfloat16, complex, 0-d, empty, packed and not
        assert outs[k].dtype == v.dtype
        np.testing.assert_array_equal(outs[k], v)
    _flip(p, VALUES["c"].tobytes())
    outs = {k: np.zeros_like(v) for k, v in VALUES.items()}
    with cv.open(p) as r, pytest.raises(cv.CorruptCheckpointError, match="'c'"):
        r.stage_into_many(list(outs.items()))
    assert not any(o.any() for o in outs.values())
