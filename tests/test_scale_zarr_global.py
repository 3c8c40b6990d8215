"""Multi-process ``.zarr`` checkpoints: a regular grid of boxes is one plain Zarr v3 array.

Saves run under real ``mpiexec`` (tests/mpi/zarr_global_cases.py) on 2 and 4
processes; plain zarr-python reads the global arrays (on every rank, and here);
restores on 3 processes and in one process read them back; damage to a chunk is
found and named; the per-process layout of index version 1 still reads.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zarr
from test_cli import ckpt_many
from test_distributed_mpi import _mpi_skip_reason, run_mpi

import ckptvar as cv
from ckptvar.distributed import Box
from ckptvar.errors import CorruptCheckpointError
from ckptvar.storage import INDEX_FILE, backend_for, box_key, pack_index, rank_file
from ckptvar.storage._sharded_zarr import grid_chunk

CASES = str(Path(__file__).parent / "mpi" / "zarr_global_cases.py")
mpi = pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")

SHAPES = {
    "rows": ((37, 512), "float32"),
    "blocks": ((91, 203), "int32"),
    "gap": ((6, 2048), "float64"),
    "irregular": ((37, 256), "int64"),
    "nested/deep/v": ((40, 2001), "uint8"),
    "small": ((4, 6), "float32"),
}
GLOBAL = ["blocks", "gap", "nested/deep/v", "rep", "rows"]


def full(key: str) -> np.ndarray:
    """The logical values tests/mpi/zarr_global_cases.py saves."""
    if key == "rep":
        return np.arange(10_000, dtype="float64") / 4
    shape, dtype = SHAPES[key]
    return (np.arange(math.prod(shape)) * 7 + 3).astype(dtype).reshape(shape)


def _run(n: int, *args: str) -> dict[str, dict[int, dict]]:
    proc, got, _ = run_mpi(n, CASES, *args, timeout=90)
    assert got.get("crash") is None, got["crash"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return got


@pytest.fixture(scope="module")
def saved() -> Iterator[tuple[Path, dict[int, dict[int, dict]]]]:
    if _mpi_skip_reason() is not None:
        pytest.skip(_mpi_skip_reason() or "")
    with tempfile.TemporaryDirectory(prefix="ckptvar-zarrglobal-") as d:
        reports = {n: _run(n, "save", d)["save"] for n in (2, 4)}
        yield Path(d), reports


def _index(path: Path) -> dict:
    return msgpack.unpackb((path / INDEX_FILE).read_bytes(), raw=False, strict_map_key=False)


@mpi
@pytest.mark.parametrize("n", [2, 4])
def test_plain_zarr_reads_each_regular_grid_as_one_array(saved: tuple[Path, dict], n: int) -> None:
    d, reports = saved
    path = d / f"n{n}" / "ckpt-1.zarr"
    # every rank, right after the save, read the global arrays with zarr-python alone
    assert sorted(reports[n]) == list(range(n))
    for r in reports[n].values():
        assert r["plain"] == {"rows": True, "blocks": True, "gap": True, "irregular": None,
                              "nested/deep/v": True, "rep": True, "small": None}, r
    group = zarr.open_group(path, mode="r")
    rows = group["rows"]
    assert rows.shape == (37, 512)
    assert rows.chunks == ((19, 512) if n == 2 else (10, 512))  # uneven last edge: 18 / 7 rows
    assert np.array_equal(rows[...], full("rows"))
    assert np.array_equal(group["rows"][30:37, 2:5], full("rows")[30:37, 2:5])
    assert np.array_equal(group["blocks"][...], full("blocks"))
    assert group["blocks"].chunks == ((46, 203) if n == 2 else (46, 102))  # edges: 45, 101
    assert np.array_equal(group["nested/deep/v"][...], full("nested/deep/v"))
    assert np.array_equal(group["gap"][...], full("gap"))
    assert np.array_equal(group["rep"][...], full("rep"))
    # not a grid, or under 64 KiB: the boxes stay in the per-process files
    assert "irregular" not in group and "small" not in group and "save_counter" not in group
    # one chunk file per box, none for the zero-size box, no checksum files left over
    assert sorted(p.name for p in (path / "rows").iterdir()) == sorted(
        ["zarr.json"] + [f"c.{i}.0" for i in range(n)])
    assert len([p for p in (path / "gap").iterdir() if p.name.startswith("c.")]) == max(n - 1, 1)
    assert not list(path.glob("sums-*"))


@mpi
@pytest.mark.parametrize("n", [2, 4])
def test_the_index_names_each_chunk_its_writer_and_checksum(
    saved: tuple[Path, dict], n: int
) -> None:
    index = _index(saved[0] / f"n{n}" / "ckpt-1.zarr")
    assert index["version"] == 2
    rows = index["variables"]["rows"]
    c = -(-37 // n)
    assert rows["grid"] == {"path": "rows", "chunk_shape": [c, 512]}
    # box j is rank j's rows, written by rank j into rows/c.j.0
    assert [b[2:] for b in rows["boxes"]] == [[j, f"rows/c.{j}.0"] for j in range(n)]
    for key in GLOBAL:
        var = index["variables"][key]
        assert "grid" in var, key
        assert len(index["checksums"][key]) == len(var["boxes"])
    for key in ("irregular", "small", "save_counter"):
        assert "grid" not in index["variables"][key]
    assert all(b[3].startswith("irregular/.box/") for b in index["variables"]["irregular"]["boxes"])


@mpi
def test_restore_on_three_processes_and_in_one(saved: tuple[Path, dict]) -> None:
    d, _ = saved
    got = _run(3, "restore", str(d), "2", "4")
    for n in (2, 4):
        assert sorted(got[f"restore{n}"]) == [0, 1, 2]
        assert all(r["ok"] for r in got[f"restore{n}"].values()), got[f"restore{n}"]
        values = cv.load(d / f"n{n}" / "ckpt-1.zarr")
        for key in [*SHAPES, "rep"]:
            assert np.array_equal(values[key], full(key)), (n, key)
        with cv.open(d / f"n{n}" / "ckpt-1.zarr") as reader:
            assert reader.format == f"zarr ({n} processes)"
            # a box across chunk edges reads only its parts (rows 8..31 cross every chunk)
            assert np.array_equal(reader["rows"][8:31, 1:4], full("rows")[8:31, 1:4])
            assert np.array_equal(reader["blocks"][4:6, 3], full("blocks")[4:6, 3])
            assert reader.verify_all() == []


@mpi
def test_ckpt_verify_inspect_and_convert(saved: tuple[Path, dict], tmp_path: Path) -> None:
    src = saved[0] / "n4" / "ckpt-1.zarr"
    bad = tmp_path / "bad.zarr"
    shutil.copytree(src, bad)
    chunk = bad / "rows" / "c.2.0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x40
    chunk.write_bytes(bytes(data))
    verify, inspect, convert, broken = ckpt_many(
        ("verify", src), ("inspect", src), ("convert", src, tmp_path / "one.h5"),
        ("verify", bad),
    )
    assert verify.returncode == 0, verify.stderr
    assert inspect.returncode == 0 and "zarr (4 processes)" in inspect.stdout
    assert "rows" in inspect.stdout and "(37, 512)" in inspect.stdout
    assert convert.returncode == 0, convert.stderr
    one = cv.load(tmp_path / "one.h5")
    for key in [*SHAPES, "rep"]:
        assert np.array_equal(one[key], full(key)), key
    assert broken.returncode == 1
    assert "DAMAGED  rows" in broken.stdout and "c.2.0" in broken.stdout, broken.stdout


@mpi
@pytest.mark.parametrize("damage", ["flip", "missing", "truncated", "swapped"])
def test_damaged_chunks_name_variable_and_file(
    saved: tuple[Path, dict], tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "ckpt-1.zarr"
    shutil.copytree(saved[0] / "n4" / "ckpt-1.zarr", path)
    chunk = path / "rows" / "c.1.0"
    if damage == "flip":
        data = bytearray(chunk.read_bytes())
        data[-1] ^= 0x01
        chunk.write_bytes(bytes(data))
    elif damage == "missing":
        chunk.unlink()
    elif damage == "truncated":
        chunk.write_bytes(chunk.read_bytes()[:-4])
    else:  # two intact chunks of the same size trade places
        other = path / "rows" / "c.0.0"
        a, b = chunk.read_bytes(), other.read_bytes()
        chunk.write_bytes(b)
        other.write_bytes(a)
    first = r"c\.[01]\.0" if damage == "swapped" else r"c\.1\.0"  # c.0.0 is read first
    with pytest.raises(CorruptCheckpointError, match=rf"'rows'.*rows/{first}"):
        cv.load(path)
    with cv.open(path) as reader:
        # the rest reads, each part verified; the damaged part does not
        assert np.array_equal(reader["rows"][20:30], full("rows")[20:30])
        assert np.array_equal(reader["blocks"][...], full("blocks"))
        with pytest.raises(CorruptCheckpointError, match=r"'rows'.*c\.1\.0"):
            reader["rows"][12:14]
        assert [k for k, _ in reader.verify_all()] == ["rows"]
        if damage == "swapped":
            with pytest.raises(CorruptCheckpointError, match=r"'rows'.*c\.0\.0"):
                reader["rows"][0:2]


def _sharded_zarr_save(path: str, variables: dict[str, cv.Variable]) -> str:
    coord = cv.distributed.SingleProcessCoordinator()
    return cv.Checkpoint(**variables).save(path, coordinator=coord)


def test_one_process_save_is_a_global_array_and_reads_parts(tmp_path: Path) -> None:
    big = np.arange(512 * 1024, dtype="float32").reshape(512, 1024)  # 2 MiB
    w = cv.Variable(big, name="w", shard=cv.Shard(full_shape=big.shape, offset=(0, 0)))
    empty = cv.Variable(np.zeros((0, 3), "int16"), name="empty")
    small = cv.Variable(np.arange(3.0), name="small")
    path = Path(_sharded_zarr_save(str(tmp_path / "ckpt.zarr"),
                                   {"w": w, "empty": empty, "small": small}))
    group = zarr.open_group(path, mode="r")
    assert np.array_equal(group["w"][...], big)
    assert "empty" not in group and "small" not in group  # packed in rank-00000.zarr
    assert cv.load(path)["small"].tolist() == [0.0, 1.0, 2.0]
    assert (path / "w" / "c.0.0").stat().st_size == big.nbytes
    with cv.open(path) as reader:
        row = reader["w"][100:101, :]  # a run of one row of a 2 MiB chunk
        assert np.array_equal(row, big[100:101])
        assert reader.bytes_read == 1024 * 4
        assert np.array_equal(reader["w"][3:5, 7:9], big[3:5, 7:9])
        assert reader.bytes_read < 4 * 1024 * 4
        assert reader["empty"].read().shape == (0, 3)
        whole = reader["w"].read()
        assert np.array_equal(whole, big)


def test_keys_that_would_meet_the_step_s_own_files_are_kept_apart(tmp_path: Path) -> None:
    value = np.arange(20_000, dtype="float32")  # 80 KiB each: global arrays if they can be
    names = ["rank-00000.zarr", "sums-00000.msgpack", "ckptvar-index.msgpack", "zarr.json"]
    shard = cv.Shard(full_shape=value.shape, offset=(0,))  # the multi-process layout
    variables: dict[str, object] = {n: cv.Variable(value + i, name=f"v{i}", shard=shard)
                                    for i, n in enumerate(names)}
    nested = cv.Variable(value - 1, name="nested", shard=shard)
    variables["rank-00000.zarr"] = cv.Checkpoint(x=nested, y=variables["rank-00000.zarr"])
    coord = cv.distributed.SingleProcessCoordinator()
    path = Path(cv.Checkpoint(**variables).save(str(tmp_path / "ckpt.zarr"), coordinator=coord))
    got = cv.load(path)
    assert np.array_equal(got["rank-00000.zarr/x"], value - 1)
    assert np.array_equal(got["rank-00000.zarr/y"], value)
    for i, key in enumerate(names[1:], start=1):
        assert np.array_equal(got[key], value + i), key
    index = _index(path)
    assert "grid" not in index["variables"]["rank-00000.zarr/x"]  # its group: rank 0's file
    for key in names[1:]:
        assert index["variables"][key]["grid"]["path"] != key  # renamed (%t1 / escaped)
    assert (path / "rank-00000.zarr" / "zarr.json").is_file()


def test_an_hdf5_step_keeps_index_version_1(tmp_path: Path) -> None:
    w = cv.Variable(np.arange(6.0), name="w", shard=cv.Shard(full_shape=(6,), offset=(0,)))
    path = Path(_sharded_zarr_save(str(tmp_path / "ckpt.h5"), {"w": w}))
    index = _index(path)
    assert index["version"] == 1 and "checksums" not in index
    assert index["variables"]["w"]["boxes"][0][3] == box_key("w", 0)


def _old_layout(path: Path) -> dict[str, np.ndarray]:
    """A checkpoint in the per-process layout of index version 1 (every box in a
    per-process ckptvar Zarr checkpoint), built with the writer that made it."""
    value = np.arange(40, dtype="float32").reshape(10, 4)
    rep = np.array([1.5, 2.5])
    boxes = {0: [("w", Box((0, 0), (5, 4)))], 1: [("w", Box((5, 0), (5, 4))), ("r", Box.full((2,)))]}
    path.mkdir()
    (path / "zarr.json").write_bytes(
        b'{"zarr_format": 3, "node_type": "group", "attributes": '
        b'{"ckptvar_sharded": {"index": "ckptvar-index.msgpack"}}}')
    entries: dict[str, dict] = {
        "w": {"shape": [10, 4], "dtype": "<f4", "attrs": {"name": "w"}, "boxes": []},
        "r": {"shape": [2], "dtype": "<f8", "attrs": {"name": "r"}, "boxes": []},
    }
    for rank, items in boxes.items():
        f = path / rank_file(rank, ".zarr")
        writer = backend_for(f).open_writer(f, durable=False)
        for key, box in items:
            j = len(entries[key]["boxes"])
            writer.add(box_key(key, j), value[box.slices()] if key == "w" else rep, {})
            entries[key]["boxes"].append([list(box.offset), list(box.shape), rank,
                                          box_key(key, j)])
        writer.set_metadata({"sharded": {"rank": rank}})
        writer.commit()
    packed = msgpack.packb(entries, use_bin_type=True)
    files = [rank_file(r, ".zarr") for r in range(2)]
    (path / INDEX_FILE).write_bytes(pack_index("zarr", 2, files, packed, {"step": 3}))
    return {"w": value, "r": rep}


def test_the_per_process_layout_of_index_version_1_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "old-3.zarr"
    want = _old_layout(path)
    assert _index(path)["version"] == 1
    got = cv.load(path)
    assert sorted(got) == ["r", "w"]
    assert np.array_equal(got["w"], want["w"]) and np.array_equal(got["r"], want["r"])
    with cv.open(path) as reader:
        assert reader.metadata() == {"step": 3}
        assert np.array_equal(reader["w"][3:7, 1:3], want["w"][3:7, 1:3])
        assert reader.verify_all() == []
    v = cv.Variable(np.zeros((4, 4), "float32"), name="w",
                    shard=cv.Shard(full_shape=(10, 4), offset=(3, 0)))
    r = cv.Variable(np.zeros(2), name="r")
    cv.Checkpoint(w=v, r=r).restore(path, coordinator=cv.distributed.SingleProcessCoordinator())
    assert np.array_equal(v.numpy(), want["w"][3:7]) and np.array_equal(r.numpy(), want["r"])


def test_an_index_with_a_bad_grid_is_refused(tmp_path: Path) -> None:
    w = cv.Variable(np.arange(1e4), name="w", shard=cv.Shard(full_shape=(10_000,), offset=(0,)))
    path = Path(_sharded_zarr_save(str(tmp_path / "ckpt.zarr"), {"w": w}))
    index = _index(path)
    for change, words in [
        (lambda ix: ix["variables"]["w"]["grid"].update(path="../../etc"), "'w'"),
        (lambda ix: ix["variables"]["w"]["grid"].update(chunk_shape=[4]), "'w'"),
        (lambda ix: ix["checksums"].update(w=[]), "'w'"),
    ]:
        bad = msgpack.unpackb(msgpack.packb(index), raw=False, strict_map_key=False)
        change(bad)
        (path / INDEX_FILE).write_bytes(msgpack.packb(bad, use_bin_type=True))
        with pytest.raises(CorruptCheckpointError, match=words):
            cv.load(path)


@pytest.mark.parametrize(
    ("full_shape", "boxes", "chunk"),
    [
        ((10, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4)), ((8, 0), (2, 4))], (4, 4)),
        ((10, 4), [((8, 0), (2, 4)), ((0, 0), (4, 4)), ((4, 0), (4, 4))], (4, 4)),  # any order
        ((5, 5), [((0, 0), (3, 3)), ((0, 3), (3, 2)), ((3, 0), (2, 3)), ((3, 3), (2, 2))], (3, 3)),
        ((), [((), ())], ()),  # a scalar is one chunk
        ((7,), [((0,), (7,))], (7,)),
        ((10, 4), [((0, 0), (4, 4)), ((4, 0), (6, 4))], None),  # the edge box is larger
        ((10,), [((0,), (4,)), ((4,), (3,)), ((7,), (3,))], None),  # an inner box is smaller
        ((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], None),  # two shapes
        ((10,), [], None),
    ],
)
def test_grid_detection(full_shape: tuple, boxes: list, chunk: tuple | None) -> None:
    assert grid_chunk(full_shape, [Box(o, s) for o, s in boxes]) == chunk


def test_zarr_python_lists_a_step_and_says_only_that_the_index_is_no_zarr_node(
        tmp_path: Path) -> None:
    """docs/FORMAT.md "Global Zarr arrays": zarr-python lists the global arrays and the
    per-process groups, and its only complaint is the index file (documented)."""
    import warnings

    coord = cv.distributed.SingleProcessCoordinator()
    w = cv.Variable(np.arange(128 * 128, dtype="float32").reshape(128, 128), name="w",
                    shard=cv.Shard(full_shape=(128, 128), offset=(0, 0)))
    b = cv.Variable(np.ones(2, "int64"), name="b")
    step = cv.Checkpoint(w=w, b=b).save(tmp_path / "ckpt.zarr", coordinator=coord)
    group = zarr.open_group(step, mode="r")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sorted(group.keys()) == ["rank-00000.zarr", "w"]
    assert {str(c.message) for c in caught} == {
        f"Object at {INDEX_FILE} is not recognized as a component of a Zarr hierarchy."}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.array_equal(group["w"][...], w.numpy())  # indexing lists nothing
        warnings.filterwarnings("ignore", f"Object at {INDEX_FILE}")  # as documented
        assert len(dict(group.members())) == 2
