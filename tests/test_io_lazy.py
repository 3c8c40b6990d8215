"""The read side against NumPy and against its neighbours: lazy slices of every form,
readers used after close or pickled, and a reader of a step a manager prunes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.storage import _zarr

MiB = 1 << 20

#: Run in a subprocess: the peak RSS (MiB) that ``cv.open(path)["w"]`` + ``key`` adds. Linux
#: keeps ``ru_maxrss`` across ``fork`` and ``exec`` (a child starts at its parent's RSS), so
#: the peak is the process's own ``VmHWM``, reset first (``/proc/self/clear_refs``).
PEAK = """
import json, sys, numpy as np, zarr, zarr.codecs, zarr.storage, ckptvar as cv
def kib(field):
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(field))
path, key, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) or None
with cv.open(path, storage_options=opts) as reader:
    lazy = reader["w"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from here
    base = kib("VmRSS:")
    got = eval("lazy" + key)
print(json.dumps([(kib("VmHWM:") - base) / 1024, got.tolist() if got.size < 10 else None]))
"""


def peak_mib(path: str | Path, key: str, storage_options: dict[str, object] | None = None
             ) -> tuple[float, object]:
    """The peak RSS a lazy read ``key`` of value ``w`` adds in a fresh process, and the
    read's value when it is small."""
    out = subprocess.run([sys.executable, "-c", PEAK, str(path), key,
                          json.dumps(storage_options)],
                         capture_output=True, text=True, check=True, timeout=600)
    mib, got = json.loads(out.stdout)
    return float(mib), got


def test_a_compressed_zero_d_value_loads_zero_d(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "c.zarr", {"s": np.array(3.5, np.float32),
                                      "v": np.arange(3, dtype=np.int64)}, compression="zstd")
    assert cv.load(p)["s"].shape == ()
    assert cv.load_variable(p, "s").shape == ()
    with cv.open(p) as reader:
        assert reader["s"].read().shape == ()
        assert reader["s"][()] == np.float32(3.5)
        assert reader["s"][None].shape == (1,)
        with pytest.raises(IndexError):
            reader["s"][0]


def test_a_zarr_step_pruned_and_reused_under_a_reader_is_not_found_never_damaged(
    fresh_graph: cv.Graph, tmp_path: Path
) -> None:
    """A local incremental manager sets a pruned Zarr step aside and writes its next step
    into it: a reader still holding the pruned step then finds other bytes in its files."""
    big = cv.Variable(np.random.default_rng(0).random((2048, 256), dtype=np.float32),
                      name="big")  # 2 MiB: block checksums, lazy slices by runs
    head = cv.Variable(np.zeros(20000, np.float32), name="head")
    small = cv.Variable(np.zeros(10, np.float32), name="small")
    mgr = cv.CheckpointManager(cv.Checkpoint(big=big, head=head, small=small), tmp_path,
                               max_to_keep=1, incremental=True, format="zarr")
    first = mgr.save()
    expect = cv.load(first)
    with cv.open(first) as reader:
        for _ in range(3):  # the step set aside, then taken over by the next save
            for v in (big, head, small):
                v.assign_add(np.ones(v.shape, np.float32))
            mgr.save()
            for key in ("big", "head", "small"):
                for read, want in ((lambda k: reader[k].read(), np.s_[...]),
                                   (lambda k: reader[k][1:3], np.s_[1:3]),
                                   (lambda k: reader[k][-1], np.s_[-1])):
                    try:
                        got = read(key)
                    except cv.CheckpointNotFoundError as exc:
                        assert "was deleted while it was being read" in str(exc)
                    else:  # the right bytes, or none
                        assert np.array_equal(got, expect[key][want])


def test_a_compressed_zarr_value_is_stored_in_chunks_of_rows_and_sliced_across_them(
    tmp_path: Path
) -> None:
    w = np.arange(3 * MiB, dtype=np.float32).reshape(-1, 256)  # 12 MiB: 3 chunks of 4 MiB
    p = cv.save(tmp_path / "c.zarr", {"w": w}, compression="zstd")
    assert sorted(f.name for f in (Path(p) / "w").iterdir()) == [
        "c.0.0", "c.1.0", "c.2.0", "zarr.json"]
    with cv.open(p) as reader:
        lazy = reader["w"]
        for key in (np.s_[0], np.s_[4095:4097], np.s_[-1], np.s_[:-4:-1],
                    np.s_[8191:4095:-7, ::3], np.s_[5, 7], np.s_[..., 7], np.s_[100:12000]):
            np.testing.assert_array_equal(lazy[key], w[key])
        np.testing.assert_array_equal(lazy.read(), w)
    np.testing.assert_array_equal(cv.load(p)["w"], w)


def test_a_slice_of_a_compressed_value_checks_every_chunk(tmp_path: Path) -> None:
    """The checksum covers the whole value: damage or loss in the last chunk is found by a
    slice of the first row, named as such."""
    w = np.arange(3 * MiB, dtype=np.float32).reshape(-1, 256)
    p = Path(cv.save(tmp_path / "c.zarr", {"w": w}, compression="zstd"))
    other = cv.save(tmp_path / "o.zarr", {"w": w + 1}, compression="zstd")
    (p / "w" / "c.2.0").write_bytes((Path(other) / "w" / "c.2.0").read_bytes())
    with cv.open(p) as reader, pytest.raises(cv.CorruptCheckpointError,
                                             match="'w' fails its checksum"):
        reader["w"][0]
    (p / "w" / "c.2.0").unlink()
    with cv.open(p) as reader, pytest.raises(cv.CorruptCheckpointError,
                                             match=r"'w' has lost its chunk file 'c\.2\.0'"):
        reader["w"][0]


def test_a_lazy_row_of_a_compressed_value_holds_one_chunk(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-row slice decoded the whole value, two or three copies of it at once (187 MiB
    for 64 MiB); it holds about a chunk now (here 256 KiB; the 1 GiB forms, in chunks of
    4 MiB: the ``slow`` test below)."""
    monkeypatch.setattr(_zarr, "COMPRESSED_CHUNK", 256 << 10)
    w = np.arange(8 * MiB, dtype=np.float32).reshape(-1, 256)  # 32 MiB, quick to compress
    p = cv.save(tmp_path / "c.zarr", {"w": w}, compression="zstd")
    mib, got = peak_mib(p, "[7, :3]")
    assert got == w[7, :3].tolist()
    assert mib < 8, f"a one-row slice of a 32 MiB value added {mib:.0f} MiB"
    mib, got = peak_mib(p, "[[9, 7], :2]")  # rows picked by an array: their run only
    assert got == w[[9, 7], :2].tolist()
    assert mib < 8, f"two rows of a 32 MiB value added {mib:.0f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("fmt, compression", [("h5", None), ("zarr", None), ("zarr", "zstd"),
                                              ("zarr", "blosc")])  # gzip: as these, 9 minutes
def test_a_lazy_row_of_a_gib_value_holds_little_memory(tmp_path: Path, fmt: str,
                                                       compression: str | None) -> None:
    w = np.random.default_rng(0).standard_normal((256 * 1024, 1024), dtype=np.float32)  # 1 GiB
    opts = {} if compression is None else {"compression": compression}
    p = cv.save(tmp_path / f"c.{fmt}", {"w": w}, **opts)
    want = w[-1, :3].tolist()
    del w
    for key in ("[5]", "[-1:]", "[100:200]"):
        mib, _ = peak_mib(p, key)
        assert mib < 64, f"{key} of a 1 GiB value added {mib:.0f} MiB"
    assert peak_mib(p, "[-1, :3]")[1] == want
    mib, _ = peak_mib(p, ".read()")
    assert mib < 1024 + 64, f"a whole read of a 1 GiB value added {mib:.0f} MiB"


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_an_index_with_an_ellipsis_fixing_every_axis_gives_a_0d_array(
    tmp_path: Path, compression: str | None
) -> None:
    """NumPy gives ``a[..., 1]`` of a 1-D array as a 0-d array, ``a[1]`` as a scalar; a lazy
    slice of a value read by runs gave a scalar for both."""
    a = np.arange(300_000, dtype=np.float32)  # over 1 MiB: read by runs, not whole
    b = a.reshape(500, 600)
    p = cv.save(tmp_path / "c.zarr", {"a": a, "b": b}, compression=compression)
    with cv.open(p) as reader:
        for key, full in (("a", a), ("b", b)):
            for index in (np.s_[..., 1], np.s_[1, ...], np.s_[1, ..., 2], np.s_[1, 2],
                          np.s_[..., 1, 2], np.s_[3]):
                if index != np.s_[3] and len([i for i in index if i is not Ellipsis]) \
                        > full.ndim:
                    continue
                got, want = reader[key][index], full[index]
                assert type(got) is type(want), (key, index)
                np.testing.assert_array_equal(got, want)


def test_a_reader_or_lazy_value_refuses_pickling_saying_what_to_do(tmp_path: Path,
                                                                    fmt: str) -> None:
    """Pickling one (to send it to another process) failed with "cannot pickle
    '_thread.lock' object", naming neither the reader nor a way out."""
    import pickle
    p = cv.save(tmp_path / f"c.{fmt}", {"w": np.arange(3.0)})
    with cv.open(p) as reader:
        for obj in (reader, reader["w"]):
            with pytest.raises(TypeError, match=r"cannot pickle .*checkpoint reader") as err:
                pickle.dumps(obj)
            assert "cv.open(path)" in str(err.value)


def test_a_lazy_value_as_an_array_follows_numpy_copy_keyword(tmp_path: Path, fmt: str) -> None:
    """``np.asarray(lazy, copy=False)`` returned the read array: NumPy 2 asks it to raise
    when a copy cannot be avoided, and a lazy value is always read into a new array."""
    w = np.arange(6.0).reshape(2, 3)
    p = cv.save(tmp_path / f"c.{fmt}", {"w": w})
    with cv.open(p) as reader:
        lazy = reader["w"]
        with pytest.raises(ValueError, match="copy=False"):
            np.asarray(lazy, copy=False)
        with pytest.raises(ValueError, match="copy=False"):
            lazy.__array__(np.float32, copy=False)
        for copy in (None, True):
            got = np.asarray(lazy, copy=copy)
            assert got.dtype == w.dtype
            np.testing.assert_array_equal(got, w)
        assert np.asarray(lazy, dtype=np.float32, copy=True).dtype == np.float32


def test_a_reader_closed_or_left_refuses_reads_and_keeps_answering_metadata(
    tmp_path: Path, fmt: str
) -> None:
    p = cv.save(tmp_path / f"c.{fmt}", {"w": np.arange(6.0).reshape(2, 3)})
    with cv.open(p) as reader:
        lazy = reader["w"]
    for read in (lambda: lazy[0], lazy.read, lambda: np.asarray(lazy),
                 lambda: reader.read("w")):
        with pytest.raises(ValueError, match="is closed"):
            read()
    assert lazy.shape == (2, 3) and reader.info("w").shape == (2, 3)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_index_form_on_a_value_read_by_runs_matches_numpy(
    tmp_path: Path, compression: str | None
) -> None:
    """Results equal ``full[index]`` exactly (type, dtype, shape, bytes), or NumPy's error."""
    rng = np.random.default_rng(0)
    full = rng.standard_normal((700, 5, 100)).astype(np.float32)  # 1.4 MiB: read by runs
    p = cv.save(tmp_path / "c.zarr", {"w": full}, compression=compression)
    mask0 = rng.random(700) > 0.5
    keys = [np.s_[::-1], np.s_[500:100:-3], np.s_[..., 0], np.s_[None], np.s_[:, None, 1],
            np.s_[-1], np.s_[-700], np.s_[1:10_000], np.s_[10_000:], np.s_[[0, 2, -1]],
            np.s_[[5, 5, 4]], np.s_[np.array([[1, 2], [3, 4]])], np.s_[mask0],
            np.s_[mask0, 2], np.s_[[3, 9], 1:3, ::-7], np.s_[[3, 9], [1, 2]],
            np.s_[[3, 9], ..., None], np.s_[np.uint8(3)], np.s_[np.array([], np.intp)],
            np.s_[[700]], np.s_[[-701, 0]], np.s_[700], np.s_[0, 5], np.s_[2:2],
            np.s_[1, 2, 3], np.s_[..., 1, 2, 3], np.s_[:, [4, 0]], np.s_[[True, False]],
            np.s_[1.0], np.s_[0, 0, 0, 0], np.s_[::0]]
    with cv.open(p) as reader:
        lazy = reader["w"]
        for key in keys:
            try:
                want = full[key]
            except (IndexError, TypeError, ValueError) as exc:
                with pytest.raises(type(exc)):
                    lazy[key]
                continue
            got = lazy[key]
            assert type(got) is type(want), key
            assert (np.shape(got), got.dtype) == (want.shape, want.dtype), key
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), key


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_many_threads_slice_one_reader(tmp_path: Path, compression: str | None) -> None:
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(0)
    vals = {f"v{i}": rng.standard_normal((600 + i, 500)).astype(np.float32) for i in range(3)}
    vals["small"] = np.arange(100, dtype=np.int64)
    p = cv.save(tmp_path / "c.zarr", vals, compression=compression)
    with cv.open(p) as reader:
        def work(seed: int) -> int:
            r = np.random.default_rng(seed)
            bad = 0
            for _ in range(10):
                key = list(vals)[int(r.integers(len(vals)))]
                a = int(r.integers(len(vals[key])))
                b = int(r.integers(a, len(vals[key]) + 1))
                if r.random() < 0.1:
                    bad += not np.array_equal(reader[key].read(), vals[key])
                else:
                    bad += not np.array_equal(reader[key][a:b], vals[key][a:b])
            return bad
        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(work, range(16))) == 0


def test_a_reader_opened_before_fork_reads_in_both_processes(tmp_path: Path, fmt: str) -> None:
    import os
    w = np.random.default_rng(0).random((2048, 256), dtype=np.float32)
    p = cv.save(tmp_path / f"c.{fmt}", {"w": w, "s": np.arange(5.0)})
    with cv.open(p) as reader:
        reader["w"][3]
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports by its exit status
            ok = np.array_equal(reader["w"][5:9], w[5:9]) and np.array_equal(
                reader["s"].read(), np.arange(5.0))
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        np.testing.assert_array_equal(reader["w"].read(), w)
