"""``cv.IncrementalOptions``: the user chooses how far a row delta may grow (the share of
rows its patches hold, how many patches) and how often a step is written whole; the
default (``incremental=True``) is the rule of docs/FORMAT.md "Row deltas", unchanged.
Real files, real ``ckpt`` processes; the multi-process and object-store paths are in
tests/test_row_deltas_mpi.py and tests/cloud/test_cloud_row_deltas.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv
from ckpt_runs import ckpt_processes

ROWS, WIDTH = 8192, 64  # a 2 MiB float32 table (deltas start at 1 MiB)
#: Rows each step writes (deterministic, so the rule's decisions are known): steps 2-4
#: touch the same hot rows and a few more, step 5 others.
STEPS = [np.arange(150), np.arange(180), np.arange(190), np.arange(1000, 1300)]


def _model() -> tuple[cv.Checkpoint, cv.Variable]:
    table = cv.Variable(np.random.default_rng(0).random((ROWS, WIDTH), dtype=np.float32),
                        name="table")
    frozen = cv.Variable(np.random.default_rng(1).random(300_000, dtype=np.float32),
                         name="frozen")  # 1.2 MiB, never written: shared by every step
    return cv.Checkpoint(table=table, frozen=frozen), table


def _layout(step: str | Path) -> tuple[int, str] | None:
    """How ``step`` stores the table: (patches, the step holding its base), or None
    (whole)."""
    with cv.open(step) as reader:
        d = reader.record.deltas.get("table")
    return None if d is None else (len(d.patches), d.since)


def _run(tmp_path: Path, name: str, fmt: str, incremental: Any
         ) -> tuple[list[tuple[int, str] | None], cv.CheckpointManager]:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / name, format=fmt, max_to_keep=None,
                                   incremental=incremental)
    manager.save()
    layouts = []
    for k, rows in enumerate(STEPS):
        table.scatter_update(rows, np.full((rows.size, WIDTH), k, np.float32))
        step = manager.save()
        layouts.append(_layout(step))
        assert np.array_equal(cv.load(step)["table"], table.numpy())
    return layouts, manager


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_lower_share_of_rows_merges_then_writes_whole_where_the_default_appends(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str) -> None:
    base = f"ckpt-1.{fmt}"
    default, _ = _run(tmp_path, "default", fmt, True)
    # 25% of 8,192 rows: every step appends a patch on the first whole copy
    assert default == [(1, base), (2, base), (3, base), (4, base)]
    assert _run(tmp_path, "options", fmt, cv.IncrementalOptions())[0] == default
    # 5%: 409 rows. Steps 2-3 append (330 rows); step 4's 520 would be past the share:
    # one merged patch of the 190 rows since the whole copy (under half the share);
    # step 5's union (490 rows) is past half the share: the table is written whole
    low, manager = _run(tmp_path, "low", fmt, cv.IncrementalOptions(max_patched_rows=0.05))
    assert low == [(1, base), (2, base), (1, base), None]
    step4 = Path(manager.checkpoints[-2])
    with cv.open(step4) as reader:
        assert reader.deltas()["table"] == {"base": base, "patches": 1, "rows": 190}


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_no_share_of_rows_writes_every_changed_table_whole(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str) -> None:
    layouts, manager = _run(tmp_path, "run", fmt, cv.IncrementalOptions(max_patched_rows=0))
    assert layouts == [None] * len(STEPS)
    with cv.open(manager.latest_checkpoint) as reader:  # the frozen value is still shared
        assert "frozen" in reader.shared() and "table" not in reader.shared()


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_max_patches_merges_past_that_many(tmp_path: Path, fresh_graph: cv.Graph,
                                           fmt: str) -> None:
    layouts, _ = _run(tmp_path, "run", fmt, cv.IncrementalOptions(max_patches=2))
    base = f"ckpt-1.{fmt}"
    # the third patch would be one too many: merged (190 rows, under 12.5%), then the
    # fifth step's patch appends on the merged one
    assert layouts == [(1, base), (2, base), (1, base), (2, base)]


def _inspect(step: str | Path) -> dict[str, Any]:
    (res,) = ckpt_processes(("inspect", "--json", step))
    assert res.returncode == 0, res.stdout + res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_whole_every_makes_every_nth_step_standalone_and_prune_frees_what_is_before(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str) -> None:
    ckpt, table = _model()
    run = tmp_path / "run"
    manager = cv.CheckpointManager(ckpt, run, format=fmt, max_to_keep=2,
                                   incremental=cv.IncrementalOptions(whole_every=3))
    alone = []
    for k in range(7):
        if k:
            table.scatter_update([k, 4000 + k], np.full((2, WIDTH), k, np.float32))
        step = manager.save()
        with cv.open(step) as reader:  # before a later step shares its files
            alone.append(not reader.shared() and not reader.deltas())
        assert np.array_equal(cv.load(step)["table"], table.numpy())
        if k == 3:
            doc = _inspect(step)
            assert "shared" not in doc and "deltas" not in doc
            # HDF5: step 3 (kept) refers to steps 1-2, which stay on disk
            on_disk = sorted(n for n in os.listdir(run) if n.startswith("ckpt-"))
            assert on_disk == ([f"ckpt-{i}.{fmt}" for i in (1, 2, 3, 4)] if fmt == "h5"
                               else [f"ckpt-3.{fmt}", f"ckpt-4.{fmt}"])
    # steps 1, 4 and 7 stand alone (no external value, no delta, no shared file)
    assert alone == [True, False, False, True, False, False, True]
    assert "deltas" in _inspect(manager.checkpoints[0])  # step 6: a delta on step 4
    # the kept steps (6, 7) refer to nothing before step 4 (HDF5: step 6 to step 4's
    # whole copy and step 5's patch): everything older is freed
    on_disk = sorted(n for n in os.listdir(run) if n.startswith("ckpt-"))
    assert on_disk == [f"ckpt-{i}.{fmt}" for i in ((4, 5, 6, 7) if fmt == "h5" else (6, 7))]
    for path in manager.checkpoints:
        cv.load(path)


def test_whole_every_one_writes_every_step_whole(tmp_path: Path, fresh_graph: cv.Graph
                                                 ) -> None:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=None,
                                   incremental=cv.IncrementalOptions(whole_every=1))
    for _ in range(3):
        table.scatter_update([5], np.ones((1, WIDTH), np.float32))
        with cv.open(manager.save()) as reader:
            assert reader.shared() == {} and reader.deltas() == {}


def test_a_new_manager_writes_its_first_step_whole_when_whole_every_is_set(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, table = _model()
    run = tmp_path / "run"
    cv.CheckpointManager(ckpt, run, incremental=True).save()
    options = cv.IncrementalOptions(whole_every=100)
    table.scatter_update([5], np.ones((1, WIDTH), np.float32))
    restarted = cv.CheckpointManager(ckpt, run, incremental=options)
    with cv.open(restarted.save()) as reader:  # it does not know when the last whole was
        assert reader.shared() == {} and reader.deltas() == {}
    table.scatter_update([6], np.ones((1, WIDTH), np.float32))
    with cv.open(restarted.save()) as reader:
        assert reader.deltas()["table"]["base"] == "ckpt-2.h5"
        assert reader.shared()["frozen"] == ["ckpt-2.h5"]


def test_a_local_tier_writes_whole_the_steps_whole_every_and_persistent_every_ask_for(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "persistent", max_to_keep=None,
                                   local_directory=tmp_path / "local", persistent_every=4,
                                   incremental=cv.IncrementalOptions(whole_every=3))
    alone = []
    for k in range(1, 9):
        table.scatter_update([k], np.full((1, WIDTH), k, np.float32))
        with cv.open(manager.save()) as reader:
            alone.append(not reader.shared() and not reader.deltas())
    manager.wait_until_finished()
    # whole: step 1 (the first), 4 and 8 (persisted), 7 (three saves after step 4)
    assert [k for k, a in enumerate(alone, 1) if a] == [1, 4, 7, 8]


@pytest.mark.parametrize(("options", "error", "says"), [
    ({"max_patched_rows": 1.5}, ValueError, "max_patched_rows=1.5): a share of the rows is a number from 0 to 1"),
    ({"max_patched_rows": -0.1}, ValueError, "from 0 to 1"),
    ({"max_patched_rows": float("nan")}, ValueError, "from 0 to 1"),
    ({"max_patched_rows": "25%"}, TypeError, "max_patched_rows='25%'"),
    ({"max_patched_rows": True}, TypeError, "a share of the rows"),
    ({"max_patches": 0}, ValueError, "max_patches=0): a row delta refers to at least its own patch"),
    ({"max_patches": 2.5}, TypeError, "expected a whole number"),
    ({"whole_every": 0}, ValueError, "whole_every=0): a whole step every N saves needs N >= 1"),
    ({"whole_every": True}, TypeError, "whole_every=True"),
])
def test_bad_options_are_refused_saying_which_and_why(options: dict[str, Any],
                                                      error: type[Exception],
                                                      says: str) -> None:
    with pytest.raises(error) as got:
        cv.IncrementalOptions(**options)
    assert says in str(got.value)


def test_bad_incremental_arguments_are_refused(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, _ = _model()
    for bad in ("yes", 2, {"whole_every": 3}):
        with pytest.raises(TypeError, match=r"expected True, False or a cv\.IncrementalOptions"):
            cv.CheckpointManager(ckpt, tmp_path / "run", incremental=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    options = cv.IncrementalOptions(max_patches=4)
    with pytest.raises(AttributeError):  # frozen: a manager's options do not change under it
        options.max_patches = 5  # type: ignore[misc]
