"""Every writer takes a value that comes a piece at a time (``storage.Chunked``: a GPU
tensor staged through the pinned buffer) a piece at a time: safetensors, Hugging Face
sharded safetensors, ``.npz``, compressed Zarr and a Zarr step that stores values in
chunks (format 1.4) never hold a whole host copy of it. Shown on the CPU with a value
that is never whole anywhere (each piece is made when asked for): tracemalloc's peak
during the save stays far below the value's size, and the file reads back bit-exact."""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import ckptvar as cv
from ckptvar.storage import Chunked

PIECE = 1 << 20
ROWS, COLS = 4100, 2048  # float32: 32 MiB and a short last chunk


class Ramp:
    """``np.arange(rows * cols, dtype=float32).reshape(rows, cols)`` (plus ``bump`` in the
    rows ``hot``), made one piece at a time."""

    def __init__(self, rows: int = ROWS, cols: int = COLS,
                 hot: tuple[int, int] | None = None) -> None:
        self.shape = (rows, cols)
        self.dtype = np.dtype(np.float32)
        self.nbytes = rows * cols * 4
        self.hot = hot
        self.pieces = 0  # asked for so far

    def byte_chunks(self) -> Iterator[memoryview]:
        n, per = self.nbytes // 4, PIECE // 4
        for start in range(0, n, per):
            self.pieces += 1
            piece = np.arange(start, min(n, start + per), dtype=np.float32)
            if self.hot is not None:
                lo, hi = (r * self.shape[1] - start for r in self.hot)
                piece[max(0, lo): max(0, hi)] += 1.0
            yield piece.view(np.uint8).data

    def expected(self) -> np.ndarray:
        out = np.arange(self.nbytes // 4, dtype=np.float32).reshape(self.shape)
        if self.hot is not None:
            out[self.hot[0]: self.hot[1]] += 1.0
        return out


def _peak_save(path: Path, value: Any, **options: Any) -> int:
    """tracemalloc's peak (bytes) while ``value`` is saved at ``path`` (after a first,
    small save of the same format: module imports are not the writer's memory); the
    lower of two saves, since tracemalloc also counts what another thread of the test
    process allocates meanwhile (a server or background thread of an earlier test),
    which only ever adds to the writer's own peak."""
    cv.save(path.with_name("warm-" + path.name), {"w": Ramp(64, 64)}, **options)
    peaks = []
    for attempt in range(2):
        target = path if attempt else path.with_name("first-" + path.name)
        tracemalloc.start()
        try:
            cv.save(target, {"w": value, "small": np.ones(3, np.float32)}, **options)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    return min(peaks)


@pytest.mark.parametrize(("name", "options", "bound"), [
    ("t.safetensors", {}, 4 << 20),
    ("t.npz", {}, 4 << 20),
    ("hf", {"format": "hf-safetensors"}, 4 << 20),
    # one 4 MiB chunk gathered, zarr-python's copy of a short last chunk, its compressed form
    ("t.zarr", {"compression": "zstd"}, 14 << 20),
    ("p.zarr", {"piece_bytes": True}, 8 << 20),  # one 4 MiB chunk
    ("t.h5", {}, 4 << 20),
])
def test_a_chunked_value_is_written_a_piece_at_a_time(tmp_path: Path, name: str,
                                                      options: dict[str, Any],
                                                      bound: int) -> None:
    value = Ramp()
    assert isinstance(value, Chunked)
    peak = _peak_save(tmp_path / name, value, **options)
    assert peak < bound < value.nbytes // 2, f"{name}: peak {peak >> 20} MiB"
    back = cv.load(tmp_path / name)
    np.testing.assert_array_equal(back["w"], value.expected())
    np.testing.assert_array_equal(back["small"], np.ones(3, np.float32))
    if name.endswith(".zarr"):  # plain zarr-python reads it as well (compressed: chunks)
        arr = zarr.open_group(tmp_path / name, mode="r")["w"]
        np.testing.assert_array_equal(arr[:], value.expected())
        assert arr.chunks[0] < ROWS
    with cv.open(tmp_path / name) as reader:
        reader.verify("w")


def test_a_zarr_step_in_chunks_writes_only_the_changed_chunks_of_a_chunked_value(
        tmp_path: Path) -> None:
    # the base step, then one whose value differs in a few rows of one 4 MiB chunk: its
    # other chunks are the base's files (hard links); the value is hashed, then written,
    # each a pass over its pieces, never whole
    first = tmp_path / "1.zarr"
    cv.save(first, {"w": Ramp()}, piece_bytes=True)
    rows = (4 << 20) // (COLS * 4)  # rows per chunk
    changed = Ramp(hot=(2 * rows + 3, 2 * rows + 9))
    second = tmp_path / "2.zarr"
    tracemalloc.start()
    try:
        cv.save(second, {"w": changed}, piece_bytes=True, base=first)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    chunks = sorted(n for n in os.listdir(second / "w") if n.startswith("c."))
    assert len(chunks) == -(-ROWS // rows)
    linked = [n for n in chunks if (second / "w" / n).stat().st_ino
              == (first / "w" / n).stat().st_ino]
    assert linked == [n for n in chunks if n != "c.2.0"]
    np.testing.assert_array_equal(cv.load(second)["w"], changed.expected())
    np.testing.assert_array_equal(cv.load(first)["w"], Ramp().expected())


def test_a_chunked_value_that_gives_the_wrong_byte_count_is_refused(tmp_path: Path) -> None:
    class Short(Ramp):
        def byte_chunks(self) -> Iterator[memoryview]:
            yield from list(super().byte_chunks())[:-1]

    for name, options in (("s.safetensors", {}), ("s.npz", {}),
                          ("s.zarr", {"compression": "zstd"}), ("p.zarr", {"piece_bytes": True})):
        with pytest.raises(ValueError, match="bytes"):
            cv.save(tmp_path / name, {"w": Short(256, 2048)}, **options)
        assert not (tmp_path / name).exists(), name  # nothing half-written is left
