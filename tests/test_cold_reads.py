"""Reads from disk (nothing in the page cache): a Zarr checkpoint's chunk files are
streamed by several threads at once, each file whole and in order; one file (HDF5) stays
one sequential stream. Either way every byte is verified and damage names the value.

The page cache is emptied the way the benchmark does it (``os.sync`` and
``posix_fadvise(DONTNEED)`` of every file); where the kernel keeps the pages anyway the
tests skip, since the threads only start for bytes that are not cached.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.storage import rawio
from ckptvar.storage._container import transfer

MIB = 1 << 20


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out = {f"layer{i}/w": rng.standard_normal((512, 1024 + 64 * i), dtype=np.float32)
           for i in range(6)}  # 2-3.5 MiB each: read on the I/O threads, > one task
    out["bias"] = np.arange(100, dtype=np.float32)
    return out


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def _drop(path: Path) -> None:
    """Empty the page cache of the checkpoint's files; skip where the kernel keeps them."""
    os.sync()
    kept = 0
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            kept += f.stat().st_size >= MIB and rawio.cached(fd, MIB // 2)
        finally:
            os.close(fd)
    if kept:
        pytest.skip("the page cache kept the files after posix_fadvise(DONTNEED)")


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the file-streaming tasks the transfers start (one entry per task)."""
    started: list[int] = []
    run_files = transfer.Transfer._run_files

    def counted(self: transfer.Transfer, todo: object) -> None:
        started.append(1)
        run_files(self, todo)  # type: ignore[arg-type]

    monkeypatch.setattr(transfer.Transfer, "_run_files", counted)
    return started


def test_a_cold_zarr_load_streams_chunk_files_on_several_threads(tmp_path: Path,
                                                                  streams: list[int]) -> None:
    arrays = _arrays()
    path = tmp_path / "m.zarr"
    cv.save(path, arrays)
    _drop(path)
    got = cv.load(path)
    for k, a in arrays.items():
        np.testing.assert_array_equal(got[k], a)
    assert len(streams) == min(transfer.COLD_STREAMS, rawio.IO_THREADS, 6)
    # warm, the pieces are read in parallel as before: no file streams
    streams.clear()
    got = cv.load(path)
    np.testing.assert_array_equal(got["layer3/w"], arrays["layer3/w"])
    assert streams == []


def test_a_cold_restore_of_zarr_streams_files_and_keeps_every_byte(tmp_path: Path,
                                                                 streams: list[int]) -> None:
    arrays = _arrays()
    path = tmp_path / "m.zarr"
    cv.save(path, arrays)
    variables = {k: cv.Variable(np.zeros_like(a), name=k) for k, a in arrays.items()}
    saver = cv.Saver(var_list=dict(variables.items()), max_to_keep=None)
    _drop(path)
    saver.restore(path)
    for k, a in arrays.items():
        np.testing.assert_array_equal(variables[k].numpy(), a)
    assert len(streams) >= 2


@pytest.mark.parametrize("fmt", ["zarr", "h5"])
def test_damage_read_cold_names_the_value_and_changes_nothing(tmp_path: Path, fmt: str,
                                                               streams: list[int]) -> None:
    arrays = _arrays()
    path = tmp_path / f"m.{fmt}"
    cv.save(path, arrays)
    if fmt == "zarr":
        chunk = next(p for p in _files(path / "layer3" / "w") if p.name.startswith("c"))
        at = chunk.stat().st_size // 2
    else:
        chunk = path
        with cv.open(path) as r:
            want = r["layer3/w"].read()
        blob = path.read_bytes()
        at = blob.find(want[200:202].tobytes()) + 4
    with open(chunk, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    _drop(path)
    with pytest.raises(cv.CorruptCheckpointError, match=r"'layer3/w'.*checksum"):
        cv.load(path)
    variables = {k: cv.Variable(np.full_like(a, 5), name=k) for k, a in arrays.items()}
    _drop(path)
    with pytest.raises(cv.CorruptCheckpointError, match=r"'layer3/w'"):
        cv.Saver(var_list=dict(variables.items()), max_to_keep=None).restore(path)
    assert all((v.numpy() == 5).all() for v in variables.values())
    # one file is one stream: only Zarr's chunk files are streamed by several threads
    assert (len(streams) > 0) == (fmt == "zarr")
