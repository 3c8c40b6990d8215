"""The multi-process layout in one process: a shard saved with a coordinator, read back.

A ``SingleProcessCoordinator`` with a variable that holds a shard takes the same
collective path as N processes (the per-rank file, the index, the commit), so the
layout, its reader and the restore's checks are tested here without ``mpiexec``.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.distributed import Box, SingleProcessCoordinator
from ckptvar.errors import CorruptCheckpointError, DistributedError, ShardLayoutError
from ckptvar.storage._sharded import INDEX_FILE, ShardedReader

FULL = (np.arange(8 * 3, dtype="float32") * 2).reshape(8, 3)


def _save(tmp_path: Path, suffix: str) -> str:
    coord = SingleProcessCoordinator()
    w = cv.Variable(FULL.copy(), name="w", shard=cv.Shard(full_shape=(8, 3), offset=(0, 0)))
    b = cv.Variable(np.ones(2, "int64"), name="b")
    return str(cv.Checkpoint(w=w, b=b).save(tmp_path / f"ckpt{suffix}", coordinator=coord))


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_coordinated_save_is_one_directory_with_an_index(tmp_path: Path, suffix: str) -> None:
    path = Path(_save(tmp_path, suffix))
    assert path.is_dir() and (path / INDEX_FILE).is_file()
    assert (path / f"rank-00000{suffix}").exists()
    assert cv.latest_checkpoint(tmp_path) == str(path)
    values = cv.load(path)
    assert np.array_equal(values["w"], FULL) and values["b"].tolist() == [1, 1]
    assert dict((k, s) for k, s, _ in cv.list_variables(path))["w"] == (8, 3)


def test_restore_into_a_smaller_box_reads_only_its_rows(tmp_path: Path) -> None:
    path = _save(tmp_path, ".h5")
    part = cv.Variable(np.zeros((3, 3), "float32"), name="w",
                       shard=cv.Shard(full_shape=(8, 3), offset=(2, 0)))
    b = cv.Variable(np.zeros(2, "int64"), name="b")
    cv.Checkpoint(w=part, b=b).restore(path, coordinator=SingleProcessCoordinator())
    assert np.array_equal(part.numpy(), FULL[2:5]) and b.numpy().tolist() == [1, 1]
    with ShardedReader(Path(path)) as reader:
        assert np.array_equal(reader.read_box("w", Box((2, 1), (3, 2))), FULL[2:5, 1:3])
        assert reader.bytes_read == FULL.nbytes  # a small box is read whole (and verified)


def test_an_uncovered_box_fails_and_changes_nothing(tmp_path: Path) -> None:
    path = Path(_save(tmp_path, ".h5"))
    index = msgpack.unpackb((path / INDEX_FILE).read_bytes())
    index["variables"]["w"]["boxes"][0][1] = [4, 3]  # the index now covers rows 0:4 only
    (path / INDEX_FILE).write_bytes(msgpack.packb(index, use_bin_type=True))
    with ShardedReader(path) as reader, pytest.raises(ShardLayoutError, match="never fills"):
        reader.read_box("w", Box((4, 0), (4, 3)))
    w = cv.Variable(np.full((4, 3), 7, "float32"), name="w",
                    shard=cv.Shard(full_shape=(8, 3), offset=(4, 0)))
    b = cv.Variable(np.zeros(2, "int64"), name="b")
    with pytest.raises(ShardLayoutError, match=r"never fills") as info:  # as without one
        cv.Checkpoint(w=w, b=b).restore(path, coordinator=SingleProcessCoordinator())
    assert "(rank 0)" in info.value.__notes__[0]  # the vote's note names the failing ranks
    assert (w.numpy() == 7).all() and (b.numpy() == 0).all()  # nothing changed


def test_a_damaged_index_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    path = Path(_save(tmp_path, ".h5"))
    (path / INDEX_FILE).write_bytes(msgpack.packb({"format": "something else"}))
    with pytest.raises(CorruptCheckpointError, match="not a ckptvar multi-process index"):
        cv.load(path)
    (path / INDEX_FILE).write_bytes(b"\xc1garbage")
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        cv.load(path)


def test_ckpt_verify_names_the_damaged_slice_file(tmp_path: Path) -> None:
    path = Path(_save(tmp_path, ".h5"))
    rank_file = path / "rank-00000.h5"
    data = bytearray(rank_file.read_bytes())
    at = bytes(data).find(FULL.tobytes()[:48])
    assert at > 0
    data[at + 5] ^= 0x55
    rank_file.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "ckptvar", "verify", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "rank-00000.h5" in proc.stdout + proc.stderr
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*rank-00000\.h5"):
        cv.load(path)


def test_python_state_comes_back_with_a_coordinated_restore(tmp_path: Path) -> None:
    class Step(cv.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def python_state(self) -> dict[str, int]:
            return {"n": self.n}

        def restore_python_state(self, state: dict[str, int]) -> None:
            self.n = state["n"]

    coord = SingleProcessCoordinator()
    step = Step()
    step.n = 41
    w = cv.Variable(FULL.copy(), name="w", shard=cv.Shard(full_shape=(8, 3), offset=(0, 0)))
    path = cv.Checkpoint(w=w, step=step).save(tmp_path / "ckpt", coordinator=coord)
    other = Step()
    w2 = cv.Variable(np.zeros((8, 3), "float32"), name="w",
                     shard=cv.Shard(full_shape=(8, 3), offset=(0, 0)))
    cv.Checkpoint(w=w2, step=other).restore(path, coordinator=coord)
    assert other.n == 41 and np.array_equal(w2.numpy(), FULL)


def test_ckpt_convert_consolidates_into_one_file(tmp_path: Path) -> None:
    path = _save(tmp_path, ".zarr")
    one = tmp_path / "one.h5"
    proc = subprocess.run([sys.executable, "-m", "ckptvar", "convert", path, str(one)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert one.is_file()
    values = cv.load(one)
    assert np.array_equal(values["w"], FULL) and values["b"].tolist() == [1, 1]


def test_plain_variables_restore_from_a_multi_process_checkpoint(tmp_path: Path) -> None:
    path = _save(tmp_path, ".h5")
    w = cv.Variable(np.zeros((8, 3), "float32"), name="w")
    b = cv.Variable(np.zeros(2, "int64"), name="b")
    cv.Checkpoint(w=w, b=b).restore(path).assert_consumed()
    assert np.array_equal(w.numpy(), FULL) and b.numpy().tolist() == [1, 1]


def test_bulk_reads_go_straight_into_the_buffers_and_bulk_checks_name_the_file(
    tmp_path: Path,
) -> None:
    path = Path(_save(tmp_path, ".h5"))
    w, b = np.zeros((8, 3), "float32"), np.zeros(2, "int64")
    with ShardedReader(path) as reader:
        reader.verify_many(["w", "b"])
        reader.read_into_many([("w", w), ("b", b)])
        assert reader.bytes_read == w.nbytes + b.nbytes
        with pytest.raises(ValueError, match="C-contiguous float32"):
            reader.read_into_many([("w", np.zeros((3, 8), "float32"))])
    assert np.array_equal(w, FULL) and b.tolist() == [1, 1]
    rank_file = path / "rank-00000.h5"
    data = bytearray(rank_file.read_bytes())
    data[bytes(data).find(FULL.tobytes()[:48]) + 5] ^= 0x55
    rank_file.write_bytes(bytes(data))
    with ShardedReader(path) as reader:
        with pytest.raises(CorruptCheckpointError, match=r"'w'.*rank-00000\.h5"):
            reader.verify_many(["b", "w"])
        with pytest.raises(CorruptCheckpointError, match=r"'w'.*rank-00000\.h5"):
            reader.read_into_many([("w", w)], verify=True)


class _Counting(SingleProcessCoordinator):
    """A real single-process coordinator that records each collective and its payload size."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def allgather(self, obj, *, tag, timeout=None):  # type: ignore[no-untyped-def]
        self.calls.append((tag, len(pickle.dumps(obj))))
        return super().allgather(obj, tag=tag, timeout=timeout)

    def broadcast(self, obj, root=0, *, tag, timeout=None):  # type: ignore[no-untyped-def]
        self.calls.append((tag, len(pickle.dumps(obj))))
        return super().broadcast(obj, root, tag=tag, timeout=timeout)


def test_a_repeated_save_exchanges_one_small_digest_instead_of_the_layouts(
    tmp_path: Path,
) -> None:
    coord = _Counting()
    n = 2000
    vs = {f"v{i}": cv.Variable(np.full(4, i, "float32"), name=f"v{i}",
                               shard=cv.Shard(full_shape=(4,), offset=(0,))) for i in range(n)}
    ckpt = cv.Checkpoint(**vs)
    saves = []
    for _ in range(2):
        coord.calls.clear()
        ckpt.save(tmp_path / "c.h5", coordinator=coord)
        saves.append(list(coord.calls))
    first, second = ([tag.split(":")[-1] for tag, _ in calls] for calls in saves)
    assert first == ["digests", "layouts", "prepare", "prepare", "write", "commit"]
    assert second == ["digests", "prepare", "prepare", "write", "commit"]  # no layouts
    layouts = next(size for tag, size in saves[0] if tag.endswith(":layouts"))
    assert layouts > 20 * n  # the layouts grow with the variables ...
    assert all(size < 600 for _, size in saves[1])  # ... every exchange of the repeat is small
    with ShardedReader(tmp_path / "c-2.h5") as reader:
        assert reader.read("v1999").tolist() == [1999] * 4
    vs["v0"].assign(np.zeros(4, "float32"))
    bigger = cv.Variable(np.zeros(8, "float32"), name="w",
                         shard=cv.Shard(full_shape=(8,), offset=(0,)))
    coord.calls.clear()
    cv.Checkpoint(w=bigger, **vs).save(tmp_path / "d.h5", coordinator=coord)
    assert "layouts" in [tag.split(":")[-1] for tag, _ in coord.calls]  # a new layout: planned


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_rows_of_a_large_stored_box_go_straight_into_the_result(
    tmp_path: Path, suffix: str
) -> None:
    import tracemalloc

    full = np.arange(512 * 1024, dtype="float32").reshape(512, 1024)  # 2 MiB: a large box
    w = cv.Variable(full.copy(), name="w", shard=cv.Shard(full_shape=full.shape, offset=(0, 0)))
    path = cv.Checkpoint(w=w).save(tmp_path / f"ckpt{suffix}", coordinator=SingleProcessCoordinator())
    with ShardedReader(Path(path)) as reader:
        reader.read_box("w", Box((0, 0), (1, 1)))  # opened, record decoded: not measured
        before = reader.bytes_read
        tracemalloc.start()
        part = reader.read_box("w", Box((100, 0), (256, 1024)))  # 1 MiB of rows: one run
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert np.array_equal(part, full[100:356])
        assert reader.bytes_read - before == part.nbytes
        assert peak < 1.1 * part.nbytes  # no temporary copy of the part
        cols = reader.read_box("w", Box((100, 8), (4, 16)))  # a column cut: not one run
        assert np.array_equal(cols, full[100:104, 8:24])
    if suffix == ".zarr":
        return  # one chunk of a global Zarr array: a partial read is not verified (FORMAT.md)
    # a damaged byte inside the rows read is caught by the block checksums
    data_file = Path(path) / "rank-00000.h5"
    raw = bytearray(data_file.read_bytes())
    at = bytes(raw).find(full[200].tobytes()[:64])
    assert at > 0
    raw[at] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    with ShardedReader(Path(path)) as reader, pytest.raises(CorruptCheckpointError, match="'w'"):
        reader.read_box("w", Box((100, 0), (256, 1024)))


def test_a_part_of_a_box_of_a_few_blocks_reads_its_rows_and_verifies_their_blocks(
    tmp_path: Path,
) -> None:
    """A stored box of a few checksum blocks (512 KiB: under the 1 MiB a grid chunk is
    read whole below): a part of it is read as its run of rows, and verified by the block
    it touches (the rest of that block hashed from the file), not the others."""
    full = np.arange(256 * 512, dtype="float32").reshape(256, 512)  # 2 KiB rows
    w = cv.Variable(full.copy(), name="w", shard=cv.Shard(full_shape=full.shape, offset=(0, 0)))
    path = cv.Checkpoint(w=w).save(tmp_path / "ckpt.h5", coordinator=SingleProcessCoordinator())
    part = Box((10, 0), (10, 512))
    with ShardedReader(Path(path)) as reader:
        assert np.array_equal(reader.read_box("w", part), full[10:20])
        assert reader.bytes_read == 10 * 2048  # the rows, not the box's 512 KiB
    data_file = Path(path) / "rank-00000.h5"
    with cv.open(data_file) as r:
        per = r._record.block_size // 2048  # rows a block (32 of 64 KiB)
    assert 20 < per < 128
    good = data_file.read_bytes()
    for row, fails in ((per - 1, True), (per + 5, False)):  # block 0 (the part's), block 1
        raw = bytearray(good)
        at = good.find(full[row].tobytes()[:64])
        assert at > 0
        raw[at] ^= 0xFF
        data_file.write_bytes(bytes(raw))
        with ShardedReader(Path(path)) as reader:
            if fails:
                with pytest.raises(CorruptCheckpointError, match="'w'"):
                    reader.read_box("w", part)
            else:
                assert np.array_equal(reader.read_box("w", part), full[10:20])


def test_run_start_finds_one_contiguous_run_or_none() -> None:
    from ckptvar.storage.slicing import run_start

    shape = (4, 5, 6)
    for sl in [(slice(1, 3), slice(0, 5), slice(0, 6)), (slice(2, 3), slice(1, 4), slice(0, 6)),
               (slice(2, 3), slice(3, 4), slice(1, 5)), (slice(0, 4), slice(0, 5), slice(0, 6))]:
        start = run_start(sl, shape)
        flat = np.arange(120).reshape(shape)[sl].ravel()
        assert start == flat[0] and np.array_equal(flat, np.arange(start, start + flat.size))
    for sl in [(slice(1, 3), slice(0, 4), slice(0, 6)), (slice(0, 2), slice(0, 5), slice(1, 6)),
               (slice(1, 1), slice(0, 5), slice(0, 6))]:
        assert run_start(sl, shape) is None


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_large_restores_verify_first_then_read_into_the_variables(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the temporaries' budget a rank verifies the stored boxes it overlaps, votes,
    then reads straight into its variables' buffers (no second copy of its shards)."""
    import tracemalloc

    from ckptvar.checkpoint import _collective_restore

    monkeypatch.setattr(_collective_restore, "TEMPORARY_BUDGET", 1 << 20)
    coord = SingleProcessCoordinator()
    full = np.arange(512 * 1024, dtype="float32").reshape(512, 1024)  # 2 MiB
    w = cv.Variable(full.copy(), name="w", shard=cv.Shard(full_shape=full.shape, offset=(0, 0)))
    path = cv.Checkpoint(w=w).save(tmp_path / f"ckpt{suffix}", coordinator=coord)
    part = cv.Variable(np.ones((400, 1024), "float32"), name="w",
                       shard=cv.Shard(full_shape=full.shape, offset=(100, 0)))
    ckpt = cv.Checkpoint(w=part)
    ckpt.restore(path, coordinator=coord)  # opened once: the record is decoded, not measured
    part.assign(np.ones((400, 1024), "float32"))
    buf = part._host_buffer()
    tracemalloc.start()
    ckpt.restore(path, coordinator=coord).assert_consumed()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert np.array_equal(part.numpy(), full[100:500])
    assert part._host_buffer() is buf  # the variable's own memory, filled in place
    assert peak < 0.25 * buf.nbytes, peak  # no temporary of the rank's share
    files = [p for p in Path(path).rglob("*") if p.is_file() and p.stat().st_size >= full.nbytes]
    assert len(files) == 1

    def damage(row: int) -> None:
        raw = bytearray(files[0].read_bytes())
        at = bytes(raw).find(full[row].tobytes()[:64])
        assert at > 0
        raw[at] ^= 0xFF
        files[0].write_bytes(bytes(raw))

    # damage outside the rows this variable holds: HDF5 checks only the blocks it reads
    # (per-block checksums); a global Zarr chunk has one checksum, so it is checked whole
    damage(10)
    part.assign(np.ones((400, 1024), "float32"))
    if suffix == ".h5":
        ckpt.restore(path, coordinator=coord)
        assert np.array_equal(part.numpy(), full[100:500])
    else:
        with pytest.raises((CorruptCheckpointError, DistributedError)):
            ckpt.restore(path, coordinator=coord)
        assert np.array_equal(part.numpy(), np.ones((400, 1024), "float32"))
    # damage inside them: found before the variable changes
    damage(450)
    part.assign(np.ones((400, 1024), "float32"))
    with pytest.raises((CorruptCheckpointError, DistributedError), match="'w'"):
        ckpt.restore(path, coordinator=coord)
    assert np.array_equal(part.numpy(), np.ones((400, 1024), "float32"))


def test_a_repeated_save_reuses_its_layout_rows_and_keeps_no_model_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc
    import weakref

    from ckptvar.checkpoint import _collective

    calls: list[int] = []
    real = _collective._raw_layouts

    def counting(arrays, variables):  # type: ignore[no-untyped-def]
        calls.append(len(arrays))
        return real(arrays, variables)

    monkeypatch.setattr(_collective, "_raw_layouts", counting)
    coord = SingleProcessCoordinator()

    def model() -> tuple[cv.Checkpoint, cv.Variable]:
        w = cv.Variable(FULL.copy(), name="w", shard=cv.Shard(full_shape=(8, 3), offset=(0, 0)))
        b = cv.Variable(np.ones(2, "int64"), name="b")
        return cv.Checkpoint(w=w, b=b), b

    ckpt, b = model()
    ckpt.save(tmp_path / "a" / "ckpt.h5", coordinator=coord)
    b.assign(np.full(2, 7, "int64"))  # a replicated value changes: its checksum is new
    second = ckpt.save(tmp_path / "a" / "ckpt.h5", coordinator=coord)
    assert len(calls) == 1  # the same variables again: the rows were reused
    assert cv.load(second)["b"].tolist() == [7, 7]
    other, _ = model()  # new variable objects under the same keys: rows made again
    other.save(tmp_path / "b" / "ckpt.h5", coordinator=coord)
    assert len(calls) == 2
    ref = weakref.ref(b)
    del ckpt, b
    gc.collect()
    assert ref() is None  # the cache holds weak references only


def test_a_lazy_value_of_the_layout_is_a_lazy_array_like_any_other(tmp_path: Path) -> None:
    w = cv.Variable(FULL.copy(), name="w", shard=cv.Shard(full_shape=(8, 3), offset=(0, 0)))
    path = cv.Checkpoint(w=w).save(tmp_path / "ckpt", coordinator=SingleProcessCoordinator())
    with cv.open(path) as reader:
        lazy = reader["w"]
        assert lazy.info == reader.info("w")  # the LazyArray contract: info, shape, dtype
        assert (lazy.shape, lazy.dtype) == ((8, 3), np.dtype("float32"))
        assert repr(lazy) == "<LazyArray 'w' shape=(8, 3) dtype=float32>"
        np.testing.assert_array_equal(lazy[2:5], FULL[2:5])


def _rewrite_index(path: Path, change: Any) -> None:
    index = msgpack.unpackb((path / INDEX_FILE).read_bytes(), strict_map_key=False)
    change(index)
    (path / INDEX_FILE).write_bytes(msgpack.packb(index, use_bin_type=True))


@pytest.mark.parametrize(
    ("field", "value"),
    [("attrs", [1, 2]), ("attrs", "name"), ("shape", [-8, 3]), ("shape", [8.5, 3]),
     ("shape", "83")],
)
def test_an_index_field_of_the_wrong_kind_is_a_corrupt_checkpoint(
    tmp_path: Path, field: str, value: Any
) -> None:
    path = Path(_save(tmp_path, ".h5"))
    _rewrite_index(path, lambda ix: ix["variables"]["w"].update({field: value}))
    for read in (cv.load, cv.list_variables, lambda p: cv.open(p)["w"][1:3]):
        with pytest.raises(CorruptCheckpointError, match=r"index of .*ckpt-1\.h5.* 'w'"):
            read(path)


def _point_box(ix: dict[str, Any], shape: list[int], stored: str | None = None) -> None:
    rec = ix["variables"]["w"]
    rec["shape"] = shape
    rec["boxes"][0][1] = shape
    if stored is not None:
        rec["boxes"][0][3] = stored


@pytest.mark.parametrize(
    ("shape", "stored"),
    [([8, 3], "b/.box/0"),          # the box names another stored value
     ([10**12, 3], None)],          # a box far larger than the value its file holds
)
def test_a_box_that_its_file_does_not_hold_is_refused_before_any_allocation(
    tmp_path: Path, shape: list[int], stored: str | None
) -> None:
    path = Path(_save(tmp_path, ".h5"))
    _rewrite_index(path, lambda ix: _point_box(ix, shape, stored))
    words = r"'w'.*rank-00000\.h5"
    with pytest.raises(CorruptCheckpointError, match=words):
        cv.load(path)
    with cv.open(path) as reader:
        with pytest.raises(CorruptCheckpointError, match=words):
            reader["w"][...]
        with pytest.raises(CorruptCheckpointError, match=words):
            reader["w"][:2]
        assert reader["b"][...].tolist() == [1, 1]


def test_a_global_array_claiming_a_huge_chunk_is_refused_before_any_allocation(
    tmp_path: Path,
) -> None:
    w = cv.Variable(np.ones((128, 128), "float32"), name="w",
                    shard=cv.Shard(full_shape=(128, 128), offset=(0, 0)))  # 64 KiB: a grid
    path = Path(cv.Checkpoint(w=w).save(tmp_path / "ckpt.zarr",
                                        coordinator=SingleProcessCoordinator()))

    def huge(ix: dict[str, Any]) -> None:
        _point_box(ix, [10**12, 128])
        ix["variables"]["w"]["grid"]["chunk_shape"] = [10**12, 128]

    _rewrite_index(path, huge)
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*w/c\.0\.0"):
        cv.load(path)


@pytest.mark.parametrize("name", ["../outside.h5", "/tmp/outside.h5", "..", "", 3])
def test_an_index_naming_a_file_outside_its_step_is_refused(tmp_path: Path, name: Any) -> None:
    path = Path(_save(tmp_path / "run", ".h5"))
    outside = Path(_save(tmp_path / "other", ".h5")) / "rank-00000.h5"  # holds w/.box/0 too
    (path.parent / "outside.h5").write_bytes(outside.read_bytes())
    _rewrite_index(path, lambda ix: ix.update(files=[name]))
    with pytest.raises(CorruptCheckpointError, match=r"index of .*ckpt-1\.h5.*file"):
        cv.load(path)


def test_a_process_file_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    path = Path(_save(tmp_path / "run", ".h5"))
    outside = Path(_save(tmp_path / "other", ".h5")) / "rank-00000.h5"
    (path / "rank-00000.h5").unlink()
    (path / "rank-00000.h5").symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match=r"rank-00000\.h5.*symbolic link"):
        cv.load(path)


@pytest.mark.parametrize("index", [True, False, (0, True), (True, slice(1, 3))])
def test_a_boolean_index_of_a_sharded_value_is_numpy_s(tmp_path: Path, index: Any) -> None:
    path = _save(tmp_path, ".h5")
    with cv.open(path) as reader:
        got = reader["w"][index]
    assert got.shape == FULL[index].shape and np.array_equal(got, FULL[index])


def test_a_box_naming_another_variable_s_stored_value_is_refused_and_verify_finds_it(
    tmp_path: Path,
) -> None:
    coord = SingleProcessCoordinator()
    w = cv.Variable(FULL.copy(), name="w", shard=cv.Shard(full_shape=(8, 3), offset=(0, 0)))
    b = cv.Variable(np.ones((8, 3), "float32"), name="b")  # the same shape and dtype
    path = Path(cv.Checkpoint(w=w, b=b).save(tmp_path / "ckpt.h5", coordinator=coord))
    _rewrite_index(path, lambda ix: ix["variables"]["w"]["boxes"][0].__setitem__(3, "b/.box/0"))
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*'b/\.box/0'"):
        cv.load(path)
    with cv.open(path) as reader:
        assert [key for key, _ in reader.verify_all()] == ["w"]
        with pytest.raises(CorruptCheckpointError, match=r"'w'"):
            reader.verify_many(["b", "w"])


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_step_deleted_while_it_is_read_is_not_found_not_corrupt(
    tmp_path: Path, suffix: str
) -> None:
    """As a one-process reader says when a manager prunes the checkpoint it reads."""
    w = cv.Variable(np.ones((128, 128), "float32"), name="w",  # 64 KiB: a global Zarr array
                    shard=cv.Shard(full_shape=(128, 128), offset=(0, 0)))
    path = Path(cv.Checkpoint(w=w).save(tmp_path / f"ckpt{suffix}",
                                        coordinator=SingleProcessCoordinator()))
    with cv.open(path) as reader:
        shutil.rmtree(path)  # pruned
        with pytest.raises(cv.CheckpointNotFoundError, match="deleted while it was being read"):
            reader["w"][1:3]


def test_an_index_of_a_newer_version_asks_for_a_newer_ckptvar(tmp_path: Path) -> None:
    """As a one-process checkpoint of a newer major version does: not called damaged."""
    path = Path(_save(tmp_path, ".h5"))
    _rewrite_index(path, lambda ix: ix.update(version=3))
    with pytest.raises(cv.UnsupportedFormatError, match=r"index version 3.*upgrade ckptvar"):
        cv.load(path)
    proc = subprocess.run([sys.executable, "-m", "ckptvar", "verify", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "upgrade ckptvar" in proc.stderr and "not a checkpoint" not in proc.stderr


@pytest.mark.parametrize("out", [np.zeros((2, 8, 3), "float32"), np.zeros((8, 3), "float64"),
                                 np.zeros((8, 3), "int32"), np.zeros((1, 3), "float32")])
def test_read_into_an_out_of_another_shape_or_dtype_is_refused(tmp_path: Path,
                                                               out: np.ndarray) -> None:
    """As a one-process reader refuses it: no silent broadcast or cast into ``out``."""
    path = _save(tmp_path, ".h5")
    with cv.open(path) as reader, pytest.raises(ValueError, match=r"out= for 'w'"):
        reader.read("w", out=out)
    assert not out.any()


def test_read_into_a_strided_out_of_the_value_s_shape_and_dtype(tmp_path: Path) -> None:
    path = _save(tmp_path, ".h5")
    out = np.zeros((8, 6), "float32")[:, ::2]
    with cv.open(path) as reader:
        assert reader.read("w", out=out) is out
    assert np.array_equal(out, FULL)


def test_ckpt_verify_of_a_newer_zarr_checkpoint_asks_for_a_newer_ckptvar(tmp_path: Path) -> None:
    """A directory checkpoint of a newer version is not 'a directory, not a checkpoint'."""
    path = Path(cv.save(tmp_path / "new.zarr", {"w": np.ones(3)}))
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["ckptvar"]["format_version"] = [2, 0]
    (path / "zarr.json").write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, "-m", "ckptvar", "verify", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "upgrade ckptvar" in proc.stderr and "not a checkpoint" not in proc.stderr


def test_verify_reports_an_index_whose_boxes_leave_a_gap_as_damage(tmp_path: Path) -> None:
    path = Path(_save(tmp_path, ".h5"))
    _rewrite_index(path, lambda ix: ix["variables"]["w"]["boxes"][0].__setitem__(1, [4, 3]))
    with cv.open(path) as reader:
        assert [key for key, _ in reader.verify_all()] == ["w"]  # and 'b' is checked
    proc = subprocess.run([sys.executable, "-m", "ckptvar", "verify", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1 and "DAMAGED" in proc.stdout and "'w'" in proc.stdout


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda ix: ix["variables"]["w"]["boxes"][0].__setitem__(2, True), r"'w'.*file index"),
        (lambda ix: ix["variables"].__setitem__(5, ix["variables"].pop("b")), r"key 5"),
        (lambda ix: ix.__setitem__("metadata", [1, 2]), r"metadata.*not a map"),
        (lambda ix: ix.__setitem__("processes", 2), r"2 processes.*1 file"),
        (lambda ix: ix.__setitem__("processes", True), r"processes"),
        (lambda ix: ix["files"].append("rank-00001.h5"), r"rank-00001\.h5.*1 process"),
    ],
    ids=["true-file-index", "int-key", "metadata-list", "more-processes", "bool-processes",
         "rank-file-past-processes"],
)
def test_an_index_oddity_is_a_corrupt_checkpoint(tmp_path: Path, change: Any,
                                                 match: str) -> None:
    path = Path(_save(tmp_path, ".h5"))
    _rewrite_index(path, change)
    for read in (cv.load, cv.list_variables, cv.open):
        with pytest.raises(CorruptCheckpointError, match=r"index of .*ckpt-1\.h5.*" + match):
            read(path)
