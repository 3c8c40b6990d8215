"""A row delta's merge step: the rows of the patches it merges are taken as this process
wrote them (kept with the committed record), read back only when not known (a restart,
a step of another process or writer); the merged patch holds exactly the union of the
rows changed since the whole copy, with their newest values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.storage import _h5, _zarr
from ckptvar.storage._container.reader import ContainerReader

ROWS, WIDTH = 8192, 64  # a 2 MiB float32 table (deltas start at 1 MiB)
PATCHES = 3  # a merge every few steps


def _model() -> tuple[cv.Checkpoint, cv.Variable]:
    table = cv.Variable(np.random.default_rng(0).random((ROWS, WIDTH), dtype=np.float32),
                        name="table")
    return cv.Checkpoint(table=table), table


def _manager(ckpt: cv.Checkpoint, where: Path, fmt: str) -> cv.CheckpointManager:
    return cv.CheckpointManager(ckpt, where, format=fmt, max_to_keep=2,
                                incremental=cv.IncrementalOptions(max_patches=PATCHES))


def _steps(manager: cv.CheckpointManager, table: cv.Variable, rng: np.random.Generator,
           n: int, since: set[int]) -> list[int]:
    """``n`` steps of a few random rows each (a repeat among them); after each, the step
    restores bit-exact and its patches hold every row changed since the whole copy
    (``since``, updated), nothing more. Returns each step's patch count."""
    counts = []
    for _ in range(n):
        ids = np.unique(np.concatenate([rng.integers(0, ROWS, 40), [7]]))
        table.scatter_update(ids, table.numpy()[ids] + 1.0)
        since.update(ids.tolist())
        step = Path(manager.save())
        with cv.open(step) as r:
            d = r.record.deltas["table"]
            counts.append(len(d.patches))
            assert sum(p[3] for p in d.patches) >= len(since)
            held = r.delta_rows("table")
            got = r["table"].read()
        assert set(held.tolist()) == since, "the patches hold exactly the rows changed"
        assert np.array_equal(got, table.numpy())
        assert np.array_equal(cv.load(step)["table"], table.numpy())
    return counts


def test_a_merge_reads_back_no_patch_this_process_wrote(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str, watch_calls: Any) -> None:
    ckpt, table = _model()
    manager = _manager(ckpt, tmp_path / "run", fmt)
    manager.save()
    rng = np.random.default_rng(3)
    since: set[int] = set()
    reads = watch_calls(ContainerReader, "delta_rows")
    seen: list[int] = []
    for _ in range(2 * PATCHES + 1):  # two merges
        before = len(reads)
        seen += _steps(manager, table, rng, 1, since)
        assert len(reads) == before + 1  # the test's own check above, no save's
    assert seen == [1, 2, 3, 1, 2, 3, 1], seen  # appended, then merged into one


def test_a_merge_after_a_restart_reads_the_rows_once_then_never(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str, watch_calls: Any) -> None:
    """After a restart (nothing kept, a new manager and variables, the last step
    restored) the first merge reads the base's patches' rows back; the next one, of
    patches this process wrote, does not. Every step restores bit-exact."""
    ckpt, table = _model()
    manager = _manager(ckpt, tmp_path / "run", fmt)
    manager.save()
    rng = np.random.default_rng(5)
    since: set[int] = set()
    assert _steps(manager, table, rng, 2, since) == [1, 2]
    want = table.numpy().copy()
    manager.wait_until_finished()
    _h5._RECORDS.clear()  # a new process keeps nothing
    _zarr._RECORDS.clear()
    cv.reset_default_graph()
    ckpt, table = _model()
    manager = _manager(ckpt, tmp_path / "run", fmt)
    assert manager.restore_or_initialize() is not None
    assert np.array_equal(table.numpy(), want)
    reads = watch_calls(ContainerReader, "delta_rows")
    counts: list[int] = []
    for k in range(PATCHES + 2):
        before = len(reads)
        counts += _steps(manager, table, rng, 1, since)
        # the merge of patches written before the restart reads their rows (once)
        assert len(reads) - before == (2 if k == 1 else 1), (k, len(reads) - before)
    assert counts == [3, 1, 2, 3, 1], counts


def test_rows_kept_for_another_delta_are_not_taken(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str, watch_calls: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows kept that do not match the base's patches (their count or sizes) are not
    used: the merge reads them back and stays exact."""
    from ckptvar.storage._container import writer

    real = writer.ContainerWriter._known_rows
    ckpt, table = _model()
    manager = _manager(ckpt, tmp_path / "run", fmt)
    manager.save()
    rng = np.random.default_rng(7)
    since: set[int] = set()

    def off_by_one(self: Any, key: str, was: Any) -> Any:
        rows = self.base_patch_rows.get(key)
        if rows:  # a row dropped from the last patch: its size no longer matches
            self.base_patch_rows = {**self.base_patch_rows, key: (*rows[:-1], rows[-1][1:])}
        return real(self, key, was)

    monkeypatch.setattr(writer.ContainerWriter, "_known_rows", off_by_one)
    reads = watch_calls(ContainerReader, "delta_rows")
    assert _steps(manager, table, rng, PATCHES + 1, since) == [1, 2, 3, 1]
    assert len(reads) == PATCHES + 1 + 1  # each step's check, and the merge's read


def test_a_merged_patchs_rows_are_the_union_or_none_past_the_limit() -> None:
    """``merged`` (by a mask of the value's rows, or sorted) gives exactly the union of
    the rows changed now and those of the earlier patches (repeats among them), and
    None exactly when that union is more than half the share the limits allow."""
    from ckptvar.storage._container.delta import DeltaLimits, merged

    rng = np.random.default_rng(11)
    for trial in range(300):
        nrows = int(rng.integers(2, 5000))
        parts = [np.unique(rng.integers(0, nrows, int(rng.integers(0, 60))))
                 for _ in range(int(rng.integers(1, 6)))]
        rows = np.unique(rng.integers(0, nrows, int(rng.integers(1, 60))))
        before = np.concatenate(parts)
        limits = DeltaLimits(float(rng.choice([0.05, 0.25, 1.0])))
        want = np.union1d(before, rows)
        got = merged(rows, before, nrows, limits)
        if want.size <= limits.rows * nrows / 2:
            assert got is not None and got.dtype == np.int64, trial
            assert np.array_equal(got, want), trial
        else:
            assert got is None, trial
    assert merged(np.array([1]), None, 10) is None  # the earlier rows not known
