"""Row deltas (format 1.5, docs/FORMAT.md "Row deltas"): a ``cv.Variable`` knows which rows
its writes touched, and an incremental step stores a table with a few changed rows as its
base plus a patch of those rows; every reader path reads it bit-exact, pruning keeps what
it refers to, damage is named, and a reader that does not know deltas refuses them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
import os
from pathlib import Path
from typing import Any

import h5py
import msgpack
import numpy as np
import pytest
from ckpt_runs import ckpt_processes

import ckptvar as cv
from ckptvar.checkpoint import _apply
from ckptvar.checkpoint._incremental import Incremental
from ckptvar.errors import CorruptCheckpointError
from ckptvar.storage._container import blocks as blocks_mod
from ckptvar.storage._container import delta as delta_mod
from ckptvar.storage._container.delta import DELTA_LIMIT, MAX_PATCHES
from ckptvar.storage._record import decode, encode
from ckptvar.variables import rows_written, track_rows, write_version

ROWS, WIDTH = 8192, 64  # a 2 MiB float32 table (deltas start at 1 MiB)
ROW_BYTES = WIDTH * 4


def _rows(v: cv.Variable, since: tuple[int, int] | None) -> list[int] | None:
    got = rows_written(v, since)
    return None if got is None else got.tolist()


def test_each_write_path_says_which_rows_it_wrote(fresh_graph: cv.Graph) -> None:
    v = cv.Variable(np.zeros((10, 3), np.float32), name="t")
    track_rows(v)
    start = write_version(v)
    v.scatter_update([7, 1], np.ones((2, 3)))
    assert _rows(v, start) == [1, 7]
    v[2:4].assign(5.0)  # a slice assign
    v[5].assign(np.full(3, 2.0))  # v[i].assign
    v[np.array([9, -10])] = 1.0  # an index assign (negative: row 0)
    v[np.arange(10) == 6] = 3.0  # a boolean mask
    v.scatter_add([8, 8], np.ones((2, 3)))  # repeats add up, as np.add.at
    v.scatter_sub(np.array([3]), 1.0)
    assert _rows(v, start) == [0, 1, 2, 3, 5, 6, 7, 8, 9]  # row 4 untouched
    assert v.numpy()[8].tolist() == [2.0, 2.0, 2.0]
    mid = write_version(v)
    assert _rows(v, mid) == []
    v[4, 1:].assign(7.0)
    assert _rows(v, mid) == [4]
    for whole in (lambda: v.assign_add(1.0), lambda: v.assign(np.zeros((10, 3))),
                  lambda: v[...].assign(0.0), lambda: np.add(v, 1, out=v)):
        before = write_version(v)
        whole()
        assert _rows(v, before) is None  # the whole value: every row
    before = write_version(v)
    v.value()  # the buffer handed out: writes through it cannot be seen
    assert _rows(v, before) is None and write_version(v) is None
    with pytest.raises(IndexError, match="outside"):
        v.scatter_update([10], np.ones((1, 3)))
    other = cv.Variable(np.zeros((4, 2)), name="o", constraint=lambda x: x)
    track_rows(other)
    before = write_version(other)
    other.scatter_update([1], np.ones((1, 2)))
    assert _rows(other, before) is None  # a constraint may change any row
    assert _rows(v, (0, 0)) is None  # another variable's version
    many = cv.Variable(np.zeros((1000, 2)), name="many")
    track_rows(many)
    before = write_version(many)
    for i in range(60):  # more writes than the log keeps apart: merged, none lost
        many.scatter_add([i, 500 + i], np.ones((2, 2)))
    assert _rows(many, before) == sorted([*range(60), *range(500, 560)])



@pytest.mark.parametrize("through", ["checkpoint", "saver"])
def test_a_restore_into_a_tracked_variable_marks_every_row(
        tmp_path: Path, through: str, fresh_graph: cv.Graph) -> None:
    # A restore writes the whole value through the host buffers it is handed, in bulk for
    # many small variables: the row log must hear of it, or the next incremental step
    # would store the restored table as a patch of its scattered rows.
    vs = [cv.Variable(np.full((4, 2), i, np.float32), name=f"v{i}") for i in range(3)]
    path = tmp_path / "ck.h5"
    if through == "checkpoint":
        ckpt = cv.Checkpoint(**{f"v{i}": v for i, v in enumerate(vs)})
        ckpt.write(str(path))
    else:
        saver = cv.Saver(var_list=vs)
        saver.save(str(path))
    for v in vs:
        track_rows(v)
    before = [write_version(v) for v in vs]
    for v in vs:
        v.scatter_update([1], np.full((1, 2), 9.0))
    if through == "checkpoint":
        ckpt.restore(str(path))
    else:
        saver.restore(str(path))
    assert [_rows(v, b) for v, b in zip(vs, before, strict=True)] == [None] * 3
    assert [v.numpy()[1, 0] for v in vs] == [0.0, 1.0, 2.0]

def _model() -> tuple[cv.Checkpoint, cv.Variable]:
    table = cv.Variable(np.random.default_rng(0).random((ROWS, WIDTH), dtype=np.float32),
                        name="table")
    return cv.Checkpoint(table=table, bias=cv.Variable(np.zeros(4, np.float32), name="b")), table


def _touch(table: cv.Variable, rng: np.random.Generator, n: int) -> None:
    ids = np.unique(rng.integers(0, ROWS, n))
    table.scatter_update(ids, table.numpy()[ids] + 1.0)


def _added(step: Path) -> int:
    """Bytes a step holds of its own (hard-linked files are shared)."""
    if step.is_file():
        return step.stat().st_size
    return sum(p.stat().st_size for p in step.rglob("*") if p.is_file() and p.stat().st_nlink == 1)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_delta_step_reads_bit_exact_through_every_reader_path(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str) -> None:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, max_to_keep=2,
                                   incremental=True)
    manager.save()
    rng = np.random.default_rng(1)
    for _ in range(3):
        _touch(table, rng, 80)
        step = Path(manager.save())
        assert _added(step) < 80 * (ROW_BYTES + 8) + (48 << 10)  # the rows, not the table
    want = table.numpy()
    with cv.open(step) as reader:
        assert reader.deltas()["table"] == {"base": f"ckpt-1.{fmt}", "patches": 3,
                                            "rows": reader.deltas()["table"]["rows"]}
        assert np.array_equal(reader["table"].read(), want)
        for lo, hi in ((0, 1), (17, 3000), (ROWS - 5, ROWS)):  # lazy slices
            assert np.array_equal(reader["table"][lo:hi], want[lo:hi])
        assert np.array_equal(reader["table"][5, 3:9], want[5, 3:9])
    assert np.array_equal(cv.load(step)["table"], want)
    table.assign(np.zeros((ROWS, WIDTH), np.float32))
    ckpt.restore(str(step))
    assert np.array_equal(table.numpy(), want)
    copy = tmp_path / f"copy.{fmt}"
    inspect, verify, convert = ckpt_processes(("inspect", "--json", step), ("verify", step),
                                              ("convert", step, copy))
    assert json.loads(inspect.stdout)["deltas"]["table"]["base"] == f"ckpt-1.{fmt}"
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert convert.returncode == 0, convert.stderr
    with cv.open(copy) as reader:  # a standalone copy: the value whole
        assert reader.deltas() == {}
        assert np.array_equal(reader["table"].read(), want)


def test_plain_h5py_sees_the_base_by_link_and_the_patches(tmp_path: Path,
                                                         fresh_graph: cv.Graph) -> None:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", incremental=True)
    manager.save()
    rng = np.random.default_rng(2)
    for _ in range(2):
        _touch(table, rng, 50)
        step = manager.save()
    with h5py.File(step, "r") as f:
        group = f["table"]
        assert isinstance(group, h5py.Group) and "row delta" in group.attrs["ckptvar_delta"]
        assert f.get("table/base", getlink=True).filename == "ckpt-1.h5"
        value = group["base"][()]
        for j in range(2):
            raw = group[f"patch-{j}"][()]
            n = raw.size // (8 + ROW_BYTES)
            value[raw[: 8 * n].view("<u8")] = raw[8 * n:].view(np.float32).reshape(n, WIDTH)
    assert np.array_equal(value, table.numpy())


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_pruning_keeps_what_a_delta_refers_to(tmp_path: Path, fresh_graph: cv.Graph,
                                              fmt: str) -> None:
    ckpt, table = _model()
    run = tmp_path / "run"
    manager = cv.CheckpointManager(ckpt, run, format=fmt, max_to_keep=1, incremental=True)
    manager.save()
    rng = np.random.default_rng(3)
    for _ in range(3):
        _touch(table, rng, 60)
        manager.save()
    listed = sorted(n for n in os.listdir(run) if n.startswith("ckpt-"))
    if fmt == "h5":  # the base and each patch's file are held for the newest step
        assert listed == ["ckpt-1.h5", "ckpt-2.h5", "ckpt-3.h5", "ckpt-4.h5"]
    else:  # a Zarr step takes its base and patches by hard link: it stands alone
        assert listed == ["ckpt-4.zarr"]
    assert np.array_equal(cv.load(run / f"ckpt-4.{fmt}")["table"], table.numpy())
    table.assign_add(1.0)  # the whole table: written whole, the patches' files are let go
    ckpt.bias.assign_add(1.0)
    manager.save()
    manager.save()  # unchanged: HDF5 refers to step 5 (external links), Zarr links it
    left = sorted(n for n in os.listdir(run) if n.startswith("ckpt-"))
    assert left == (["ckpt-5.h5", "ckpt-6.h5"] if fmt == "h5" else ["ckpt-6.zarr"])
    assert np.array_equal(cv.load(run / f"ckpt-6.{fmt}")["table"], table.numpy())


def test_a_delta_of_a_delta_adds_a_patch_until_the_limit_then_writes_whole(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", incremental=True, max_to_keep=20)
    manager.save()
    per = int(ROWS * DELTA_LIMIT / 3) + 1  # the third patch crosses the limit
    steps = []
    for k in range(4):
        table.scatter_update(np.arange(k * per, (k + 1) * per) % ROWS, np.float32(k))
        steps.append(manager.save())
    with cv.open(steps[1]) as r:
        d = r.record.deltas["table"]
        assert len(d.patches) == 2 and d.base[0] == "ckpt-1.h5"
        assert [p[0] for p in d.patches] == ["ckpt-2.h5", ""]  # each patch where it was written
    with cv.open(steps[2]) as r:
        assert "table" not in r.record.deltas  # over the limit: written whole
        assert os.path.getsize(steps[2]) > ROWS * ROW_BYTES
    with cv.open(steps[3]) as r:  # the next one refers to that whole copy
        assert r.record.deltas["table"].base[0] == "ckpt-4.h5"
        assert len(r.record.deltas["table"].patches) == 1
    assert np.array_equal(cv.load(steps[3])["table"], table.numpy())


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_damaged_patch_is_named(tmp_path: Path, fresh_graph: cv.Graph, fmt: str) -> None:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, incremental=True)
    manager.save()
    _touch(table, np.random.default_rng(4), 40)
    step = Path(manager.save())
    with cv.open(step) as r:
        _, path, offset, _, _ = r.record.deltas["table"].patches[-1]
    target = step / path / "c.0" if fmt == "zarr" else step
    at = 0 if fmt == "zarr" else offset
    with open(target, "r+b") as f:  # a row index byte
        f.seek(at + 3)
        byte = f.read(1)
        f.seek(at + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match=r"'table'.*row patch.*checksum") as err:
        cv.load(step)
    assert (path in str(err.value)) and (step.name in str(err.value))
    res = ckpt_processes(("verify", step))[0]
    assert res.returncode != 0 and "row patch" in res.stdout + res.stderr


def test_a_reader_that_does_not_know_deltas_refuses_them(tmp_path: Path,
                                                        fresh_graph: cv.Graph) -> None:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format="zarr", incremental=True)
    manager.save()
    _touch(table, np.random.default_rng(5), 30)
    step = Path(manager.save())
    doc = msgpack.unpackb((step / "_ckptvar/record/c.0").read_bytes())
    assert doc["format_version"] == [1, 6]  # 1.5's deltas, verified by their parts
    i = doc["keys"].index("table")
    # A 1.4 reader accepts the layouts packed, array and zarr only: "delta" is refused.
    assert doc["layouts"][i] == "delta" and doc["layouts"][i] not in {"packed", "array", "zarr"}
    # Without its 'deltas' field (a reader that skips it) the record is refused too.
    del doc["deltas"]
    with pytest.raises(CorruptCheckpointError, match="delta"):
        decode(msgpack.packb(doc), step, container="zarr")


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_an_unchanged_delta_is_carried_over(tmp_path: Path, fresh_graph: cv.Graph,
                                           fmt: str) -> None:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, max_to_keep=2,
                                   incremental=True)
    manager.save()
    _touch(table, np.random.default_rng(6), 70)
    manager.save()
    step = Path(manager.save())  # nothing changed (known by the version)
    assert _added(step) < 64 << 10
    with cv.open(step) as r:
        assert len(r.record.deltas["table"].patches) == 1
        assert np.array_equal(r["table"].read(), table.numpy())
    # Its version now unknown: a delta verified by its parts has no checksum of the
    # whole value to compare with, so the table is written whole once, hashed; from
    # then on it is compared by those checksums, and an unchanged one is shared.
    table.value()
    whole = Path(manager.save())
    assert _added(whole) >= ROWS * ROW_BYTES
    later = Path(manager.save())
    assert _added(later) < 64 << 10
    for s in (whole, later):
        with cv.open(s) as r:
            assert "table" not in r.record.deltas
            assert np.array_equal(r["table"].read(), table.numpy())
    # A restart that restores (a new checkpoint over new variables) knows the table as
    # the restored step holds it: a delta is carried over, not written whole (one that
    # does not restore writes it whole once: tests/cloud/test_cloud_row_deltas.py).
    for i in range(2):
        again, fresh = _model()
        restarted = cv.CheckpointManager(again, tmp_path / "run", format=fmt,
                                          max_to_keep=2, incremental=True)
        assert restarted.restore_or_initialize() == manager.latest_checkpoint
        if i == 0:  # the table is tracked from the restore: a delta on the restored step
            _touch(fresh, np.random.default_rng(7), 70)
        step = Path(restarted.save())
        assert _added(step) < 64 << 10
        with cv.open(step) as r:
            assert len(r.record.deltas["table"].patches) == 1  # step 1's carried over
            assert np.array_equal(r["table"].read(), fresh.numpy())


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_write_of_no_row_leaves_a_variable_unchanged(tmp_path: Path, fresh_graph: cv.Graph,
                                                       fmt: str) -> None:
    """A ``scatter_update`` with no index (a process none of whose rows were drawn) bumps
    the version but writes no row: the value is known unchanged, shared or carried over."""
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, max_to_keep=3,
                                   incremental=True)
    manager.save()
    nothing = (np.empty(0, np.int64), np.empty((0, WIDTH), np.float32))
    table.scatter_update(*nothing)
    shared = Path(manager.save())
    assert _added(shared) < 64 << 10  # the table's bytes are the first step's
    _touch(table, np.random.default_rng(6), 70)
    manager.save()
    table.scatter_update(*nothing)
    carried = Path(manager.save())
    assert _added(carried) < 64 << 10
    with cv.open(carried) as r:
        assert len(r.record.deltas["table"].patches) == 1  # no patch of its own
        assert np.array_equal(r["table"].read(), table.numpy())


def test_a_scatter_of_an_empty_list_of_rows_writes_no_row(tmp_path: Path,
                                                          fresh_graph: cv.Graph) -> None:
    """The rows a process owns, gathered as a Python list (``[r for r in batch if
    mine(r)]``), may be none: ``scatter_*([], ...)`` writes no row (it raised TypeError
    'indices must be integers, got float64', NumPy's dtype of an empty list), and the
    table stays known unchanged."""
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=3, incremental=True)
    manager.save()
    before = table.numpy()
    for scatter in (table.scatter_update, table.scatter_add, table.scatter_sub):
        scatter([], np.empty((0, WIDTH), np.float32))
        scatter([[]], np.empty((1, 0, WIDTH), np.float32))
    assert np.array_equal(table.numpy(), before)
    with pytest.raises(TypeError, match="indices must be integers"):
        table.scatter_update([0.5], np.zeros((1, WIDTH), np.float32))
    shared = Path(manager.save())
    assert _added(shared) < 64 << 10  # the table's bytes are the first step's

@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_partitioned_variable_is_a_row_delta_of_its_parts_rows(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str) -> None:
    """A TF1 partitioned variable is saved as one value: the rows its parts' writes
    touched, each shifted by its part's offset, are the value's changed rows."""
    with cv.variable_scope("emb", partitioner=cv.fixed_size_partitioner(4)):
        table = cv.get_variable("table", shape=(ROWS, WIDTH))
    parts = list(table)
    for i, p in enumerate(parts):
        p.assign(np.full(p.shape, i, np.float32))
    ckpt = cv.Checkpoint(table=table)
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, incremental=True)
    manager.save()
    parts[0].scatter_update([1, 2], np.full((2, WIDTH), 7.0, np.float32))
    parts[3].scatter_update([5], np.full((1, WIDTH), 9.0, np.float32))
    step = Path(manager.save())
    want = np.asarray(table).copy()
    with cv.open(step) as r:
        assert r.deltas() == {"table": {"base": f"ckpt-1.{fmt}", "patches": 1, "rows": 3}}
        assert r.delta_rows("table").tolist() == [1, 2, 3 * ROWS // 4 + 5]
    assert np.array_equal(cv.load(step)["table"], want)
    for p in parts:
        p.assign(np.zeros(p.shape, np.float32))
    ckpt.restore(str(step))
    assert np.array_equal(np.asarray(table), want)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_too_many_patches_merge_into_one(tmp_path: Path, fresh_graph: cv.Graph,
                                         fmt: str) -> None:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, max_to_keep=2,
                                   incremental=True)
    manager.save()
    for k in range(MAX_PATCHES + 1):  # the same hot rows, and one new row, each step
        table.scatter_update([1, 2, 3, 100 + k], np.full((4, WIDTH), k, np.float32))
        step = Path(manager.save())
        with cv.open(step) as r:
            d = r.record.deltas["table"]
            if k < MAX_PATCHES:
                assert len(d.patches) == k + 1
    # the 17th would be one too many: one patch of every row changed since the base
    assert len(d.patches) == 1 and d.patches[0][3] == 3 + MAX_PATCHES + 1
    assert d.since == f"ckpt-1.{fmt}"
    assert _added(step) < (MAX_PATCHES + 4) * (ROW_BYTES + 8) + (48 << 10)
    assert np.array_equal(cv.load(step)["table"], table.numpy())


def test_a_patched_source_reads_any_range_as_the_assembled_value(tmp_path: Path) -> None:
    from ckptvar.storage._container.source import Patched

    rng = np.random.default_rng(7)
    for row_bytes, nrows in ((4, 50), (12, 31), (256, 20)):
        base = rng.integers(0, 256, row_bytes * nrows, dtype=np.uint8)
        (tmp_path / "base").write_bytes(b"xyz" + base.tobytes())
        rows = np.unique(rng.integers(0, nrows, nrows // 3))
        data = rng.integers(0, 256, (rows.size, row_bytes), dtype=np.uint8)
        want = base.reshape(nrows, row_bytes).copy()
        want[rows] = data
        fd = os.open(tmp_path / "base", os.O_RDONLY)
        src = Patched(fd, 3, base.size, row_bytes,
                      (rows, data.reshape(-1).view(np.dtype((np.void, row_bytes)))))
        flat = want.reshape(-1)
        for _ in range(200):  # ranges inside a row, across rows, at both ends
            lo = int(rng.integers(0, base.size))
            n = int(rng.integers(0, base.size - lo + 2))
            buf = bytearray(n)
            got = src.pread_into(buf, lo)
            assert got == min(n, base.size - lo)
            assert bytes(buf[:got]) == flat[lo: lo + got].tobytes()
        assert bytes(src.read_all()) == flat.tobytes()
        src.close()


def test_a_save_asks_for_the_rows_after_its_snapshot(tmp_path: Path,
                                                     fresh_graph: cv.Graph) -> None:
    ckpt, table = _model()
    inc = Incremental()
    inc.start(None, {"table": table}).committed(tmp_path / "ckpt-1.h5")
    table.scatter_update([5], np.full((1, WIDTH), 1.0, np.float32))
    save = inc.start(tmp_path / "ckpt-1.h5", {"table": table})
    table.scatter_update([9], np.full((1, WIDTH), 2.0, np.float32))  # after start()
    assert save.changed_rows()["table"].tolist() == [5, 9]  # asked once the values are read
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", incremental=True, async_save=True)
    manager.save()
    table.scatter_update([11, 12], np.full((2, WIDTH), 3.0, np.float32))
    manager.save()  # in the background, from a snapshot
    manager.wait_until_finished()
    with cv.open(manager.latest_checkpoint) as reader:
        assert reader.deltas()["table"]["rows"] == 2
        assert np.array_equal(reader["table"].read(), table.numpy())


def _damage(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("budget", [None, 0], ids=["staged", "two-pass"])
@pytest.mark.parametrize("part", ["base", "patch"])
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_damage_in_the_base_or_a_patch_stops_every_read_before_anything_changes(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str, part: str, *, budget: int | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore reads into temporaries (small values) or verifies every value, then
    reads into the variables (``budget`` 0: how values above 64 MiB are restored)."""
    if budget is not None:
        monkeypatch.setattr(_apply, "TEMPORARY_BUDGET", budget)
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, incremental=True)
    manager.save()
    rng = np.random.default_rng(7)
    for _ in range(2):
        _touch(table, rng, 40)
        step = Path(manager.save())
    original = np.random.default_rng(0).random((ROWS, WIDTH), dtype=np.float32)
    with cv.open(step) as r:
        d = r.record.deltas["table"]
    if part == "base":  # a byte of a row no patch holds: only the base's bytes give it
        row = int(np.flatnonzero((table.numpy() == original).all(axis=1))[1])
        if fmt == "h5":
            where, at = step.parent / d.base[0], d.base[2] + row * ROW_BYTES + 5
        else:
            chunks = [p for p in (step / d.base[1]).rglob("*")
                      if p.is_file() and p.name != "zarr.json"]
            assert len(chunks) == 1
            where, at = chunks[0], row * ROW_BYTES + 5
    else:  # a byte of the first patch's rows (not its row indices): its CRC says it
        f, path, offset, n, _ = d.patches[0]
        if fmt == "h5":
            where, at = step.parent / (f or step.name), offset + 8 * n + 3
        else:
            where, at = step / path / "c.0", 8 * n + 3
        row = 0  # any slice opens the value, which reads and checks every patch
    _damage(where, at)
    sentinel = np.full((ROWS, WIDTH), -1.0, np.float32)
    table.assign(sentinel)
    if part == "patch":  # the patch, in the file that holds it
        f, path = d.patches[0][:2]
        named = f"'{path}' in '{f or step.name}'" if fmt == "h5" else f"'{path}/c.0'"
        said = rf"'table' has a row patch {named} that fails its checksum"
    else:  # the patches passed: the base, in the file that holds it
        holder = d.base[0] or step.name
        said = (rf"'table' fails .*checksum.*row delta: its 2 row patches passed their "
                rf"checksums, so the damage is in its base, '{d.base[1]}' in '{holder}'")
    with pytest.raises(CorruptCheckpointError, match=said) as err:
        ckpt.restore(str(step))
    assert step.name in str(err.value)
    assert np.array_equal(table.numpy(), sentinel)  # all or nothing: nothing changed
    assert np.array_equal(ckpt.bias.numpy(), np.zeros(4, np.float32))
    with pytest.raises(CorruptCheckpointError, match=said):
        cv.load(step)
    with cv.open(step) as r, pytest.raises(CorruptCheckpointError, match=said):
        r["table"][row: row + 2]  # a slice: the block checksums of the rows read


def _base_file(step: Path, fmt: str, d: object, row: int) -> tuple[Path, int]:
    """The file holding the base's bytes of ``row`` (one chunk in Zarr) and their offset."""
    base = d.base  # type: ignore[attr-defined]
    if fmt == "h5":
        return step.parent / base[0], base[2] + row * ROW_BYTES
    chunks = [p for p in (step / base[1]).rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert len(chunks) == 1
    return chunks[0], row * ROW_BYTES


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_delta_carries_its_bases_checksums(tmp_path: Path, fresh_graph: cv.Graph,
                                            fmt: str) -> None:
    """Each delta step's record carries the base step's checksum and block checksums of
    the value (through appended, carried-over and merged deltas), and they round-trip."""
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, max_to_keep=30,
                                   incremental=True)
    first = Path(manager.save())
    with cv.open(first) as r:
        want = r.record.values["table"]
    rng = np.random.default_rng(11)
    steps, values = [], []
    for k in range(MAX_PATCHES + 2):  # appends, then a merge past the limit
        if k != 3:  # step 4: nothing changed, the delta carried over
            _touch(table, rng, 20)
            table.scatter_update([5], np.full((1, WIDTH), k, np.float32))  # in every patch
        steps.append(Path(manager.save()))
        values.append(table.numpy().copy())
    for k in (2, 9, MAX_PATCHES - 1):  # the later patch's row wins
        assert np.array_equal(cv.load(steps[k])["table"], values[k])
        table.assign(np.zeros((ROWS, WIDTH), np.float32))
        ckpt.restore(str(steps[k]))
        assert np.array_equal(table.numpy(), values[k])
    for step in steps:
        with cv.open(step) as r:
            d = r.record.deltas["table"]
            assert d.since == first.name
            assert (d.base_checksum, d.base_blocks) == (want.checksum, want.blocks)
            assert d.base_blocks is not None and len(d.base_blocks) > 4
            got = r.record.values["table"]  # verified by its parts: no assembled checksum
            assert d.by_parts and (got.checksum, got.blocks) == (want.checksum, None)
            again = decode(encode(r.record), step, container=fmt).deltas["table"]
            assert again == d
    assert len(d.patches) == 1  # the last one merged
    assert np.array_equal(cv.load(steps[-1])["table"], values[-1])


def _watch_hashed_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of each CRC-32C call from here on, by any path (the writer's value and
    block hashes, patches, records)."""
    import crc32c

    seen: list[int] = []
    real = crc32c.crc32c

    def counting(data: Any, *args: Any, **kw: Any) -> int:
        seen.append(memoryview(data).nbytes)
        return real(data, *args, **kw)

    monkeypatch.setattr(crc32c, "crc32c", counting)
    monkeypatch.setattr(blocks_mod, "_crc", counting)
    return seen


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_delta_step_hashes_its_patch_not_the_table(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta step hashes the rows it writes and nothing of the table (format 1.6: a
    delta is verified by its parts, so the assembled value's checksums are never
    computed): appending patches, carrying a delta over, merging past the limit (a
    union of rows in every block). The record says so, and every step reads bit-exact."""
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, max_to_keep=2,
                                   incremental=True)
    manager.save()
    per_block = (64 << 10) // ROW_BYTES
    blocks = ROWS // per_block
    hashed = _watch_hashed_bytes(monkeypatch)
    for k in range(MAX_PATCHES + 2):  # two blocks a step: the union covers all of them
        if k != 3:  # step 4: nothing changed, the delta carried over
            ids = [(2 * k % blocks) * per_block + k, ((2 * k + 1) % blocks) * per_block + k]
            table.scatter_update(ids, np.full((2, WIDTH), k, np.float32))
        hashed.clear()
        step = Path(manager.save())
        with cv.open(step) as r:
            d = r.record.deltas["table"]
        patch = d.patches[-1][3] * (8 + ROW_BYTES)
        assert d.by_parts and max(hashed) <= max(patch, 4 << 10), (k, sorted(hashed)[-3:])
        # the patch (a merge also checks the patches it reads), the record, small values
        assert sum(hashed) < 2 * patch + (16 << 10), (k, patch, sum(hashed))
        assert np.array_equal(cv.load(step)["table"], table.numpy())
    assert len(d.patches) == 1 and d.patches[0][3] == 2 * (MAX_PATCHES + 1)  # merged


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_restore_checks_the_base_by_its_own_checksum(tmp_path: Path, fresh_graph: cv.Graph,
                                                      fmt: str) -> None:
    """Damage in a base row that a patch replaces leaves the assembled value intact: only
    the base's own checksum catches it, and every verified read refuses the step."""
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, incremental=True)
    manager.save()
    _touch(table, np.random.default_rng(3), 40)
    step = Path(manager.save())
    with cv.open(step) as r:
        d = r.record.deltas["table"]
        row = int(r.delta_rows("table")[0])
    where, at = _base_file(step, fmt, d, row)
    _damage(where, at + 7)
    sentinel = np.full((ROWS, WIDTH), -1.0, np.float32)
    table.assign(sentinel)
    said = (rf"'table' fails its base's checksum .*row delta: its 1 row patch passed its "
            rf"checksum, so the damage is in its base, '{d.base[1]}' in '{d.base[0] or step.name}'")
    for budget in (None, 0):  # staged (one pass) and two-pass (verify, then read in place)
        with pytest.MonkeyPatch.context() as mp:
            if budget is not None:
                mp.setattr(_apply, "TEMPORARY_BUDGET", budget)
            with pytest.raises(CorruptCheckpointError, match=said):
                ckpt.restore(str(step))
        assert np.array_equal(table.numpy(), sentinel)
    with pytest.raises(CorruptCheckpointError, match=said):
        cv.load(step)
    with cv.open(step) as r:
        assert [k for k, _ in r.verify_all()] == ["table"]
    res = ckpt_processes(("verify", step))[0]
    assert res.returncode != 0 and "base's checksum" in res.stdout + res.stderr


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_delta_without_its_bases_checksums_is_checked_assembled(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str,
        older_delta_writer: Callable[..., None]) -> None:
    """A 1.5 record from before the base's checksums (written here as that writer did)
    still reads bit-exact, and damage in its base is caught by the assembled value."""
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, incremental=True)
    manager.save()
    rng = np.random.default_rng(4)
    for k in range(2):
        if k == 1:  # the last step of two patches, as that writer wrote it
            older_delta_writer()
        _touch(table, rng, 40)
        step = Path(manager.save())
    if fmt == "h5":
        doc = msgpack.unpackb(h5py.File(step)["_ckptvar/manifest"][()].tobytes())
    else:
        doc = msgpack.unpackb((step / "_ckptvar/record/c.0").read_bytes())
    assert doc["format_version"] == [1, 5]
    assert set(doc["deltas"]["table"]) == {"base", "patches", "since"}
    want = table.numpy()
    assert np.array_equal(cv.load(step)["table"], want)
    table.assign(np.zeros((ROWS, WIDTH), np.float32))
    ckpt.restore(str(step))
    assert np.array_equal(table.numpy(), want)
    with cv.open(step) as r:
        d = r.record.deltas["table"]
        held = set(r.delta_rows("table").tolist())
    row = next(i for i in range(ROWS) if i not in held)
    where, at = _base_file(step, fmt, d, row)
    _damage(where, at + 5)
    with pytest.raises(CorruptCheckpointError, match=r"'table' fails its checksum .*its base"):
        ckpt.restore(str(step))
    assert np.array_equal(table.numpy(), want)


def test_a_deltas_base_checksums_are_checked_in_the_record() -> None:
    from ckptvar.storage._record import BadRecord, check_deltas

    good = {"base": ["", "t/base", 0], "patches": [["", "t/patch-0", 0, 1, 7]],
            "since": "ckpt-1.zarr"}
    got = check_deltas({"t": {**good, "base_checksum": 5, "base_blocks": bytes(8)}}, "zarr")
    assert (got["t"].base_checksum, got["t"].base_blocks) == (5, bytes(8))
    assert got["t"].to_doc() == {**good, "base_checksum": 5, "base_blocks": bytes(8)}
    old = check_deltas({"t": good}, "zarr")["t"]  # a record from before them
    assert (old.base_checksum, old.base_blocks) == (None, None) and old.to_doc() == good
    for bad in ({"base_checksum": -1}, {"base_checksum": 1 << 32}, {"base_checksum": "5"},
                {"base_blocks": bytes(8)}, {"base_checksum": 5, "base_blocks": bytes(3)},
                {"base_checksum": 5, "base_blocks": [0, 0, 0, 0]}, {"other": 1}):
        with pytest.raises(BadRecord):
            check_deltas({"t": {**good, **bad}}, "zarr")


def test_a_forged_base_checksum_is_refused(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """The record's base checksums are what a restore trusts: a wrong one, or block
    checksums that do not join to it, refuse the step (the assembled value is intact)."""
    from ckptvar.storage import checksum

    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format="zarr", incremental=True)
    manager.save()
    _touch(table, np.random.default_rng(9), 30)
    step = Path(manager.save())
    record, root = step / "_ckptvar/record/c.0", step / "zarr.json"
    doc = msgpack.unpackb(record.read_bytes())

    def forged(**fields: object) -> None:
        entry = {k: v for k, v in {**doc["deltas"]["table"], **fields}.items() if v is not None}
        data = msgpack.packb({**doc, "deltas": {"table": entry}})
        record.write_bytes(data)
        meta = json.loads(root.read_text())
        meta["attributes"]["ckptvar"].update(record_nbytes=len(data),
                                             record_crc32c=checksum.crc(data))
        root.write_text(json.dumps(meta))

    blocks = doc["deltas"]["table"]["base_blocks"]
    for fields, said in (({"base_checksum": doc["deltas"]["table"]["base_checksum"] ^ 1,
                           "base_blocks": None}, "fails its base's checksum"),
                         ({"base_blocks": blocks[4:] + blocks[:4]},
                          "has base block checksums that do not join")):
        forged(**fields)
        with pytest.raises(CorruptCheckpointError, match=rf"'table' {said}"):
            ckpt.restore(str(step))
    forged()  # as written: it reads again
    assert np.array_equal(cv.load(step)["table"], table.numpy())


@pytest.mark.parametrize("budget", [None, 0], ids=["staged", "two-pass"])
def test_a_restore_opens_a_deltas_files_once(tmp_path: Path, fresh_graph: cv.Graph,
                                             monkeypatch: pytest.MonkeyPatch,
                                             request: pytest.FixtureRequest, *,
                                             budget: int | None) -> None:
    """A Zarr delta's base chunk files and its patches are opened once per restore: the
    probes of where the bytes are, the verify pass and the read pass share them."""
    from ckptvar.storage import _zarr

    if budget is not None:
        monkeypatch.setattr(_apply, "TEMPORARY_BUDGET", budget)
    rows = 3 * (_zarr.PIECE_BYTES // ROW_BYTES) + 100  # a base of four chunks (format 1.4)
    table = cv.Variable(np.random.default_rng(0).random((rows, WIDTH), dtype=np.float32),
                        name="table")
    ckpt = cv.Checkpoint(table=table)
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format="zarr", incremental=True)
    manager.save()
    rng = np.random.default_rng(5)
    for _ in range(3):
        ids = np.unique(rng.integers(0, rows, 200))
        table.scatter_update(ids, table.numpy()[ids] + 1.0)
        step = Path(manager.save())
    want = table.numpy()
    with cv.open(step) as r:
        d = r.record.deltas["table"]
        assert r.record.pieces["table"] and len(d.patches) == 3
        files = [step / rel for rel in r.chunk_files("table")]
    assert len(files) == 4 + 3  # the base's chunks, then the patches
    ours = {f.stat().st_ino: f.name for f in files}
    opened = request.getfixturevalue("zarr_opens")  # from here on
    table.assign(np.zeros((rows, WIDTH), np.float32))
    ckpt.restore(str(step))
    assert np.array_equal(table.numpy(), want)
    assert {ours[i]: opened.get(i, 0) for i in ours} == {name: 1 for name in ours.values()}


def test_an_io_thread_waiting_for_patches_runs_those_not_started() -> None:
    """Every I/O thread waiting for a delta's patches, whose reads are queued behind
    them: the waiters read them themselves (no deadlock)."""
    import threading
    from concurrent.futures import wait

    from ckptvar.storage import rawio
    from ckptvar.storage._container.delta import Patches

    if rawio.IO_THREADS == 1:
        pytest.skip("one I/O thread (CKPTVAR_IO_THREADS=1): reads run where they are asked")
    made = threading.Event()
    box: list[Patches] = []

    def waiter() -> int:
        made.wait(30)
        return len(box[0].result())

    waiters = rawio.start_all([waiter] * rawio.IO_THREADS, background=True)  # every thread
    patch = (np.arange(2), np.zeros(2, "V4"))
    box.append(Patches([lambda: [patch]] * 3))  # its reads queued behind the waiters
    made.set()
    done, _ = wait(waiters, timeout=30)
    assert len(done) == len(waiters)
    assert [f.result() for f in waiters] == [3] * rawio.IO_THREADS


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_delta_values_read_in_small_pieces_by_many_threads_leave_nothing_open(
        tmp_path: Path, fresh_graph: cv.Graph, monkeypatch: pytest.MonkeyPatch,
        fmt: str) -> None:
    """Several delta values, each read in many pieces on the I/O threads at once (each
    piece may be the first to open its value): bit-exact, and once the restores are
    over no descriptor of theirs is left open."""
    from ckptvar.storage._container import transfer

    monkeypatch.setattr(_apply, "TEMPORARY_BUDGET", 0)  # verify, then read in place
    monkeypatch.setattr(transfer, "_SPLIT", 64 << 10)
    monkeypatch.setattr(transfer, "_TASK", 64 << 10)
    tables = {f"t{i}": cv.Variable(np.random.default_rng(i).random((ROWS, WIDTH),
                                                                   dtype=np.float32))
              for i in range(4)}
    ckpt = cv.Checkpoint(**tables)
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, incremental=True)
    manager.save()
    rng = np.random.default_rng(6)
    for _ in range(3):
        for t in tables.values():
            ids = np.unique(rng.integers(0, ROWS, 50))
            t.scatter_update(ids, t.numpy()[ids] + 1.0)
        step = Path(manager.save())
    with cv.open(step) as r:
        assert sorted(r.deltas()) == sorted(tables)
    want = {k: t.numpy() for k, t in tables.items()}
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(3):
        for t in tables.values():
            t.assign(np.zeros((ROWS, WIDTH), np.float32))
        ckpt.restore(str(step))
        assert all(np.array_equal(tables[k].numpy(), want[k]) for k in tables)
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_threads_opening_a_delta_at_once_share_one_read_of_it(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str) -> None:
    """Eight threads open one delta value of a fresh reader at the same moment (as the I/O
    threads do when each reads a piece of it): its patches are read once, for all of
    them, and closing the reader leaves no descriptor open."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, incremental=True)
    manager.save()
    rng = np.random.default_rng(8)
    for _ in range(3):
        _touch(table, rng, 60)
        step = Path(manager.save())
    def open_it(r: Any, start: threading.Barrier) -> Any:
        start.wait(10)
        return r.source("table", r.entry("table"))

    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(5):
        with cv.open(step) as r:
            start = threading.Barrier(8)
            with ThreadPoolExecutor(8) as pool:
                srcs = list(pool.map(open_it, [r] * 8, [start] * 8))
            assert len({id(s.fd.patches) for s in srcs}) == 1
            for s in srcs:
                s.fd.close()
        if fds is not None:
            assert len(os.listdir("/proc/self/fd")) == fds


def test_a_patch_is_streamed_in_pieces_as_it_would_be_built_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A patch larger than a piece is gathered piece by piece, each written while the
    next is gathered: the bytes and CRC of building it whole; a failed write stops it
    with that error, and no write runs after it returns."""
    monkeypatch.setattr(delta_mod, "_PIECE", 1000)  # 3 rows of 256 bytes a piece
    table = np.random.default_rng(3).random((500, WIDTH), dtype=np.float32)
    view = memoryview(table).cast("B")
    rows = np.unique(np.random.default_rng(4).integers(0, 500, 40))
    want, crc = delta_mod.patch_bytes(view, ROW_BYTES, rows, 7)
    out = bytearray(want.size)
    calls: list[tuple[int, int]] = []

    def write(piece: memoryview, at: int) -> None:
        calls.append((at, len(piece)))
        out[at: at + len(piece)] = piece

    got = delta_mod.stream_patch(view, ROW_BYTES, rows, 7, write=write, at=0)
    assert got == crc and bytes(out) == want.tobytes()
    assert len(calls) == 1 + -(-rows.size // 3)  # the indices, then each piece
    running: list[int] = []

    def failing(piece: memoryview, at: int) -> None:
        running.append(1)
        if len(running) == 3:
            raise OSError(28, "No space left on device")
        time.sleep(0.01)
        running.append(-1)

    with pytest.raises(OSError, match="No space"):
        delta_mod.stream_patch(view, ROW_BYTES, rows, 7, write=failing, at=0)
    assert sum(running) == 1  # the failed one; every other write had ended
    with pytest.raises(IndexError, match="rows"):
        delta_mod.stream_patch(view, ROW_BYTES, np.array([3, 500]), 7, write=write, at=0)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_delta_step_with_a_patch_in_many_pieces_reads_bit_exact(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delta_mod, "_PIECE", 8 << 10)  # 32 rows a piece
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, incremental=True)
    manager.save()
    rng = np.random.default_rng(8)
    for _ in range(3):
        _touch(table, rng, 400)
        step = Path(manager.save())
        with cv.open(step) as r:
            assert r.record.deltas["table"].patches[-1][3] > 300
            assert r.verify_all() == []
        assert np.array_equal(cv.load(step)["table"], table.numpy())


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_delta_verified_by_its_parts_has_no_checksum_of_its_whole_value(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str) -> None:
    """``ArrayInfo.checksum`` is the whole value's; a delta verified by its parts has none
    (its record's item is its base's): it said its base's, so a changed value had the
    checksum of the step before it. It is checked by its parts (``piecewise``)."""
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, incremental=True)
    base = manager.save()
    table.scatter_update([3, 4000], np.zeros((2, WIDTH), np.float32))
    step = manager.save()
    with cv.open(base) as r:
        before = r.info("table")
    with cv.open(step) as r:
        assert r.record.deltas["table"].by_parts
        info = r.info("table")
        assert np.array_equal(r["table"].read(), table.numpy())
    assert before.checksum is not None
    assert info.checksum != before.checksum  # another value
    assert info.checksum is None and info.piecewise and info.checked
