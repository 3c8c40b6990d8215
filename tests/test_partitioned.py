"""Partitioned variables in one process (API.md §11) and per-process shards."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import ShapeLockError, VariableScopeError
from ckptvar.variables import LogicalBox, PartitionInfo

pytestmark = pytest.mark.usefixtures("fresh_graph")

F32 = np.dtype("float32")


# --- the partitioners: tf.compat.v1 semantics ----------------------------------------------------


def test_fixed_size_partitioner() -> None:
    assert cv.fixed_size_partitioner(4)(shape=(1000, 64), dtype=F32) == [4, 1]
    assert cv.fixed_size_partitioner(4, axis=1)(shape=(10, 3), dtype=F32) == [1, 3]
    assert cv.fixed_size_partitioner(8)(shape=(5,), dtype=F32) == [5]  # capped by the axis


def test_min_max_variable_partitioner() -> None:
    # TF's own example: float32 (1024, 1024) with 256K slices -> 16 parts unless capped
    p = cv.min_max_variable_partitioner(max_partitions=100, min_slice_size=256 << 10)
    assert p(shape=(1024, 1024), dtype=F32) == [16, 1]
    assert cv.min_max_variable_partitioner(max_partitions=3)(shape=(1024, 1024),
                                                             dtype=F32) == [3, 1]
    assert cv.min_max_variable_partitioner(max_partitions=8)(shape=(4, 4), dtype=F32) == [1, 1]
    with pytest.raises(VariableScopeError, match="axis 2"):
        cv.min_max_variable_partitioner(axis=2)(shape=(4, 4), dtype=F32)


def test_variable_axis_size_partitioner() -> None:
    # rows of 64 float32 = 256 bytes; 1000 bytes per shard -> 3 rows per shard -> 4 shards
    p = cv.variable_axis_size_partitioner(max_shard_bytes=1000)
    assert p(shape=(10, 64), dtype=F32) == [4, 1]
    assert cv.variable_axis_size_partitioner(1000, max_shards=2)(shape=(10, 64),
                                                                  dtype=F32) == [2, 1]
    # one row larger than the limit: every row its own shard
    assert cv.variable_axis_size_partitioner(10)(shape=(5, 64), dtype=F32) == [5, 1]
    with pytest.raises(VariableScopeError, match="positive"):
        cv.variable_axis_size_partitioner(0)
    with pytest.raises(VariableScopeError, match="max_shards"):
        cv.variable_axis_size_partitioner(10, max_shards=0)


# --- get_variable with a partitioner -------------------------------------------------------------


def test_api_example_scope_partitioner() -> None:
    with cv.variable_scope("emb", partitioner=cv.fixed_size_partitioner(4)):
        table = cv.get_variable("table", shape=(1000, 64))
    assert isinstance(table, cv.PartitionedVariable)
    assert len(table) == 4 and table.name == "emb/table" and table.shape == (1000, 64)
    parts = list(table)
    assert all(isinstance(p, cv.Variable) for p in parts)
    assert [p.name for p in parts] == [f"emb/table/part_{i}" for i in range(4)]
    infos = [p.save_slice_info for p in parts]
    assert [i.var_offset for i in infos] == [(0, 0), (250, 0), (500, 0), (750, 0)]
    assert {i.full_name for i in infos} == {"emb/table"}
    assert {i.full_shape for i in infos} == {(1000, 64)}
    assert {i.var_shape for i in infos} == {(250, 64)}
    assert infos[1].spec == "1000 64 250,250:0,64"
    full = np.asarray(table)
    assert full.shape == (1000, 64) and full.dtype == np.float32
    assert np.array_equal(full[250:500], parts[1].numpy())
    # every part is in the collections, as in TF1
    assert [v.name for v in cv.global_variables()] == [p.name for p in parts]


def test_uneven_parts_first_ones_longer_and_initializer_per_part() -> None:
    calls = []

    def init(shape, dtype=None, partition_info=None):  # type: ignore[no-untyped-def]
        calls.append((tuple(shape), partition_info.full_shape, partition_info.var_offset))
        return np.full(shape, partition_info.var_offset[0], dtype)

    pv = cv.get_variable("v", shape=(10, 2), dtype="int32", initializer=init,
                         partitioner=cv.fixed_size_partitioner(4))
    assert [p.shape for p in pv] == [(3, 2), (3, 2), (2, 2), (2, 2)]
    assert np.asarray(pv)[:, 0].tolist() == [0, 0, 0, 3, 3, 3, 6, 6, 8, 8]
    assert calls == [((3, 2), (10, 2), (0, 0)), ((3, 2), (10, 2), (3, 0)),
                     ((2, 2), (10, 2), (6, 0)), ((2, 2), (10, 2), (8, 0))]
    info = PartitionInfo((10, 2), (6, 0))
    assert info.single_offset((2, 2)) == 6 and info.single_slice_dim((2, 2)) == 0


def test_partition_along_a_later_axis_and_from_a_value() -> None:
    value = np.arange(12, dtype=np.float64).reshape(2, 6)
    pv = cv.get_variable("w", initializer=value,
                         partitioner=cv.fixed_size_partitioner(3, axis=1))
    assert pv.dtype == np.float64 and [p.shape for p in pv] == [(2, 2)] * 3
    assert np.array_equal(np.asarray(pv), value)
    assert list(pv)[2].save_slice_info.var_offset == (0, 4)


def test_assign_full_value_and_checks_before_writing() -> None:
    pv = cv.get_variable("t", shape=(5, 3), partitioner=cv.fixed_size_partitioner(2))
    new = np.arange(15, dtype=np.float32).reshape(5, 3)
    assert pv.assign(new) is pv
    assert np.array_equal(np.asarray(pv), new) and list(pv)[1].numpy()[0].tolist() == [9, 10, 11]
    with pytest.raises(ShapeLockError, match="full shape"):
        pv.assign(np.zeros((4, 3)))
    with pytest.raises(cv.CkptError):  # float -> int is not same_kind, nothing written
        cv.get_variable("i", shape=(4,), dtype="int32",
                        partitioner=cv.fixed_size_partitioner(2)).assign(np.ones(4) * 0.5)
    assert np.array_equal(np.asarray(pv), new)


def test_reuse_returns_the_same_partitioned_variable_and_checks() -> None:
    part = cv.fixed_size_partitioner(2)
    with cv.variable_scope("s", partitioner=part):
        pv = cv.get_variable("x", shape=(4, 2))
    with cv.variable_scope("s", reuse=True):
        assert cv.get_variable("x", partitioner=part) is pv
        with pytest.raises(VariableScopeError, match="shape"):
            cv.get_variable("x", shape=(5, 2), partitioner=part)
        with pytest.raises(VariableScopeError, match="partitioner"):
            cv.get_variable("x")  # without a partitioner: the partitioned one is not it
    with cv.variable_scope("s", reuse=cv.AUTO_REUSE, partitioner=part):
        assert cv.get_variable("x", shape=(4, 2)) is pv
    with pytest.raises(VariableScopeError, match="already exists"), \
            cv.variable_scope("s", partitioner=part):
        cv.get_variable("x", shape=(4, 2))
    plain = cv.get_variable("p", shape=(2,))
    with pytest.raises(VariableScopeError, match="unpartitioned"), \
            cv.variable_scope("", reuse=True):
        cv.get_variable("p", partitioner=part)
    assert plain.save_slice_info is None


def test_one_part_is_still_partitioned_and_named_part_0() -> None:
    pv = cv.get_variable("small", shape=(3, 3),
                         partitioner=cv.min_max_variable_partitioner(max_partitions=4))
    assert len(pv) == 1 and list(pv)[0].name == "small/part_0"


@pytest.mark.parametrize(
    ("partitioner", "shape", "match"),
    [
        (lambda shape, dtype: [2, 2], (4, 4), "one dimension"),
        (lambda shape, dtype: [2], (4, 4), "one entry per dimension"),
        (lambda shape, dtype: [0, 1], (4, 4), "zero parts"),
        (lambda shape, dtype: [9, 1], (4, 4), "only 4 rows"),
        (lambda shape, dtype: [2.5, 1], (4, 4), r"returned \[2\.5, 1\], not a list of ints"),
        (lambda shape, dtype: ["2", 1], (4, 4), "not a list of ints"),
        (cv.fixed_size_partitioner(2, axis=1), (4,), r"along axis 1 when shape is only \(4,\)"),
        (cv.fixed_size_partitioner(2), (), "rank at least 1"),
        (cv.fixed_size_partitioner(2), (None, 3), "fully defined"),
    ],
)
def test_bad_partitions_are_clear_errors(partitioner, shape, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(VariableScopeError, match=match):
        cv.get_variable("bad", shape=shape, partitioner=partitioner)
    assert cv.global_variables() == []  # nothing half made


def test_logical_box_of_parts_and_plain_variables() -> None:
    pv = cv.get_variable("e", shape=(6, 2), partitioner=cv.fixed_size_partitioner(3))
    assert list(pv)[1].logical_box == LogicalBox("e", (6, 2), (2, 0), (2, 2), sliced=True)
    plain = cv.Variable(np.zeros((2, 3)), name="plain")
    assert plain.logical_box == LogicalBox("plain", (2, 3), (0, 0), (2, 3), sliced=False)


# --- shards: one process's box of a logical variable ---------------------------------------------


def test_variable_with_a_shard() -> None:
    rank = 2
    rows = np.ones((250, 64), np.float32) * rank
    w = cv.Variable(rows, name="w", shard=cv.Shard(full_shape=(1000, 64), offset=(rank * 250, 0)))
    assert w.shard == cv.Shard((1000, 64), (500, 0), (250, 64))
    assert w.shard.shape == (250, 64) and w.shape == (250, 64)
    assert w.logical_box == LogicalBox("w", (1000, 64), (500, 0), (250, 64), sliced=True)
    assert cv.Variable(1.0).shard is None
    assert pickle.loads(pickle.dumps(w.shard)) == w.shard
    with cv.Graph().as_default():
        again = pickle.loads(pickle.dumps(w))
        twin = copy.deepcopy(w)
    assert again.shard == w.shard and twin.shard == w.shard and again.name == "w"
    assert np.array_equal(again.numpy(), rows)


@pytest.mark.parametrize(
    ("value", "shard", "match"),
    [
        (np.zeros((250, 64)), cv.Shard((1000, 64), (800, 0)), r"axis 0 it covers \[800, 1050\)"),
        (np.zeros((250, 64)), cv.Shard((1000, 32), (0, 0)), "axis 1"),
        (np.zeros((250,)), cv.Shard((1000, 64), (0, 0)), "dimensions"),
        (np.zeros((2, 2)), (4, 4), "cv.Shard"),
        (np.zeros((2, 2)), cv.Shard((4, 4), (0, 0), shape=(3, 2)), "shard says"),
    ],
)
def test_shards_that_do_not_fit_are_clear_errors(value, shard, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(cv.CkptError, match=match):
        cv.Variable(value, name="w", shard=shard)
    assert cv.global_variables() == []


def test_shard_arguments_are_checked() -> None:
    with pytest.raises(cv.CkptError, match="dimensions"):
        cv.Shard((4, 4), (0,))
    with pytest.raises(cv.CkptError, match="negative"):
        cv.Shard((4, 4), (-1, 0))
    with pytest.raises(cv.CkptError, match="fully defined"):
        cv.Variable(np.zeros(2), shape=(None,), shard=cv.Shard((4,), (0,)))


class _Holds(cv.Module):
    def __init__(self, table: cv.PartitionedVariable) -> None:
        super().__init__()
        self.table = table


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["deepcopy", "pickle"])
def test_a_copied_partitioned_variable_is_still_one_logical_variable(duplicate, tmp_path) -> None:
    # the parts lost their save_slice_info: a save of the copy failed with "boxes overlap"
    # and its assign with a bare AssertionError
    with cv.variable_scope("emb", partitioner=cv.fixed_size_partitioner(2)):
        table = cv.get_variable("table", shape=(5, 2), initializer=cv.initializers.ones)
    copied = duplicate(_Holds(table))
    parts = list(copied.table)
    assert [p.save_slice_info for p in parts] == [p.save_slice_info for p in table]
    assert all(a is not b for a, b in zip(parts, table, strict=True))
    copied.table.assign(np.arange(10.0).reshape(5, 2))
    assert np.asarray(table).tolist() == np.ones((5, 2)).tolist()  # the original is apart
    path = cv.Checkpoint(model=copied).write(str(tmp_path / "copy.h5"))
    assert cv.list_variables(path) == [("model/table", (5, 2), F32)]
    np.testing.assert_array_equal(cv.load(path)["model/table"], np.arange(10.0).reshape(5, 2))


def test_an_assign_a_part_constraint_refuses_changes_no_part() -> None:
    # part 0 kept its new value when part 1's constraint raised: half an assign
    def at_most_5(x: np.ndarray) -> np.ndarray:
        if (x > 5).any():
            raise ValueError("above 5")
        return x

    with cv.variable_scope("e", partitioner=cv.fixed_size_partitioner(2)):
        t = cv.get_variable("t", shape=(4,), initializer=cv.initializers.zeros,
                            constraint=at_most_5)
    with pytest.raises(ValueError, match="above 5"):
        t.assign([1.0, 1.0, 9.0, 9.0])
    assert np.asarray(t).tolist() == [0.0, 0.0, 0.0, 0.0]
    t.assign([1.0, 2.0, 3.0, 4.0])
    assert np.asarray(t).tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    ("initializer", "bound"),
    [
        (None, math.sqrt(6 / (1000 + 64))),  # get_variable's default: glorot_uniform
        (cv.initializers.glorot_uniform, math.sqrt(6 / (1000 + 64))),
        (cv.initializers.variance_scaling(2.0, "fan_in", "uniform", seed=3),
         math.sqrt(3 * 2.0 / 1000)),
    ],
)
def test_fan_based_initializers_scale_a_part_by_the_whole_variable(initializer, bound) -> None:
    # TF1's VarianceScaling takes its fans from partition_info.full_shape: each part drew
    # from the part's fans, (250, 64) here, nearly twice as wide as the unpartitioned table
    with cv.variable_scope("emb", partitioner=cv.fixed_size_partitioner(4)):
        table = cv.get_variable("table", shape=(1000, 64), initializer=initializer)
    value = np.asarray(table)
    assert np.abs(value).max() <= bound
    assert np.abs(value).max() > 0.95 * bound  # and fills the whole range, part by part
    for part in table:
        assert np.abs(part.numpy()).max() > 0.9 * bound


def test_report_uninitialized_variables_takes_a_partitioned_variable() -> None:
    # AttributeError: 'PartitionedVariable' object has no attribute 'initialized'
    with cv.deferred_init(), cv.variable_scope("e", partitioner=cv.fixed_size_partitioner(2)):
        table = cv.get_variable("t", shape=(4,))
    plain = cv.Variable(1.0, name="plain")
    assert cv.report_uninitialized_variables([table, plain]) == ["e/t/part_0", "e/t/part_1"]
    next(iter(table)).initialize()
    assert cv.report_uninitialized_variables([table]) == ["e/t/part_1"]


def test_reusing_a_partitioned_variable_with_other_partitions_is_refused() -> None:
    """As TensorFlow 1 ('Trying to reuse partitioned variable ..., but specified partitions
    ...'): get_variable with reuse and another partitioner returned the variable as cut
    before, silently ignoring the partitions asked for."""
    with cv.Graph().as_default():
        with cv.variable_scope("emb", partitioner=cv.fixed_size_partitioner(2)):
            table = cv.get_variable("table", shape=(4, 2))
        with cv.variable_scope("emb", reuse=True, partitioner=cv.fixed_size_partitioner(2)):
            assert cv.get_variable("table", shape=(4, 2)) is table
        for other in (cv.fixed_size_partitioner(4), cv.fixed_size_partitioner(2, axis=1)):
            with cv.variable_scope("emb", reuse=True, partitioner=other), pytest.raises(
                    ValueError, match=r"specified partitions \[.*\] and found partitions \[2, 1\]"):
                cv.get_variable("table", shape=(4, 2))


def test_asarray_copy_false_of_a_partitioned_variable_raises() -> None:
    """``np.asarray(pv, copy=False)`` returned the concatenated new array: NumPy 2 asks a
    value that cannot avoid a copy to raise ValueError, as a lazy value does."""
    pv = cv.get_variable("w", shape=(4, 3), partitioner=cv.fixed_size_partitioner(2))
    with pytest.raises(ValueError, match=r"copy=False.*'w'"):
        np.asarray(pv, copy=False)
    with pytest.raises(ValueError, match="copy=False"):
        pv.__array__(np.float64, copy=False)
    assert np.asarray(pv).shape == (4, 3)  # copy=None: the full value, as before
    assert np.asarray(pv, dtype=np.float64, copy=True).dtype == np.float64
