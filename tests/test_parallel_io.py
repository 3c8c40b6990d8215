"""Large values are read and hashed in pieces on the I/O threads.

Every way a transfer runs is exercised on real files: spread over the threads (the
file is in the page cache), ``O_DIRECT`` reads spread over the threads (it is not, or
cannot be told), and one sequential stream (not cached, direct reads turned off), with
``ckptvar.storage.rawio.cached`` and ``DIRECT_READS`` pinned to choose the path. Pieces are joined
with ``_checksum.combine``, so damage in any piece of a value must still be caught,
and no thread may still be reading when a call returns or raises.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptvar as cv
from ckptvar.storage import checksum as _checksum
from ckptvar.storage import rawio as _rawio
from ckptvar.storage._container import bulk, transfer


@pytest.fixture(params=["h5", "zarr"])
def fmt(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["threads", "direct", "sequential"])
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Pin the transfer's choice: spread over the I/O threads (from the page cache or
    with ``O_DIRECT``), or one ordered stream."""
    warm = request.param == "threads"
    monkeypatch.setattr(_rawio, "cached", lambda fd, offset: warm)
    monkeypatch.setattr(_rawio, "DIRECT_READS", request.param == "direct")
    if warm:
        monkeypatch.setattr(_rawio, "IO_THREADS", 4)
    return str(request.param)


def _values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        # three pieces of _SPLIT (8 MiB), the last one short
        "big": rng.standard_normal((2_700_000,)).astype(np.float64),  # 20.6 MiB
        "mid": rng.standard_normal((300, 1000)).astype(np.float32),  # 1.1 MiB: one piece
        "small": np.arange(10, dtype=np.int16),  # packed
        "empty": np.zeros((0, 4), np.float32),
    }


@given(
    a=st.binary(max_size=3000),
    b=st.binary(max_size=3000),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=200, deadline=None)
def test_combine_joins_crcs_of_pieces(a: bytes, b: bytes, seed: int) -> None:
    whole = _checksum.crc(a + b, seed)
    assert _checksum.combine(_checksum.crc(a, seed), _checksum.crc(b), len(b)) == whole


def test_combine_over_long_lengths() -> None:
    zeros = bytes(5 << 20)
    a = b"\x01\x02\x03"
    assert _checksum.combine(_checksum.crc(a), _checksum.crc(zeros), len(zeros)) == (
        _checksum.crc(a + zeros)
    )


def test_round_trip_through_every_entry_point(fmt: str, path_kind: str, tmp_path: Path) -> None:
    vals = _values()
    p = cv.save(tmp_path / f"m.{fmt}", vals)
    got = cv.load(p)
    for k, v in vals.items():
        np.testing.assert_array_equal(got[k], v)
    with cv.open(p) as r:
        np.testing.assert_array_equal(r["big"].read(), vals["big"])
        out = np.empty_like(vals["big"])
        assert r["big"].read(out=out) is out
        np.testing.assert_array_equal(out, vals["big"])
        r.verify_many(list(vals))
        assert r.verify_all() == []
        dests = {k: np.empty_like(v) for k, v in vals.items()}
        r.read_into_many(list(dests.items()))
        for k, v in vals.items():
            np.testing.assert_array_equal(dests[k], v)


def _flip_in(path: Path, pattern: bytes) -> None:
    files = sorted(q for q in path.rglob("*") if q.is_file()) if path.is_dir() else [path]
    for f in files:
        data = f.read_bytes()
        at = data.find(pattern)
        if at >= 0:
            with open(f, "r+b") as fh:
                fh.seek(at)
                fh.write(bytes([data[at] ^ 0x40]))
            return
    raise AssertionError("pattern not found")


@pytest.mark.parametrize("piece", [0, 1, 2])
def test_damage_in_any_piece_is_caught(fmt: str, path_kind: str, piece: int,
                                       tmp_path: Path) -> None:
    vals = _values()
    p = Path(cv.save(tmp_path / f"m.{fmt}", vals))
    start = piece * transfer._SPLIT // 8 + 1000  # an element inside that piece
    _flip_in(p, vals["big"][start : start + 4].tobytes())
    with pytest.raises(cv.CorruptCheckpointError, match="'big'.*checksum"):
        cv.load(p)
    with cv.open(p) as r:
        with pytest.raises(cv.CorruptCheckpointError, match="'big'"):
            r.verify_many(["mid", "big"])
        assert [k for k, _ in r.verify_all()] == ["big"]
        # unverified reads still return the (damaged) bytes, as asked
        assert r["big"].read(verify=False).shape == vals["big"].shape


def test_restore_meeting_damage_changes_nothing(fmt: str, path_kind: str,
                                                tmp_path: Path) -> None:
    vals = _values()
    model = cv.Module(name="m")
    model.w = {k: cv.Variable(v) for k, v in vals.items()}
    p = Path(cv.Checkpoint(model=model).write(tmp_path / f"c.{fmt}"))
    before = {k: np.full_like(v, 3) for k, v in vals.items()}
    for k, v in model.w.items():
        v.assign(before[k])
    _flip_in(p, vals["big"][2_000_000 : 2_000_004].tobytes())
    with pytest.raises(cv.CorruptCheckpointError):
        cv.Checkpoint(model=model).restore(p)
    for k, v in model.w.items():
        np.testing.assert_array_equal(v.numpy(), before[k])


def test_truncated_value_is_reported_with_its_size(path_kind: str, tmp_path: Path) -> None:
    vals = _values()
    p = Path(cv.save(tmp_path / "m.zarr", vals))
    chunk = next(q for q in (p / "big").rglob("*") if q.is_file() and q.name != "zarr.json")
    with open(chunk, "r+b") as fh:
        fh.truncate(chunk.stat().st_size - 100)
    with pytest.raises(cv.CorruptCheckpointError, match="'big'"):
        cv.load(p)


def test_wait_all_leaves_nothing_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_rawio, "IO_THREADS", 4)
    failed, finished = threading.Event(), threading.Event()

    def slow() -> None:
        assert failed.wait(timeout=30)  # ends only after the other task has failed
        finished.set()

    def fail() -> None:
        failed.set()
        raise OSError("disk on fire")

    futures = _rawio.start_all([fail, slow])
    with pytest.raises(OSError, match="disk on fire"):
        _rawio.wait_all(futures)
    assert finished.is_set()  # the error waited for the other task


def test_first_error_in_task_order_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_rawio, "IO_THREADS", 4)
    early_failed = threading.Event()

    def late() -> None:
        assert early_failed.wait(timeout=30)  # fails after the second task has
        raise ValueError("first task")

    def early() -> None:
        early_failed.set()
        raise KeyError("second task")

    with pytest.raises(ValueError, match="first task"):
        _rawio.wait_all(_rawio.start_all([late, early]))


def test_cached_probe_on_a_real_file(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(b"x" * 8192)
    fd = os.open(f, os.O_RDONLY)
    try:
        os.pread(fd, 8192, 0)  # now in the page cache
        assert _rawio.cached(fd, 100) is (getattr(os, "RWF_NOWAIT", None) is not None)
        assert _rawio.cached(fd, 1 << 20) is False  # past the end: nothing to read
    finally:
        os.close(fd)


def test_io_threads_setting_is_checked(tmp_path: Path) -> None:
    env = dict(os.environ, CKPTVAR_IO_THREADS="many")
    out = subprocess.run([sys.executable, "-c", "import ckptvar.storage.rawio"],
                         env=env, capture_output=True, text=True, check=False)
    assert out.returncode != 0
    assert "CKPTVAR_IO_THREADS must be a whole number" in out.stderr


def test_reads_work_in_a_forked_child(tmp_path: Path) -> None:
    """The pools are rebuilt after fork: a child never waits on its parent's threads."""
    p = cv.save(tmp_path / "m.h5", _values())
    script = textwrap.dedent(f"""
        import os, sys
        import numpy as np
        import ckptvar as cv
        from ckptvar.storage import rawio as _rawio
        _rawio.IO_THREADS = 4
        _rawio.cached = lambda fd, off: True
        want = cv.load({str(p)!r})["big"]  # starts the parent's pools
        pid = os.fork()
        if pid == 0:
            ok = np.array_equal(cv.load({str(p)!r})["big"], want)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr


def test_single_thread_setting_reads_inline(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "m.zarr", _values())
    script = textwrap.dedent(f"""
        import threading
        import numpy as np
        import ckptvar as cv
        from ckptvar.storage import rawio as _rawio
        assert _rawio.IO_THREADS == 1
        got = cv.load({str(p)!r})
        assert got["big"].shape == (2_700_000,)
        assert not [t for t in threading.enumerate() if t.name.startswith("ckptvar-io")]
    """)
    env = dict(os.environ, CKPTVAR_IO_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr


def test_snapshot_copies_in_pieces_and_keeps_dtype_and_order(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    import ml_dtypes

    monkeypatch.setattr(_rawio, "IO_THREADS", 4)
    rng = np.random.default_rng(3)
    big = rng.standard_normal((3000, 1000)).astype(np.float32)  # 11.4 MiB: two pieces
    bf = big.astype(ml_dtypes.bfloat16)
    strided = big.T  # not C-contiguous: copied whole, in C order
    small = np.arange(5, dtype=np.int8)
    copies = _rawio.snapshot([big, bf, strided, small])
    for src, c in zip([big, bf, strided, small], copies, strict=True):
        assert c.dtype == src.dtype and c.shape == src.shape and c.flags.c_contiguous
        assert not np.shares_memory(src, c)
        np.testing.assert_array_equal(c.astype(np.float64), src.astype(np.float64))


def test_background_save_snapshot_is_taken_before_save_returns(fmt: str, tmp_path: Path
                                                               ) -> None:
    vals = _values()
    model = cv.Module(name="m")
    model.w = {k: cv.Variable(v) for k, v in vals.items()}
    ckpt = cv.Checkpoint(model=model)
    handle = ckpt.save(tmp_path / "c", format=fmt, blocking=False)
    model.w["big"].assign_add(np.ones_like(vals["big"]))  # after the snapshot: not saved
    path = handle.wait()
    np.testing.assert_array_equal(_load_big(path), vals["big"])


def _load_big(path: Path | str) -> np.ndarray:
    got = cv.load(path)
    (key,) = [k for k in got if k.startswith("model/w/big")]
    return got[key]


@pytest.mark.parametrize("direct", [False, True])
def test_reads_from_disk_keep_one_stream(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         direct: bool) -> None:
    """Buffered read-ahead from disk never runs two windows at once (two streams defeat
    readahead); with ``O_DIRECT`` (no readahead to defeat) the pieces run on several
    threads at once, so that several requests are in flight."""
    monkeypatch.setattr(_rawio, "DIRECT_READS", direct)
    monkeypatch.setattr(_rawio, "IO_THREADS", 4)
    monkeypatch.setattr(_rawio, "cached", lambda fd, offset: False)
    monkeypatch.setattr(bulk, "_WINDOW", 4 << 20)
    monkeypatch.setattr(transfer, "_SPLIT", 1 << 20)
    monkeypatch.setattr(transfer, "_TASK", 1 << 20)
    rng = np.random.default_rng(1)
    vals = {f"w{i}": rng.standard_normal(2 << 17) for i in range(6)}  # 2 MiB each: 3 windows
    p = cv.save(tmp_path / "m.h5", vals)
    lock, live, most = threading.Lock(), [0], [0]
    run = transfer.Transfer._run

    def counted(self: transfer.Transfer, group: list) -> None:  # type: ignore[type-arg]
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        try:
            time.sleep(0.02)
            run(self, group)
        finally:
            with lock:
                live[0] -= 1

    monkeypatch.setattr(transfer.Transfer, "_run", counted)
    got = cv.load(p)
    for k, v in vals.items():
        np.testing.assert_array_equal(got[k], v)
    assert (most[0] > 1) if direct else (most[0] == 1)


def test_pwrite_flushing_writes_every_piece_in_place(tmp_path: Path) -> None:
    data = np.random.default_rng(2).integers(0, 255, (20 << 20) + 123, dtype=np.uint8)
    f = tmp_path / "x.bin"
    fd = os.open(f, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, b"head", 0)
        _rawio.pwrite_flushing(fd, memoryview(data), 4)
        os.fsync(fd)
    finally:
        os.close(fd)
    raw = f.read_bytes()
    assert raw[:4] == b"head" and raw[4:] == data.tobytes()


def test_start_writeback_is_only_a_hint(tmp_path: Path) -> None:
    """Where the kernel cannot start writeback (a pipe), nothing is raised: fsync reports."""
    r, w = os.pipe()
    try:
        _rawio.start_writeback(w, 0, 1 << 20)
        _rawio.start_writeback(r, 0, 0)
        os.write(w, b"still usable")  # the hint left both ends as they were
        assert os.read(r, 64) == b"still usable"
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("durable", [True, False])
def test_saves_round_trip_with_and_without_writeback(fmt: str, durable: bool,
                                                     tmp_path: Path) -> None:
    vals = _values()
    p = cv.save(tmp_path / f"m.{fmt}", vals, durable=durable)
    got = cv.load(p)
    for k, v in vals.items():
        np.testing.assert_array_equal(got[k], v)


@pytest.mark.parametrize("shape", [(), (3,), [2, 5], (np.int64(4), 1), (0, 7)])
def test_header_crc_is_the_crc_of_the_header(shape: object) -> None:
    for _ in range(2):  # second time from the cached dtype/shape part
        for key in ("w", "a/b%2Fc", "é/x"):
            assert _checksum.header_crc(key, "float32", shape) == _checksum.crc(  # type: ignore[arg-type]
                _checksum.header(key, "float32", shape)  # type: ignore[arg-type]
            )


def test_streaming_read_many_holds_at_most_two_windows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fmt: str
) -> None:
    """A consumer that drops each value (a GPU load) keeps two windows alive, not three."""
    import tracemalloc

    monkeypatch.setattr(_rawio, "IO_THREADS", 4)
    monkeypatch.setattr(_rawio, "cached", lambda fd, offset: True)  # two windows in flight
    monkeypatch.setattr(bulk, "_WINDOW", 4 << 20)
    vals = {f"w{i:02d}": np.full(1 << 19, i, np.float64) for i in range(12)}  # 12 × 4 MiB
    p = cv.save(tmp_path / f"m.{fmt}", vals)
    del vals
    seen = []
    with cv.open(p) as r:
        keys = list(r.keys())
        tracemalloc.start()  # NumPy reports its buffers to tracemalloc
        try:
            for key, arr in r.read_many(keys):
                seen.append((key, float(arr[-1])))
                del arr
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert seen == [(f"w{i:02d}", float(i)) for i in range(12)]
    assert peak < (2 * 4 + 2) << 20, f"peak {peak / 2**20:.1f} MiB"


def test_snapshot_copy_helpers_only_for_cpus_beyond_the_jobs_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One process on 4 CPUs: the caller and 3 I/O threads share the copy's pieces; 4
    processes of a job on 4 CPUs: each copies alone (a helper only slows the others)."""
    from concurrent.futures import ThreadPoolExecutor

    submitted: list[int] = []

    class Counting(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
            submitted.append(1)
            return super().submit(fn, *args, **kwargs)

    pool = Counting(4)
    monkeypatch.setattr(_rawio, "IO_THREADS", 4)
    monkeypatch.setattr(_rawio, "_cpus", lambda: 4)
    monkeypatch.setattr(_rawio._pools, "io_pool", lambda: pool)
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(1 << 18) for _ in range(10)]  # 10 x 2 MiB
    try:
        for processes, helpers in ((1, 3), (2, 1), (4, 0)):
            submitted.clear()
            into = [np.empty_like(a) for a in arrays]
            got = _rawio.snapshot(arrays, into, processes=processes)
            assert len(submitted) == helpers
            assert all(g is d and np.array_equal(g, a)
                       for g, d, a in zip(got, into, arrays, strict=True))
    finally:
        pool.shutdown()
