"""Reads from disk (nothing in the page cache): the values land straight in their arrays
through ``O_DIRECT`` descriptors, the pieces spread over the I/O threads, counted by
``rawio.direct_stats``; with direct reads off, a Zarr checkpoint's chunk files are
streamed by several threads at once, each file whole and in order, and one file (HDF5)
stays one sequential stream. Every byte is verified and damage names the value.

The page cache is emptied the way the benchmark does it (``os.sync`` and
``posix_fadvise(DONTNEED)`` of every file); where the kernel keeps the pages anyway the
tests skip, since the threads only start for bytes that are not cached.
"""

from __future__ import annotations

import os
import shutil
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


def _warm(path: Path) -> None:
    for f in _files(path):
        f.read_bytes()


def _direct() -> tuple[int, int]:
    """The process's ``O_DIRECT`` counters: bytes read that way, refusals."""
    return rawio.direct_stats.bytes, rawio.direct_stats.refused


def _large(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values() if a.nbytes >= MIB)


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


@pytest.mark.parametrize("fmt", ["zarr", "h5"])
def test_a_cold_load_reads_straight_into_the_arrays(tmp_path: Path, fmt: str,
                                                    streams: list[int]) -> None:
    arrays = _arrays()
    path = tmp_path / f"m.{fmt}"
    cv.save(path, arrays)
    _drop(path)
    before, _ = _direct()
    got = cv.load(path)
    for k, a in arrays.items():
        np.testing.assert_array_equal(got[k], a)
    read = _direct()[0] - before
    if fmt == "zarr":  # chunk files from offset 0, every one a whole number of blocks
        assert read == _large(arrays)
    else:  # each value's unaligned ends: the whole blocks they fall in, read direct too
        assert _large(arrays) < read <= _large(arrays) + 6 * 2 * rawio.DIRECT_ALIGN
    assert streams == []
    # from the page cache, nothing is read direct
    _warm(path)
    before, _ = _direct()
    got = cv.load(path)
    np.testing.assert_array_equal(got["layer3/w"], arrays["layer3/w"])
    assert _direct()[0] == before


_IN_A_JOB = """
import os, sys
import numpy as np
import ckptvar as cv
from ckptvar.storage import rawio
path = sys.argv[1]
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)
got = cv.load(path)
print(rawio.DIRECT_READS, rawio.direct_stats.bytes, float(got["w"].sum()))
"""


@pytest.mark.parametrize(("env", "direct"), [({"LOCAL_WORLD_SIZE": "4"}, False),
                                             ({"MPI_LOCALNRANKS": "2"}, False),
                                             ({"LOCAL_WORLD_SIZE": "4",
                                               "CKPTVAR_DIRECT_READS": "1"}, True)])
def test_in_a_job_of_several_processes_on_the_node_reads_stay_in_the_page_cache(
        tmp_path: Path, env: dict[str, str], direct: bool) -> None:
    """Ranks of one node loading the same model share the page cache: the launcher's
    local size turns direct reads off unless ``CKPTVAR_DIRECT_READS=1``."""
    import subprocess
    import sys

    if not rawio.DIRECT_READS:
        pytest.skip("no O_DIRECT here (not Linux, or CKPTVAR_DIRECT_READS=0)")
    w = np.arange(4 * MIB // 4, dtype=np.float32)
    path = tmp_path / "m.h5"
    cv.save(path, {"w": w})
    os.sync()
    clean = {k: v for k, v in os.environ.items()
             if k not in rawio._LOCAL_SIZE_VARS and k != "CKPTVAR_DIRECT_READS"}
    out = subprocess.run([sys.executable, "-c", _IN_A_JOB, str(path)], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out[0] == str(direct)
    assert float(out[2]) == float(w.sum())
    if not direct:
        assert out[1] == "0"


def test_with_direct_reads_off_a_cold_zarr_load_streams_chunk_files(
        tmp_path: Path, streams: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rawio, "DIRECT_READS", False)
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


@pytest.mark.parametrize("direct", [True, False])
def test_a_cold_restore_of_zarr_keeps_every_byte(tmp_path: Path, streams: list[int],
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 direct: bool) -> None:
    monkeypatch.setattr(rawio, "DIRECT_READS", direct)
    arrays = _arrays()
    path = tmp_path / "m.zarr"
    cv.save(path, arrays)
    variables = {k: cv.Variable(np.zeros_like(a), name=k) for k, a in arrays.items()}
    saver = cv.Saver(var_list=dict(variables.items()), max_to_keep=None)
    _drop(path)
    before, _ = _direct()
    saver.restore(path)
    for k, a in arrays.items():
        np.testing.assert_array_equal(variables[k].numpy(), a)
    if direct:
        assert _direct()[0] - before == _large(arrays) and streams == []
    else:
        assert len(streams) >= 2 and _direct()[0] == before


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
    before, _ = _direct()
    with pytest.raises(cv.CorruptCheckpointError, match=r"'layer3/w'.*checksum"):
        cv.load(path)
    assert _direct()[0] > before  # read from disk straight into the arrays
    variables = {k: cv.Variable(np.full_like(a, 5), name=k) for k, a in arrays.items()}
    _drop(path)
    with pytest.raises(cv.CorruptCheckpointError, match=r"'layer3/w'"):
        cv.Saver(var_list=dict(variables.items()), max_to_keep=None).restore(path)
    assert all((v.numpy() == 5).all() for v in variables.values())
    assert streams == []


def test_with_direct_reads_off_damage_read_cold_names_the_value(
        tmp_path: Path, streams: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rawio, "DIRECT_READS", False)
    arrays = _arrays()
    path = tmp_path / "m.zarr"
    cv.save(path, arrays)
    chunk = next(p for p in _files(path / "layer3" / "w") if p.name.startswith("c"))
    with open(chunk, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    _drop(path)
    with pytest.raises(cv.CorruptCheckpointError, match=r"'layer3/w'.*checksum"):
        cv.load(path)
    assert len(streams) > 0


@pytest.mark.parametrize("fmt", ["zarr", "h5"])
def test_a_load_with_part_of_the_checkpoint_cached_reads_bit_exact(tmp_path: Path,
                                                                   fmt: str) -> None:
    """Direct reads are coherent with the page cache: a value whose pages are cached
    (the transfer's probe sees the first one is not) reads the same bytes."""
    arrays = _arrays()
    path = tmp_path / f"m.{fmt}"
    cv.save(path, arrays)
    _drop(path)
    with cv.open(path) as r:  # one value on its own: read through the page cache
        np.testing.assert_array_equal(r["layer2/w"].read(), arrays["layer2/w"])
    before, _ = _direct()
    got = cv.load(path)
    for k, a in arrays.items():
        np.testing.assert_array_equal(got[k], a)
    assert _direct()[0] > before


def test_a_direct_read_sees_bytes_still_only_in_the_page_cache(tmp_path: Path) -> None:
    """Pages written and not yet on disk (dirty) are what a direct read returns: the
    kernel writes them back first. Unaligned head and tail bytes come through the cache."""
    f = tmp_path / "x.bin"
    data = np.random.default_rng(3).integers(0, 255, (3 * MIB) + 123, dtype=np.uint8)
    f.write_bytes(data.tobytes())
    _drop(f)
    fd = os.open(f, os.O_RDWR)
    dfd = rawio.open_direct(fd)
    try:
        if dfd is None:
            pytest.skip("this file system refuses O_DIRECT")
        new = np.full(5000, 7, np.uint8)
        os.pwrite(fd, new.tobytes(), MIB + 10)  # dirty pages, not written back
        data[MIB + 10 : MIB + 5010] = new
        at, n = 1000, 2 * MIB + 77  # neither end on a block boundary
        out = rawio.aligned_empty((n,), np.uint8, at % rawio.DIRECT_ALIGN)
        before, _ = _direct()
        got = rawio.pread_direct(fd, dfd, rawio.byte_view(out), at, out.ctypes.data)
        assert got == n
        np.testing.assert_array_equal(out, data[at : at + n])
        direct = _direct()[0] - before
        assert n - 2 * rawio.DIRECT_ALIGN <= direct < n
        # past the end of the file: short, the bytes that are there
        tail = rawio.aligned_empty((MIB,), np.uint8)
        pos = data.size - data.size % rawio.DIRECT_ALIGN - rawio.DIRECT_ALIGN
        got = rawio.pread_direct(fd, dfd, rawio.byte_view(tail), pos, tail.ctypes.data)
        assert got == data.size - pos
        np.testing.assert_array_equal(tail[:got], data[pos:])
    finally:
        if dfd is not None:
            os.close(dfd)
        os.close(fd)


def test_a_refused_direct_read_stays_buffered(tmp_path: Path) -> None:
    """A file system without O_DIRECT (procfs here) is declared, not fatal; a direct read
    the kernel refuses (a buffer not on a block boundary) is read again buffered."""
    fd = os.open("/proc/self/status", os.O_RDONLY)
    try:
        _, refused = _direct()
        assert rawio.open_direct(fd) is None
        assert _direct()[1] == refused + 1
    finally:
        os.close(fd)
    f = tmp_path / "y.bin"
    data = np.random.default_rng(4).integers(0, 255, MIB, dtype=np.uint8)
    f.write_bytes(data.tobytes())
    fd = os.open(f, os.O_RDONLY)
    dfd = rawio.open_direct(fd)
    try:
        if dfd is None:
            pytest.skip("this file system refuses O_DIRECT")
        raw = rawio.aligned_empty((MIB + 8,), np.uint8)
        out = raw[8 : 8 + MIB]  # 8 bytes past a block boundary, said to be on one
        _, refused = _direct()
        got = rawio.pread_direct(fd, dfd, rawio.byte_view(out), 0, raw.ctypes.data)
        assert got == MIB
        np.testing.assert_array_equal(out, data)
        assert _direct()[1] == refused + 1
    finally:
        if dfd is not None:
            os.close(dfd)
        os.close(fd)


def test_a_checkpoint_on_tmpfs_loads_whatever_o_direct_does_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs accepts O_DIRECT since Linux 6.6 and refused it before: either way the
    load is bit-exact, and what happened is counted."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) on this machine")
    monkeypatch.setattr(rawio, "cached", lambda fd, offset: False)  # tmpfs is all cache
    arrays = _arrays()
    path = shm / f"ckptvar-cold-{os.getpid()}.zarr"
    try:
        cv.save(path, arrays)
        before = _direct()
        got = cv.load(path)
        for k, a in arrays.items():
            np.testing.assert_array_equal(got[k], a)
        after = _direct()
        assert after[0] - before[0] == _large(arrays) or after[1] > before[1]
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_cold_load_of_many_chunk_files_keeps_few_descriptors_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task reads many small chunk files one after the other: each file's ``O_DIRECT``
    descriptor is closed when the task moves on, not kept to the task's end (2,000
    arrays of 8 KiB, saved by default, failed to load cold under ``ulimit -n 1024`` with
    'cannot be opened': a task of 8 MiB held 1,024 such descriptors)."""
    resource = pytest.importorskip("resource")
    from ckptvar.storage._container import bulk

    arrays = {f"v{i:04d}": np.full(5120, i, np.float32) for i in range(600)}  # 20 KiB each
    path = tmp_path / "many.zarr"
    cv.save(path, arrays, pack_threshold=0)  # a file each: 12 MiB, more than one task
    monkeypatch.setattr(bulk, "_HOLD", 16)  # what a low limit gives (_hold_limit)
    _drop(path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 150, hard))
    try:
        got = cv.load(path)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert all((got[k] == a).all() for k, a in arrays.items())
