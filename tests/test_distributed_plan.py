"""The planner of a multi-process save and the resharding math of a restore (pure; no I/O).

Property tests: random box partitions of 1-3 dim arrays (uneven, zero-size boxes),
saved by N ranks and restored by M ranks (N, M in 1..4), with replicated values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptvar.distributed import (
    Box,
    PlanCache,
    SingleProcessCoordinator,
    VariableLayout,
    check_replicas,
    gather_plan,
    layout_digest,
    plan_save,
    read_plan,
)
from ckptvar.distributed._plan import plan_save_plain
from ckptvar.distributed._plan_fast import plan_split
from ckptvar.distributed._wire import encode, layout_message, plan_messages, spec_senders
from ckptvar.errors import CkptError, ShardLayoutError

# -- strategies ---------------------------------------------------------------------


@st.composite
def partition_of(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """A random guillotine partition of ``shape`` (cuts at 0 or the end give zero-size boxes)."""
    boxes = [Box.full(shape)]
    for _ in range(draw(st.integers(0, 6))):
        i = draw(st.integers(0, len(boxes) - 1))
        box = boxes[i]
        axis = draw(st.integers(0, len(shape) - 1))
        cut = draw(st.integers(0, box.shape[axis]))
        lo = list(box.shape)
        lo[axis] = cut
        off = list(box.offset)
        off[axis] += cut
        hi = list(box.shape)
        hi[axis] -= cut
        boxes[i : i + 1] = [Box(box.offset, tuple(lo)), Box(tuple(off), tuple(hi))]
    return boxes


@st.composite
def partitions(draw: st.DrawFn, max_dims: int = 3) -> tuple[tuple[int, ...], list[Box]]:
    """A full shape of 1-3 dims and a random partition of it."""
    shape = tuple(draw(st.integers(0, 7)) for _ in range(draw(st.integers(1, max_dims))))
    return shape, draw(partition_of(shape))


def assign(draw: st.DrawFn, boxes: list[Box], n: int) -> list[list[Box]]:
    owners = [draw(st.integers(0, n - 1)) for _ in boxes]
    return [[b for b, o in zip(boxes, owners) if o == r] for r in range(n)]


# -- Box ----------------------------------------------------------------------------


def test_box_basics() -> None:
    a = Box((1, 2), (3, 4))
    assert a.stop == (4, 6)
    assert a.size == 12
    assert a.slices() == (slice(1, 4), slice(2, 6))
    assert a.intersect(Box((3, 0), (5, 3))) == Box((3, 2), (1, 1))
    assert a.intersect(Box((4, 0), (1, 9))) is None  # touching edges share nothing
    assert Box((2, 3), (1, 1)).relative(a) == (slice(1, 2), slice(1, 2))
    assert str(a) == "[1:4, 2:6]"
    assert Box((), ()).size == 1  # a scalar is one element
    with pytest.raises(ShardLayoutError, match="negative"):
        Box((-1,), (2,))
    with pytest.raises(ShardLayoutError, match="numbers of axes"):
        Box((0,), (2, 2))


# -- plan_save: valid layouts -----------------------------------------------------------


def test_two_ranks_and_a_replicated_value() -> None:
    layouts = [
        {
            "w": VariableLayout((6, 2), "float32", [Box((0, 0), (4, 2))]),
            "b": VariableLayout((3,), "float64"),
        },
        {
            "w": VariableLayout((6, 2), "float32", [Box((4, 0), (2, 2))]),
            "b": VariableLayout((3,), "float64"),
        },
    ]
    plan = plan_save(layouts)
    assert [(i.key, i.box) for i in plan.writes_for(0)] == [("w", Box((0, 0), (4, 2)))]
    # rank 1 writes fewer shard bytes, so it gets the replicated value
    assert [(i.key, i.box) for i in plan.writes_for(1)] == [
        ("b", Box((0,), (3,))),
        ("w", Box((4, 0), (2, 2))),
    ]
    assert plan.bytes_per_rank() == [32, 16 + 24]
    assert plan.variables["b"].replicated and plan.variables["b"].holders == (0, 1)


def test_zero_size_shards_and_variables_are_valid() -> None:
    layouts = [
        {"w": VariableLayout((3,), "int8", [Box((0,), (3,)), Box((3,), (0,))])},
        {"w": VariableLayout((3,), "int8", [Box((1,), (0,))]), "e": VariableLayout((0, 4), "f4")},
    ]
    plan = plan_save(layouts)
    assert [i.box for i in plan.variables["w"].items] == [Box((0,), (3,))]
    assert plan.variables["e"].items == ()  # nothing to write, but the variable is planned
    assert plan.writes_for(1) == ()


def test_a_rank_may_hold_several_boxes() -> None:
    layouts = [{"t": VariableLayout((4,), "f4", [Box((2,), (2,)), Box((0,), (2,))])}]
    items = plan_save(layouts).writes_for(0)
    assert [(i.box.offset, i.local_index) for i in items] == [((0,), 1), ((2,), 0)]


# -- plan_save: invalid layouts name the variable and the ranks --------------------------


@pytest.mark.parametrize(
    ("layouts", "match"),
    [
        (
            [
                {"w": VariableLayout((4,), "f4", [Box((0,), (3,))])},
                {"w": VariableLayout((4,), "f4", [Box((2,), (2,))])},
            ],
            r"'w': rank 0's box \[0:3\] overlaps rank 1's box \[2:4\]",
        ),
        (
            [
                {"w": VariableLayout((4,), "f4", [Box((0,), (1,))])},
                {"w": VariableLayout((4,), "f4", [Box((2,), (2,))])},
            ],
            r"'w': the shards cover 3 of the 4 elements .* \[1:2\] is in no box",
        ),
        (
            [{"w": VariableLayout((4,), "f4", [Box((3,), (2,))])}],
            r"'w': rank 0's box \[3:5\] .* lies outside its full shape \(4,\)",
        ),
        (
            [
                {"w": VariableLayout((4,), "f4", [Box((0,), (2,))])},
                {"w": VariableLayout((5,), "f4", [Box((2,), (3,))])},
            ],
            r"'w': the processes disagree on its full shape: \(4,\) on rank 0; \(5,\) on rank 1",
        ),
        (
            [
                {"w": VariableLayout((4,), "f4", [Box((0,), (4,))])},
                {"w": VariableLayout((4,), "f8", [])},
            ],
            r"'w': the processes disagree on its dtype: f4 on rank 0; f8 on rank 1",
        ),
        (
            [
                {"w": VariableLayout((4,), "f4", [Box((0,), (4,))])},
                {"w": VariableLayout((4,), "f4")},
            ],
            r"'w': .*kind: sharded on rank 0; replicated \(no shard\) on rank 1",
        ),
    ],
    ids=["overlap", "gap", "outside", "shape", "dtype", "mixed"],
)
def test_bad_layouts_are_refused(layouts: list[dict[str, VariableLayout]], match: str) -> None:
    with pytest.raises(ShardLayoutError, match=match) as info:
        plan_save(layouts)
    assert isinstance(info.value, CkptError) and isinstance(info.value, ValueError)


def test_replicas_that_differ_name_the_variable_and_ranks() -> None:
    layouts = [{"b": VariableLayout((2,), "f4")} for _ in range(3)]
    plan = plan_save(layouts)
    check_replicas(plan, [{"b": 5}, {"b": 5}, {"b": 5}])
    with pytest.raises(
        ShardLayoutError,
        match=r"'b' .* replicas differ: checksum 5 on rank 0, "
        r"rank 2; checksum 6 on rank 1",
    ):
        check_replicas(plan, [{"b": 5}, {"b": 6}, {"b": 5}])


# -- the plan cache and gather_plan (one process) ----------------------------------------


def test_plan_cache_skips_the_layout_gather() -> None:
    class Counting(SingleProcessCoordinator):
        def __init__(self) -> None:
            super().__init__()
            self.tags: list[str] = []

        def allgather(self, obj, *, tag, timeout=None):  # type: ignore[no-untyped-def]
            self.tags.append(tag)
            return super().allgather(obj, tag=tag, timeout=timeout)

    coord = Counting()
    cache = PlanCache(maxsize=2)
    layout = {"w": VariableLayout((2,), "f4", [Box((0,), (2,))])}
    p1 = gather_plan(coord, layout, cache=cache)
    p2 = gather_plan(coord, layout, cache=cache)
    assert p1 is p2
    assert coord.tags == ["plan:digests", "plan:layouts", "plan:digests"]
    other = {"w": VariableLayout((3,), "f4", [Box((0,), (3,))])}
    assert layout_digest(other) != layout_digest(layout)
    gather_plan(coord, other, cache=cache)
    assert coord.tags[-2:] == ["plan:digests", "plan:layouts"]
    assert len(cache) == 2


# -- read_plan --------------------------------------------------------------------------


def test_read_plan_copies_each_overlap_once() -> None:
    stored = [Box((0, 0), (2, 4)), Box((2, 0), (3, 4))]
    items = read_plan("w", Box((1, 1), (3, 2)), stored, (5, 4))
    assert [(i.source, i.source_slices, i.dest_slices) for i in items] == [
        (0, (slice(1, 2), slice(1, 3)), (slice(0, 1), slice(0, 2))),
        (1, (slice(0, 2), slice(1, 3)), (slice(1, 3), slice(0, 2))),
    ]


def test_read_plan_never_fills_a_gap() -> None:
    with pytest.raises(
        ShardLayoutError,
        match=r"'w': the stored slices cover 2 of the 4 .*"
        r"\[2:4\] is in no stored box; a restore never fills a gap",
    ):
        read_plan("w", Box((0,), (4,)), [Box((0,), (2,))], (4,))
    with pytest.raises(ShardLayoutError, match="outside the stored full shape"):
        read_plan("w", Box((3,), (2,)), [Box((0,), (4,))], (4,))
    with pytest.raises(ShardLayoutError, match="overlap"):
        read_plan("w", Box((0,), (4,)), [Box((0,), (3,)), Box((2,), (2,))], (4,))


# -- properties: N ranks save, M ranks restore --------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_save_n_restore_m_is_exact(data: st.DataObject) -> None:
    shape, stored_boxes = data.draw(partitions())
    n = data.draw(st.integers(1, 4), label="N")
    m = data.draw(st.integers(1, 4), label="M")
    full = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    held = assign(data.draw, stored_boxes, n)
    replicated_on = sorted(set(data.draw(st.lists(st.integers(0, n - 1), min_size=1))))
    layouts = [
        {"w": VariableLayout(shape, "int32", held[r])}
        | ({"b": VariableLayout((3,), "int32")} if r in replicated_on else {})
        for r in range(n)
    ]
    plan = plan_save(layouts)
    # each element is written exactly once, by the rank that holds it
    written = np.zeros(shape, dtype=np.int64)
    stored: list[tuple[Box, np.ndarray]] = []
    for rank in range(n):
        for item in plan.writes_for(rank):
            if item.key == "w":
                assert item.box == held[rank][item.local_index]
                written[item.box.slices()] += 1
                stored.append((item.box, full[item.box.slices()].copy()))
    assert (written == 1).all()
    b_writers = [i.writer for i in plan.variables["b"].items]
    assert len(b_writers) == 1 and b_writers[0] in replicated_on
    # M ranks restore their own partition of the same array
    target_boxes = data.draw(partition_of(shape), label="targets")
    for rank_boxes in assign(data.draw, target_boxes, m):
        for target in rank_boxes:
            out = np.full(target.shape, -1, dtype=np.int32)
            items = read_plan("w", target, [b for b, _ in stored], shape)
            assert sum(i.box.size for i in items) == target.size  # bytes read == bytes needed
            for it in items:
                out[it.dest_slices] = stored[it.source][1][it.source_slices]
            np.testing.assert_array_equal(out, full[target.slices()])


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_missing_or_doubled_box_is_always_caught(data: st.DataObject) -> None:
    shape, boxes = data.draw(partitions())
    nonempty = [b for b in boxes if b.size]
    if not nonempty:
        return
    n = data.draw(st.integers(1, 4))
    victim = data.draw(st.sampled_from(nonempty))
    if data.draw(st.booleans()):  # drop one box: a gap
        broken = [b for b in boxes if b is not victim]
        match = "cover"
    else:  # hand one box to two ranks: an overlap
        broken = [*boxes, victim]
        match = "overlaps"
    held = assign(data.draw, broken, n)
    with pytest.raises(ShardLayoutError, match=match):
        plan_save([{"w": VariableLayout(shape, "f4", held[r])} for r in range(n)])
    if match == "cover":
        with pytest.raises(ShardLayoutError, match="never fills"):
            read_plan("w", Box.full(shape), broken, shape)


# -- the plain-data planner (what ranks exchange) agrees with plan_save -------------------


@st.composite
def slab_layouts(draw: st.DrawFn) -> list[dict[str, object]]:
    """Plain layouts of N ranks, one box each per key: mostly slabs along one axis, some
    arbitrary boxes, overlaps, gaps, boxes outside, scalars, replicated values, dtype clashes."""
    n = draw(st.integers(1, 4))
    layouts: list[dict[str, object]] = [{} for _ in range(n)]
    for k in range(draw(st.integers(1, 6))):
        key = f"k{k}"
        full = tuple(draw(st.integers(0, 5)) for _ in range(draw(st.integers(0, 3))))
        kind = draw(st.sampled_from(["slab", "slab", "slab", "any", "replicated"]))
        if kind == "replicated":
            for r in range(n):
                layouts[r][key] = (full, "<f4", None)
            continue
        if kind == "slab" and full:
            axis = draw(st.integers(0, len(full) - 1))
            cuts = sorted(draw(st.integers(0, full[axis])) for _ in range(n - 1))
            cuts = [0, *cuts, full[axis]]
            ranks = draw(st.permutations(range(n)))
            for j, r in enumerate(ranks):
                off, shp = [0] * len(full), list(full)
                off[axis], shp[axis] = cuts[j], cuts[j + 1] - cuts[j]
                shp[axis] += draw(st.sampled_from([0] * 8 + [1, -1]))  # overlap / gap / outside
                shp[axis] = max(shp[axis], 0)
                dtype = draw(st.sampled_from(["<f4"] * 9 + ["<f8"]))
                layouts[r][key] = (full, dtype, [(tuple(off), tuple(shp))])
        else:
            for r in range(n):
                off = tuple(draw(st.integers(0, d)) for d in full)
                shp = tuple(draw(st.integers(0, d - o)) for d, o in zip(full, off, strict=True))
                layouts[r][key] = (full, "<f4", [(off, shp)])
    return layouts


def _as_layouts(plain: list[dict[str, object]]) -> list[dict[str, VariableLayout]]:
    return [
        {k: VariableLayout(f, d, None if b is None else tuple(Box(*x) for x in b))
         for k, (f, d, b) in lay.items()}  # type: ignore[misc]
        for lay in plain
    ]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain=slab_layouts())
def test_the_plain_planner_gives_plan_saves_plan_and_errors(plain: list[dict[str, object]]) -> None:
    try:
        want, want_error = plan_save(_as_layouts(plain)), None
    except ShardLayoutError as exc:
        want, want_error = None, str(exc)
    try:
        got, got_error = plan_save_plain(plain), None  # type: ignore[arg-type]
    except ShardLayoutError as exc:
        got, got_error = None, str(exc)
    assert got_error == want_error
    if want is None or got is None:
        return
    assert list(got.variables.items()) == list(want.variables.items())
    for r in range(want.size):
        assert got.writes_for(r) == want.writes_for(r)
    assert got.bytes_per_rank() == want.bytes_per_rank()


@st.composite
def exchanged_layouts(draw: st.DrawFn) -> list[dict[str, object]]:
    """:func:`slab_layouts`, some of them changed on one rank: a key dropped, a box given
    twice, a full shape of other numbers, a number that is not a plain int."""
    layouts = draw(slab_layouts())
    change = draw(st.sampled_from(["none", "none", "drop", "twice", "shape", "npint"]))
    r = draw(st.integers(0, len(layouts) - 1))
    key = draw(st.sampled_from(sorted(layouts[r])))
    full, dtype, boxes = layouts[r][key]  # type: ignore[misc]
    if change == "drop":
        del layouts[r][key]
    elif change == "twice" and boxes:
        layouts[r][key] = (full, dtype, [*boxes, *boxes])
    elif change == "shape":
        layouts[r][key] = ((*full, 1), dtype, boxes)
    elif change == "npint" and full:
        layouts[r][key] = ((np.int64(full[0]), *full[1:]), dtype, boxes)
    return layouts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain=exchanged_layouts())
def test_the_exchanged_layouts_give_plan_saves_plan_and_errors(
    plain: list[dict[str, object]],
) -> None:
    """What ranks send (one spec, one array of numbers each) plans to plan_save's plan, or
    fails with its error, whether the layouts take the NumPy path or not."""
    try:
        want, want_error = plan_save(_as_layouts(plain)), None
    except ShardLayoutError as exc:
        want, want_error = None, str(exc)
    msgs = [layout_message(p, r) for r, p in enumerate(plain)]  # type: ignore[arg-type]
    senders = spec_senders(msgs)
    specs = [encode(p)[0] if r in senders else None  # type: ignore[arg-type,index]
             for r, p in enumerate(plain)]
    try:
        got, got_error = plan_messages(msgs, specs), None
    except ShardLayoutError as exc:
        got, got_error = None, str(exc)
    assert got_error == want_error
    if want is None or got is None:
        return
    assert got.variables == want.variables
    assert list(got.variables) == list(want.variables)
    for r in range(want.size):
        assert got.writes_for(r) == want.writes_for(r)
        for key, vp in got.variables.items():
            assert [j for j, _ in vp.written_by(r)] == [
                j for j, it in enumerate(want.variables[key].items) if it.writer == r]
    assert got.bytes_per_rank() == want.bytes_per_rank()


def test_only_rank_zero_sends_the_spec_unless_a_rank_differs() -> None:
    plain = [{f"v{i}": ((8, 3), "<f4", [((2 * r, 0), (2, 3))]) for i in range(50)}
             for r in range(4)]
    msgs = [layout_message(p, r) for r, p in enumerate(plain)]  # type: ignore[arg-type]
    assert msgs[0][2] is not None and all(m[2] is None for m in msgs[1:])
    assert msgs[2][3].tolist()[:6] == [4, 0, 2, 3, 4, 0]  # offset, shape, offset, ...
    assert spec_senders(msgs) == []
    plain[3]["extra"] = ((2,), "<f4", None)  # rank 3 holds one key more
    msgs[3] = layout_message(plain[3], 3)  # type: ignore[arg-type]
    assert spec_senders(msgs) == [3]
    with pytest.raises(ShardLayoutError, match="rank 3's layout came without its spec"):
        plan_messages(msgs)
    plan = plan_messages(msgs, [None, None, None, encode(plain[3])[0]])  # type: ignore
    assert plan.variables["extra"].items[0].writer == 3


def test_a_column_plan_builds_no_item_until_asked() -> None:
    plain = [{"w": ((8, 3), "<f4", [((2 * r, 0), (2, 3))])} for r in range(4)]
    vp = plan_messages([layout_message(p, r) for r, p in enumerate(plain)]).variables["w"]  # type: ignore[arg-type]
    assert vp._items is None  # the point of the test
    assert [(j, str(it.box)) for j, it in vp.written_by(2)] == [(2, "[4:6, 0:3]")]
    assert vp.plain_boxes() == ([[0, 0], [2, 0], [4, 0], [6, 0]], [[2, 3]] * 4, [0, 1, 2, 3])
    assert vp._items is None
    assert [it.writer for it in vp.items] == [0, 1, 2, 3]
    with pytest.raises(AttributeError, match="immutable"):
        vp.key = "x"  # type: ignore[misc]
    import pickle
    assert pickle.loads(pickle.dumps(vp)) == vp


def test_the_common_layout_is_planned_without_plan_save() -> None:
    """4 ranks x 2,000 row-sharded variables take the vectorised path, and it is the same plan."""
    plain = [{f"v{i}": ((8, 3), "<f4", [((2 * r, 0), (2, 3))]) for i in range(2000)}
             for r in range(4)]
    fast = plan_split(plain)  # type: ignore[arg-type]
    assert fast is not None
    assert fast.variables == plan_save(_as_layouts(plain)).variables  # type: ignore[arg-type]
    assert [it.writer for it in fast.variables["v7"].items] == [0, 1, 2, 3]
