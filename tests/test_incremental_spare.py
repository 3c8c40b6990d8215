"""An incremental Zarr manager takes its pruned step over as the next save's staging
directory: the array directories it shares with the base by hard link stay as they are.

Every step written so stays complete (ckptvar and plain zarr-python read each value by
name, bit-exact), the spare holds no byte of its own between saves, and a spare that is
gone (reclaimed by ``gc``, another manager) only makes the next save write as usual.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv

zarr = pytest.importorskip("zarr")


def _model(n: int = 6) -> tuple[dict[str, cv.Variable], cv.Checkpoint]:
    rng = np.random.default_rng(0)
    frozen = {f"l{i}": cv.Variable(rng.random(1000 + i, dtype=np.float32), name=f"l{i}")
              for i in range(n)}
    head = cv.Variable(rng.random(500, dtype=np.float32), name="head")
    variables = {**frozen, "head": head}
    ckpt = cv.Checkpoint(backbone=cv.Checkpoint(**frozen), head=head)
    return variables, ckpt


def _spares(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(".partial")]


def _check_step(path: str, expect: dict[str, np.ndarray]) -> None:
    """Every value by ckptvar and by plain zarr-python, bit-exact."""
    got = cv.load(path)
    group = zarr.open_group(path, mode="r")
    for name, value in expect.items():
        key = "head" if name == "head" else f"backbone/{name}"
        np.testing.assert_array_equal(got[key], value)
        np.testing.assert_array_equal(np.asarray(group[key][...]), value)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_takes_the_pruned_step_over(tmp_path: Path, async_save: bool) -> None:
    with cv.Graph().as_default():
        variables, ckpt = _model()
        manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2, format="zarr",
                                       incremental=True, async_save=async_save)
        expect: dict[str, dict[str, np.ndarray]] = {}
        dirs: dict[str, int] = {}
        spare_of: str | None = None  # the step pruned by the save before: this one's spare
        for step in range(6):
            variables["head"].assign_add(1.0)
            before = {Path(p).name for p in manager.checkpoints}
            path = manager.save()
            assert path is not None
            ckpt.wait()
            expect[Path(path).name] = {k: v.numpy().copy() for k, v in variables.items()}
            if spare_of is not None:  # a frozen value's directory is the spare's own
                assert os.stat(Path(path) / "backbone" / "l0").st_ino == dirs[spare_of]
            pruned = before - {Path(p).name for p in manager.checkpoints}
            spare_of = pruned.pop() if pruned else None
            dirs[Path(path).name] = os.stat(Path(path) / "backbone" / "l0").st_ino
            for kept in manager.checkpoints:
                _check_step(kept, expect[Path(kept).name])
            # between saves, once the pruned step's bytes are freed (in the background):
            # at most one spare, holding only hard links of kept files
            manager.wait_until_finished()
            spares = _spares(tmp_path)
            assert len(spares) == (1 if step >= 2 else 0)
            for spare in spares:
                own = [f for f in spare.rglob("*") if f.is_file() and f.stat().st_nlink < 2
                       and f.name != "zarr.json"]
                assert own == []
        result = cv.checkpoint.gc(tmp_path, dry_run=False)
        assert [Path(left.path) for left in result] == spares  # a temporary, reclaimed
        variables["head"].assign_add(1.0)
        path = manager.save()  # its spare is gone: written as usual
        assert path is not None
        ckpt.wait()
        _check_step(path, {k: v.numpy() for k, v in variables.items()})


def test_a_changed_value_is_not_taken_from_the_spare(tmp_path: Path) -> None:
    """A frozen value that changes once is written anew; its directory in the spare
    (the older bytes) is not reused, and the steps after share the new bytes."""
    with cv.Graph().as_default():
        variables, ckpt = _model(3)
        manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1, format="zarr",
                                       incremental=True)
        for step in range(5):
            if step == 2:
                variables["l1"].assign(np.full(1001, 7.0, np.float32))
            path = manager.save()
            assert path is not None
            _check_step(path, {k: v.numpy() for k, v in variables.items()})
        manager.wait_until_finished()  # the pruned steps' bytes freed in the background
        assert len(_spares(tmp_path)) == 1
        again = cv.CheckpointManager(cv.Checkpoint(), tmp_path, max_to_keep=1, format="zarr")
        assert _spares(tmp_path) == []  # another manager reclaims it
        assert again.latest_checkpoint == path
        variables["head"].assign_add(1.0)
        path = manager.save()
        assert path is not None
        _check_step(path, {k: v.numpy() for k, v in variables.items()})


def test_a_row_deltas_arrays_are_taken_from_the_spare(tmp_path: Path) -> None:
    """A table stored as a row delta keeps, from the spare, the arrays (base, earlier
    patches) that hold the very files its step links: they are older than the save (not
    made again), and every kept step reads bit-exact through ckptvar and zarr-python,
    through appended patches, a step that carries the delta over and a merge."""
    rows, width = 8192, 64  # 2 MiB: deltas start at 1 MiB
    with cv.Graph().as_default():
        table = cv.Variable(np.random.default_rng(1).random((rows, width), dtype=np.float32),
                            name="table")
        ckpt = cv.Checkpoint(table=table)
        manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2, format="zarr",
                                       incremental=True)
        rng = np.random.default_rng(2)
        expect: dict[str, np.ndarray] = {}
        taken = made = 0
        for step in range(22):  # past MAX_PATCHES: a merge; step 6 changes nothing
            if step and step != 6:
                ids = np.unique(rng.integers(0, rows, 10))
                table.scatter_update(ids, table.numpy()[ids] + 1.0)
            time.sleep(0.03)  # what this save makes is younger than anything before
            started = time.time_ns() - 10_000_000  # the file system's clock is coarse
            path = Path(manager.save())
            expect[path.name] = table.numpy().copy()
            arrays = [d for d in (path / "table").iterdir() if d.is_dir()]
            old = sum(os.stat(d).st_ctime_ns < started for d in arrays)
            taken, made = taken + old, made + len(arrays) - old
            for kept in manager.checkpoints:
                np.testing.assert_array_equal(cv.load(kept)["table"], expect[Path(kept).name])
                if (Path(kept) / "table" / "base").is_dir():  # plain zarr sees the base
                    group = zarr.open_group(kept, mode="r")
                    assert group["table/base"].shape == (rows, width)
            manager.wait_until_finished()
        assert taken > made  # most of the base and earlier patches came from the spare


def test_a_delta_step_lists_each_base_array_once_and_reads_no_base_record(
        tmp_path: Path, watch_calls: Any) -> None:
    """A Zarr row delta step lists each of the base's arrays it links once (the spare's
    check and the links share the listing), and takes its base's record as the step
    before kept it (no reader of a step this process wrote as an incremental one); what it
    kept is what a reader reads."""
    from ckptvar.storage import _zarr

    real_reader = _zarr.ZarrReader
    listed = watch_calls(_zarr, "_regular_files")
    opened = watch_calls(_zarr, "ZarrReader")
    rows, width = 8192, 64  # 2 MiB: a row delta
    with cv.Graph().as_default():
        table = cv.Variable(np.random.default_rng(1).random((rows, width), dtype=np.float32),
                            name="table")
        manager = cv.CheckpointManager(cv.Checkpoint(table=table), tmp_path, max_to_keep=2,
                                       format="zarr", incremental=True)
        rng = np.random.default_rng(2)
        recycled = 0
        bases_read: list[str] = []
        for step in range(8):
            if step:
                ids = np.unique(rng.integers(0, rows, 10))
                table.scatter_update(ids, table.numpy()[ids] + 1.0)
            listed.clear()
            opened.clear()
            path = Path(manager.save())
            manager.wait_until_finished()
            bases_read += [Path(p).name for p in opened]
            base_dirs = [os.fspath(d) for d in listed if not Path(d).is_relative_to(path)
                         and ".partial" not in os.fspath(d)]
            assert len(base_dirs) == len(set(base_dirs)), base_dirs
            recycled += bool(base_dirs)
            np.testing.assert_array_equal(cv.load(path)["table"], table.numpy())
        assert recycled >= 4  # steps that took the spare over and checked its arrays
        assert bases_read == ["ckpt-1.zarr"]  # the first, full step, read once as a base
        latest = Path(manager.latest_checkpoint)
        kept = _zarr._RECORDS.get(latest / _zarr.RECORD_PATH / _zarr.chunk_key(1))
        assert kept is not None
        got = real_reader(latest)
        try:
            assert dict(kept.values) == dict(got.record.values)
            assert kept.deltas == got.record.deltas
        finally:
            got.close()


def test_gc_counts_the_bytes_it_frees_not_the_spares_hard_links(tmp_path: Path) -> None:
    """``ckpt gc`` on a directory holding the spare reports the bytes its removal frees:
    the spare's array files are hard links of kept steps (removing them frees nothing),
    so what it counts is the spare's own few files (its documents), not the table."""
    table = cv.Variable(np.random.default_rng(2).random((8192, 64), dtype=np.float32),
                        name="table")  # 2 MiB, unchanged: every step links its file
    ckpt = cv.Checkpoint(table=table, step=cv.Variable(0.0, name="step"))
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1, format="zarr",
                                   incremental=True)
    for _ in range(3):
        ckpt.step.assign_add(1.0)
        manager.save()
    manager.wait_until_finished()
    (spare,) = _spares(tmp_path)
    own = sum(f.stat().st_size for f in spare.rglob("*")
              if f.is_file() and f.stat().st_nlink == 1)
    assert own < 64 << 10
    (left,) = [x for x in cv.checkpoint.gc(tmp_path, dry_run=True)
               if Path(x.path).parent == tmp_path]
    assert Path(left.path) == spare
    assert left.nbytes == own
    done = subprocess.run([sys.executable, "-m", "ckptvar", "gc", os.fspath(tmp_path)],
                          capture_output=True, text=True, check=True)
    assert f"{spare}  {own} bytes" in done.stdout
    assert not spare.exists()
    assert np.array_equal(cv.load(manager.latest_checkpoint)["table"], table.numpy())


def test_gc_counts_a_file_linked_twice_inside_a_temporary_once(tmp_path: Path) -> None:
    """A temporary whose file has a second name inside the temporary itself frees that
    file's bytes when removed: counted once."""
    temp = tmp_path / ".ckpt-3.zarr.0123456789abcdef0123456789abcdef.partial"
    (temp / "a").mkdir(parents=True)
    (temp / "a" / "c").write_bytes(b"x" * 1000)
    os.link(temp / "a" / "c", temp / "a" / "d")
    kept = tmp_path / "kept.bin"
    kept.write_bytes(b"y" * 500)
    os.link(kept, temp / "e")  # a name outside: removing the temporary frees nothing
    (left,) = [x for x in cv.checkpoint.gc(tmp_path) if Path(x.path).parent == tmp_path]
    assert left.nbytes == 1000
    assert kept.read_bytes() == b"y" * 500
