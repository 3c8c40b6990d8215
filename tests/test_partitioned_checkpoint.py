"""Checkpoints of partitioned variables and shards in one process (API.md §11).

A checkpoint stores the logical variable (one key, the full shape); a restore maps it
onto whatever the restoring side holds: another partition count, an unpartitioned
variable, the reverse, a shard; TensorFlow's partitioned checkpoints too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.checkpoint._logical import BoxRead, apply_targets, logical_of, read_boxes

pytestmark = pytest.mark.usefixtures("fresh_graph")

TF1 = Path(__file__).resolve().parent.parent / "fixtures" / "tf1_saver" / "model.ckpt.index"
FULL = np.arange(30, dtype=np.float32).reshape(10, 3)


def _never(shape: Any, dtype: Any = None) -> np.ndarray:
    raise AssertionError("the initializer ran")


def _zeros(shape: Any, dtype: Any = None) -> np.ndarray:
    return np.zeros(shape, dtype)


def _partitioned(n: int | None, shape: tuple[int, ...] = (10, 3), init: Any = _zeros,
                 axis: int = 0, dtype: str = "float32") -> Any:
    partitioner = cv.fixed_size_partitioner(n, axis=axis) if n else None
    with cv.variable_scope("emb"):
        return cv.get_variable("table", shape=shape, dtype=dtype, initializer=init,
                               partitioner=partitioner)


def _saved_by_saver(tmp_path: Path, n: int = 4) -> str:
    with cv.Graph().as_default():
        table = _partitioned(n)
        table.assign(FULL)
        return cv.Saver().save(str(tmp_path / "model"))


def _stored_keys(path: str) -> dict[str, tuple[int, ...]]:
    return {k: tuple(s) for k, s, _ in cv.list_variables(path)}


# --- saving: one logical variable ----------------------------------------------------------------


def test_saver_stores_one_logical_variable_with_the_full_shape(tmp_path: Path) -> None:
    table = _partitioned(4)
    table.assign(FULL)
    path = cv.Saver().save(str(tmp_path / "model"))
    assert _stored_keys(path) == {"emb/table": (10, 3)}
    np.testing.assert_array_equal(cv.load(path)["emb/table"], FULL)
    with h5py.File(path, "r") as f:  # plain h5py sees no parts either
        names: list[str] = []
        f.visit(names.append)
        assert not any("part_" in name for name in names)


def test_saver_var_list_with_a_partitioned_variable_or_its_parts(tmp_path: Path) -> None:
    table = _partitioned(3)
    table.assign(FULL)
    for var_list in ([table], list(table), {"emb/table": table}):
        path = cv.Saver(var_list=var_list).save(str(tmp_path / "m"))
        assert _stored_keys(path) == {"emb/table": (10, 3)}
        np.testing.assert_array_equal(cv.load(path)["emb/table"], FULL)


def test_saver_refuses_a_logical_variable_it_holds_only_part_of(tmp_path: Path) -> None:
    table = _partitioned(4)
    with pytest.raises(cv.CkptError, match=r"'emb/table'.*cover 24 of 30"):
        cv.Saver(var_list=list(table)[:3]).save(str(tmp_path / "m"))
    assert not list(tmp_path.iterdir())


def test_checkpoint_stores_a_partitioned_variable_as_one_logical_variable(
    tmp_path: Path,
) -> None:
    table = _partitioned(4)
    table.assign(FULL)
    path = cv.Checkpoint(table=table).save(str(tmp_path / "ckpt"))
    assert _stored_keys(path)["table"] == (10, 3)
    assert not any("part" in k for k in _stored_keys(path))
    np.testing.assert_array_equal(cv.load(path)["table"], FULL)


def test_background_save_snapshots_the_logical_value(tmp_path: Path) -> None:
    table = _partitioned(4)
    table.assign(FULL)
    ckpt = cv.Checkpoint(table=table)
    handle = ckpt.save(str(tmp_path / "ckpt"), blocking=False)
    table.assign(np.zeros((10, 3), np.float32))
    np.testing.assert_array_equal(cv.load(handle.wait())["table"], FULL)


def test_module_tracks_a_partitioned_variable_and_saves_it_as_one(tmp_path: Path) -> None:
    class Embed(cv.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = _partitioned(4)

    model = Embed()
    assert [v.name for v in model.variables] == [f"emb/table/part_{i}" for i in range(4)]
    model.table.assign(FULL)
    path = cv.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    assert _stored_keys(path)["model/table"] == (10, 3)
    cv.reset_default_graph()
    other = Embed()
    cv.Checkpoint(model=other).restore(path).assert_consumed()
    np.testing.assert_array_equal(np.asarray(other.table), FULL)


# --- restoring onto other layouts ----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 10])
def test_saver_restores_into_another_partition_count(tmp_path: Path, n: int) -> None:
    path = _saved_by_saver(tmp_path)
    table = _partitioned(n)
    cv.Saver().restore(path)
    np.testing.assert_array_equal(np.asarray(table), FULL)


def test_saver_restores_a_partitioned_save_into_an_unpartitioned_variable(
    tmp_path: Path,
) -> None:
    path = _saved_by_saver(tmp_path)
    plain = _partitioned(None)
    cv.Saver().restore(path)
    np.testing.assert_array_equal(plain.numpy(), FULL)


def test_saver_restores_an_unpartitioned_save_into_partitions(tmp_path: Path) -> None:
    with cv.Graph().as_default():
        plain = _partitioned(None)
        plain.assign(FULL)
        path = cv.Saver().save(str(tmp_path / "model"))
    table = _partitioned(3)
    cv.Saver().restore(path)
    np.testing.assert_array_equal(np.asarray(table), FULL)
    assert [p.numpy().shape for p in table] == [(4, 3), (3, 3), (3, 3)]


def test_checkpoint_restores_across_layouts(tmp_path: Path) -> None:
    four = _partitioned(4)
    four.assign(FULL)
    path = cv.Checkpoint(table=four).save(str(tmp_path / "ckpt"))
    cv.reset_default_graph()
    three = _partitioned(3)
    cv.Checkpoint(table=three).restore(path).assert_consumed()
    np.testing.assert_array_equal(np.asarray(three), FULL)
    plain = cv.Variable(np.zeros((10, 3), np.float32))
    cv.Checkpoint(table=plain).restore(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), FULL)
    # and the reverse: an unpartitioned value into partitions
    plain.assign(FULL * 2)
    back = cv.Checkpoint(table=plain).save(str(tmp_path / "plain"))
    cv.Checkpoint(table=three).restore(back).assert_consumed()
    np.testing.assert_array_equal(np.asarray(three), FULL * 2)


def test_each_part_reads_only_its_own_box(tmp_path: Path) -> None:
    path = _saved_by_saver(tmp_path)
    table = _partitioned(3, init=_never)
    asked: list[BoxRead] = []

    def recording(reader: Any, requests: list[BoxRead], *, verify: bool) -> None:
        asked.extend(requests)
        read_boxes(reader, requests, verify=verify)

    with cv.open(path) as reader:
        apply_targets(reader, [("emb/table", logical_of(table))], {}, box_reader=recording)
    assert [(r.offset, r.shape) for r in asked] == [((0, 0), (4, 3)), ((4, 0), (3, 3)),
                                                    ((7, 0), (3, 3))]
    np.testing.assert_array_equal(np.asarray(table), FULL)


def test_large_restore_reads_boxes_into_the_parts_own_buffers(tmp_path: Path) -> None:
    path = _saved_by_saver(tmp_path)
    table = _partitioned(2)
    cv.global_variables_initializer()
    buffers = [p._host_buffer() for p in table]
    with cv.open(path) as reader:
        apply_targets(reader, [("emb/table", logical_of(table))], {}, budget=0)
    assert all(p._host_buffer() is b for p, b in zip(table, buffers, strict=True))
    np.testing.assert_array_equal(np.asarray(table), FULL)


def test_full_shape_mismatch_names_the_key_and_changes_nothing(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "m.h5", {"emb/table": FULL, "other": np.ones(2, np.float32)})
    plain = cv.Variable(np.zeros(2, np.float32), name="other")
    table = _partitioned(3, shape=(11, 3))
    cv.global_variables_initializer()
    with pytest.raises(cv.CheckpointMismatchError, match=r"'emb/table'.*\(11, 3\).*\(10, 3\)"):
        cv.Saver().restore(path)
    with pytest.raises(cv.CheckpointMismatchError, match="'emb/table'"):
        cv.Checkpoint(emb={"table": table}, other=plain).restore(path)
    assert not np.asarray(table).any()
    assert not plain.numpy().any()  # matched, but nothing is half-restored


def test_a_shard_restores_its_box_from_a_stored_logical_value(tmp_path: Path) -> None:
    path = _saved_by_saver(tmp_path)
    shard = cv.Variable(np.zeros((4, 3), np.float32), name="emb/table",
                        shard=cv.Shard(full_shape=(10, 3), offset=(5, 0)))
    cv.Saver(var_list=[shard]).restore(path)
    np.testing.assert_array_equal(shard.numpy(), FULL[5:9])
    ckpt_path = cv.save(tmp_path / "c.h5", {"w": FULL})
    other = cv.Variable(np.zeros((3, 2), np.float32), name="w",
                        shard=cv.Shard(full_shape=(10, 3), offset=(2, 1)))
    cv.Checkpoint(w=other).restore(ckpt_path)
    np.testing.assert_array_equal(other.numpy(), FULL[2:5, 1:3])


def test_one_process_cannot_save_a_shard_alone(tmp_path: Path) -> None:
    shard = cv.Variable(np.zeros((4, 3), np.float32), name="w",
                        shard=cv.Shard(full_shape=(10, 3), offset=(0, 0)))
    with pytest.raises(cv.CkptError, match="'w'.*multi-process"):
        cv.Checkpoint(w=shard).save(str(tmp_path / "ckpt"))


def test_restore_with_cast_into_partitions(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "half.h5", {"emb/table": FULL.astype(np.float16)})
    table = _partitioned(3)
    with pytest.raises(cv.CheckpointMismatchError, match="emb/table"):
        cv.Saver().restore(path)
    with pytest.warns(UserWarning, match="emb/table"):
        cv.Saver().restore(path, cast=True)
    np.testing.assert_array_equal(np.asarray(table), FULL)


# --- restore as initialization -------------------------------------------------------------------


def test_restore_on_create_gives_partitions_their_boxes_without_initializing(
    tmp_path: Path,
) -> None:
    path = _saved_by_saver(tmp_path, n=4)
    with cv.restore_on_create(path) as status:
        table = _partitioned(3, init=_never)
        np.testing.assert_array_equal(np.asarray(table), FULL)
    status.assert_consumed()
    cv.reset_default_graph()
    with cv.restore_on_create(path):
        plain = _partitioned(None, init=_never)
    np.testing.assert_array_equal(plain.numpy(), FULL)


def test_restore_on_create_parts_not_read_inside_the_block_are_read_at_its_end(
    tmp_path: Path,
) -> None:
    path = _saved_by_saver(tmp_path)
    with cv.restore_on_create(path):
        table = _partitioned(2, init=_never)
    Path(path).unlink()  # the values were taken when the block ended
    np.testing.assert_array_equal(np.asarray(table), FULL)


def test_restore_on_create_with_a_concrete_initial_value(tmp_path: Path) -> None:
    path = _saved_by_saver(tmp_path)
    with cv.restore_on_create(path) as status, cv.variable_scope("emb"):
        table = cv.get_variable("table", initializer=np.zeros((10, 3), np.float32),
                                partitioner=cv.fixed_size_partitioner(2))
    status.assert_consumed()
    np.testing.assert_array_equal(np.asarray(table), FULL)


def test_restore_on_create_refuses_a_full_shape_mismatch(tmp_path: Path) -> None:
    path = _saved_by_saver(tmp_path)
    with (pytest.raises(cv.CheckpointMismatchError, match=r"'emb/table'.*\(12, 3\)"),
          cv.restore_on_create(path)):
        _partitioned(3, shape=(12, 3), init=_never)


def test_deferred_restore_of_a_partitioned_attribute(tmp_path: Path) -> None:
    table = _partitioned(4)
    table.assign(FULL)
    model = cv.Module()
    model.table = table
    path = cv.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    cv.reset_default_graph()
    later = cv.Module()
    status = cv.Checkpoint(model=later).restore(path)
    later.table = _partitioned(3, init=_never)  # restored as it is attached
    np.testing.assert_array_equal(np.asarray(later.table), FULL)
    status.assert_consumed()


# --- TensorFlow checkpoints with partitioned variables -------------------------------------------


def test_tensorflow_partitioned_checkpoint_restores_into_ckptvar_partitions() -> None:
    with cv.open(TF1) as reader:
        embedding = reader["embedding"].read()  # 3 slices along axis 0
        wide = reader["wide"].read()  # 2 slices along axis 1
    emb = cv.get_variable("embedding", shape=(10, 3), initializer=_never,
                          partitioner=cv.fixed_size_partitioner(4))
    wid = cv.get_variable("wide", shape=(2, 7), dtype="float64", initializer=_never,
                          partitioner=cv.fixed_size_partitioner(3, axis=1))
    plain = cv.Variable(np.zeros((10, 3), np.float32), name="plain_embedding")
    cv.Saver(var_list={"embedding": emb, "wide": wid}).restore(TF1)
    cv.Saver(var_list={"embedding": plain}).restore(TF1)
    np.testing.assert_array_equal(np.asarray(emb), embedding)
    np.testing.assert_array_equal(np.asarray(wid), wide)
    np.testing.assert_array_equal(plain.numpy(), embedding)
    assert [tuple(p.shape) for p in wid] == [(2, 3), (2, 2), (2, 2)]


def test_tensorflow_partitioned_checkpoint_loads_and_lists_the_logical_value() -> None:
    # the TF reader pastes the slices (storage); the public functions show one value
    listed = cv.list_variables(TF1)
    assert [k for k, _, _ in listed].count("embedding") == 1
    assert {k: s for k, s, _ in listed}["wide"] == (2, 7)
    assert not any("part" in k for k, _, _ in listed)
    loaded = cv.load(TF1)
    assert loaded["embedding"].shape == (10, 3) and loaded["wide"].shape == (2, 7)
    with cv.open(TF1) as reader:
        np.testing.assert_array_equal(loaded["wide"], reader["wide"].read())


def test_tensorflow_partitioned_checkpoint_restores_on_create() -> None:
    with cv.open(TF1) as reader:
        embedding = reader["embedding"].read()
    with cv.restore_on_create(TF1):
        emb = cv.get_variable("embedding", shape=(10, 3), initializer=_never,
                              partitioner=cv.fixed_size_partitioner(2))
    np.testing.assert_array_equal(np.asarray(emb), embedding)


def test_saver_restores_parts_stored_under_their_own_names(tmp_path: Path) -> None:
    parts = {f"emb/table/part_{i}": FULL[r] for i, r in enumerate(
        [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)])}
    path = cv.save(tmp_path / "old.h5", parts)
    table = _partitioned(4)
    cv.Saver().restore(path)
    np.testing.assert_array_equal(np.asarray(table), FULL)


def test_restore_on_create_casts_a_box_with_a_warning(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "half.h5", {"emb/table": FULL.astype(np.float16)})
    with cv.restore_on_create(path, cast=True):
        table = _partitioned(3, init=_never)
        with pytest.warns(UserWarning, match=r"'emb/table' \(float16 -> float32\)"):
            value = np.asarray(table)
    np.testing.assert_array_equal(value, FULL)


def test_zarr_checkpoint_of_a_partitioned_variable_restores_into_other_parts(
    tmp_path: Path,
) -> None:
    table = _partitioned(4)
    table.assign(FULL)
    path = cv.Saver().save(str(tmp_path / "model"), format="zarr")
    assert _stored_keys(path) == {"emb/table": (10, 3)}
    cv.reset_default_graph()
    three = _partitioned(3)
    cv.global_variables_initializer()
    with cv.open(path) as reader:  # in place, through the lazy Zarr reader
        apply_targets(reader, [("emb/table", logical_of(three))], {}, budget=0)
    np.testing.assert_array_equal(np.asarray(three), FULL)


def test_a_partitioned_variable_at_two_paths_is_stored_once(tmp_path: Path) -> None:
    table = _partitioned(2)
    table.assign(FULL)
    path = cv.Checkpoint(a=table, b=[table]).save(str(tmp_path / "ckpt"))
    assert [k for k in _stored_keys(path) if k != "save_counter"] == ["a"]
    cv.reset_default_graph()
    other = _partitioned(3)
    cv.Checkpoint(b=[other]).restore(path).expect_partial()
    np.testing.assert_array_equal(np.asarray(other), FULL)


def test_restore_on_create_gives_a_shard_its_box(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "w.h5", {"w": FULL})
    with cv.restore_on_create(path) as status:
        shard = cv.Variable(_never, shape=(3, 3), dtype="float32", name="w",
                            shard=cv.Shard(full_shape=(10, 3), offset=(6, 0)))
    status.assert_consumed()
    np.testing.assert_array_equal(shard.numpy(), FULL[6:9])


@pytest.mark.parametrize("budget", [None, 0])  # into temporaries / into the parts' buffers
def test_damaged_logical_value_changes_no_part(tmp_path: Path, budget: int | None) -> None:
    value = np.arange(3000, dtype=np.float32).reshape(1000, 3) + 0.5
    path = cv.save(tmp_path / "m.h5", {"emb/table": value})
    data = Path(path).read_bytes()
    at = data.find(value[700].tobytes())  # a row the last part needs
    assert at > 0
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(bytes([data[at] ^ 0x40]))
    table = _partitioned(3, shape=(1000, 3))
    cv.global_variables_initializer()
    with cv.open(path) as reader, pytest.raises(cv.CorruptCheckpointError):
        apply_targets(reader, [("emb/table", logical_of(table))], {}, budget=budget)
    assert not np.asarray(table).any()


def test_restore_on_create_refuses_a_part_that_cannot_fit_when_it_is_made(
    tmp_path: Path,
) -> None:
    path = _saved_by_saver(tmp_path)
    with (pytest.raises(cv.CheckpointMismatchError, match=r"'emb/table/part_0'.*\(4, 5\)"),
          cv.restore_on_create(path)):
        _partitioned(3, shape=(10, 5), init=_never)
