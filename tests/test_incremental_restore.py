"""What a restore teaches an incremental manager (docs/checkpoints.md, "What a restore
teaches the next save"): after a restart (a new process, or a new ``cv.Checkpoint`` over
new variables), ``restore_or_initialize()`` or ``ckpt.restore(manager.latest_checkpoint)``
makes the next save incremental like any other, and so does a restore made before the
manager was built (TensorFlow's order): an unchanged row delta is carried over,
rows touched since the restore are a patch of exactly those rows, frozen values are
shared without being hashed. A cast restore, a restore of an older step or of another
directory's, a failed restore and writes between a restore and the manager's creation
teach nothing that is not so: the values are then compared or written whole, and every
step reads back bit-exact."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import CheckpointMismatchError
from ckptvar.storage._container import blocks as blocks_mod
from ckptvar.storage._container import writer as writer_mod

ROWS, WIDTH = 8192, 64  # a 2 MiB float32 table (deltas start at 1 MiB)
TABLE = ROWS * WIDTH * 4
SMALL = 64 << 10  # what a step of nothing but its record and structure adds, at most

# The first run: step 1 whole, step 2 a row delta of 3 rows on it (also run as a process).
FIRST_RUN = textwrap.dedent("""
    import sys
    import numpy as np
    import ckptvar as cv

    def model():
        rng = np.random.default_rng(0)
        table = cv.Variable(rng.random((8192, 64), dtype=np.float32), name="table")
        frozen = cv.Variable(rng.random((8192, 64), dtype=np.float32), name="frozen",
                             trainable=False)
        return cv.Checkpoint(table=table, frozen=frozen), table

    def first_run(directory, fmt):
        ckpt, table = model()
        manager = cv.CheckpointManager(ckpt, directory, format=fmt, max_to_keep=3,
                                       incremental=True)
        manager.save()
        table.scatter_update(np.array([5, 600, 7000]), np.full((3, 64), 9.0, np.float32))
        return manager.save()

    if __name__ == "__main__":
        print(first_run(sys.argv[1], sys.argv[2]))
""")
_NS: dict[str, Any] = {}
exec(compile(FIRST_RUN, "first_run", "exec"), _NS)  # this file's own code
_model, _first_run = _NS["model"], _NS["first_run"]


def _added(step: str | Path) -> int:
    """Bytes a step holds of its own (hard-linked files are shared)."""
    step = Path(step)
    if step.is_file():
        return step.stat().st_size
    return sum(p.stat().st_size for p in step.rglob("*") if p.is_file() and p.stat().st_nlink == 1)


def _watch_whole_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of each view the writer hashes whole (``hash_blocks``) from here on."""
    hashed: list[int] = []
    real = blocks_mod.hash_blocks

    def counting(view: Any, seed: int, block_size: int = blocks_mod.BLOCK_SIZE) -> Any:
        hashed.append(len(view))
        return real(view, seed, block_size)

    for mod in (blocks_mod, writer_mod):
        monkeypatch.setattr(mod, "hash_blocks", counting)
    return hashed


def _restart(d: Path, fmt: str, how: str, **options: Any
             ) -> tuple[cv.CheckpointManager, cv.Checkpoint, cv.Variable]:
    """A new checkpoint over new variables (other initial values), its manager, restored."""
    ckpt, table = _model()
    ckpt.table.assign(np.zeros((ROWS, WIDTH), np.float32))
    ckpt.frozen.assign(np.zeros((ROWS, WIDTH), np.float32))
    manager = cv.CheckpointManager(ckpt, d, format=fmt, max_to_keep=3, **options)
    if how == "restore_or_initialize":
        assert manager.restore_or_initialize() == manager.latest_checkpoint
    else:  # what TensorFlow users write
        ckpt.restore(manager.latest_checkpoint).assert_consumed()
    return manager, ckpt, table


def _check(step: str, ckpt: cv.Checkpoint) -> None:
    got = cv.load(step)
    for key in ("table", "frozen"):
        assert np.array_equal(got[key], getattr(ckpt, key).numpy()), key


@pytest.mark.parametrize("how", ["restore_or_initialize", "restore"])
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_after_a_restart_an_unchanged_delta_is_carried_over(
        tmp_path: Path, fmt: str, how: str, fresh_graph: cv.Graph) -> None:
    d = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", FIRST_RUN, str(d), fmt],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    manager, ckpt, _ = _restart(d, fmt, how, incremental=True)
    step = manager.save()  # nothing changed since the restore
    assert _added(step) < SMALL, _added(step)  # neither the table nor the frozen value
    with cv.open(step) as r:
        assert r.deltas() == {"table": {"base": f"ckpt-1.{fmt}", "patches": 1, "rows": 3}}
        assert r.delta_rows("table").tolist() == [5, 600, 7000]
    _check(step, ckpt)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_rows_touched_after_a_restore_are_a_patch_of_exactly_those_rows(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    d = tmp_path / "run"
    _first_run(d, fmt)
    manager, ckpt, table = _restart(d, fmt, "restore_or_initialize", incremental=True)
    touched = np.array([1, 2000, 4096, 8191])
    table.scatter_add(touched, np.ones((4, WIDTH), np.float32))
    step = manager.save()
    assert _added(step) < SMALL + touched.size * WIDTH * 4
    with cv.open(step) as r:
        assert r.deltas() == {"table": {"base": f"ckpt-1.{fmt}", "patches": 2, "rows": 7}}
        assert r.delta_rows("table").tolist() == [1, 5, 600, 2000, 4096, 7000, 8191]
        assert [p[3] for p in r.record.deltas["table"].patches] == [3, 4]  # this step's: 4
    _check(step, ckpt)
    fresh, _ = _model()
    fresh.restore(step).assert_consumed()  # every reader path: bit-exact
    assert np.array_equal(fresh.table.numpy(), table.numpy())


@pytest.mark.parametrize("how", ["restore_or_initialize", "restore"])
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_restored_frozen_values_are_shared_without_being_hashed(
        tmp_path: Path, fmt: str, how: str, fresh_graph: cv.Graph,
        monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "run"
    _first_run(d, fmt)
    manager, ckpt, table = _restart(d, fmt, how, incremental=True)
    table.scatter_update(np.array([3]), np.zeros((1, WIDTH), np.float32))
    hashed = _watch_whole_hashes(monkeypatch)
    step = manager.save()
    assert all(n < TABLE // 2 for n in hashed), hashed  # neither 2 MiB value hashed
    with cv.open(step) as r:
        assert "frozen" in r.shared()
    _check(step, ckpt)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_value_restored_on_create_is_known_from_its_creation(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """A variable created after the restore (restore on create), born from a callable
    initializer that never runs: known unchanged, its delta carried over."""
    d = tmp_path / "run"
    src = cv.Module(name="m")
    src.table = cv.Variable(np.random.default_rng(1).random((ROWS, WIDTH), dtype=np.float32),
                            name="table")
    first = cv.CheckpointManager(cv.Checkpoint(model=src), d, format=fmt, incremental=True)
    first.save()
    src.table.scatter_update(np.array([10, 20]), np.ones((2, WIDTH), np.float32))
    first.save()
    with cv.Graph().as_default():
        model = cv.Module(name="m")
        manager = cv.CheckpointManager(cv.Checkpoint(model=model), d, format=fmt,
                                       incremental=True)
        manager.restore_or_initialize()
        model.table = cv.Variable(lambda: np.zeros((ROWS, WIDTH), np.float32),
                                  shape=(ROWS, WIDTH), dtype="float32", name="table")
        step = manager.save()
    assert _added(step) < SMALL, _added(step)
    with cv.open(step) as r:
        assert r.deltas()["model/table"]["patches"] == 1
        assert np.array_equal(r["model/table"].read(), src.table.numpy())


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_cast_restore_teaches_only_the_values_not_cast(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph,
        monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "run"
    _first_run(d, fmt)
    table = cv.Variable(np.zeros((ROWS, WIDTH), np.float64), name="table")  # stored float32
    frozen = cv.Variable(np.zeros((ROWS, WIDTH), np.float32), name="frozen")
    ckpt = cv.Checkpoint(table=table, frozen=frozen)
    manager = cv.CheckpointManager(ckpt, d, format=fmt, max_to_keep=3, incremental=True)
    with pytest.warns(UserWarning, match="table"):
        ckpt.restore(manager.latest_checkpoint, cast=True).assert_consumed()
    restored = ckpt.last_restore()
    assert restored is not None and set(restored.versions) == {"frozen", "save_counter"}
    hashed = _watch_whole_hashes(monkeypatch)
    step = manager.save()
    assert TABLE not in hashed  # the frozen value (the table is twice that now)
    with cv.open(step) as r:
        assert "table" not in r.deltas()  # float64 now: written whole, never the old bytes
        assert r["table"].dtype == np.float64
        assert "frozen" in r.shared()  # known unchanged: shared unhashed
    assert _added(step) >= 2 * TABLE
    _check(step, ckpt)


@pytest.mark.parametrize("which", ["older", "elsewhere"])
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_restore_of_a_step_not_the_latest_knows_nothing(
        tmp_path: Path, fmt: str, which: str, fresh_graph: cv.Graph,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a restore teaches holds for the restored step only: the next save builds on
    the latest step, so every value is compared by its checksums (an unchanged one is
    shared, hashed), and the table, a delta there, is written whole once."""
    d = tmp_path / "run"
    older = _first_run(d, fmt)  # step 2
    ckpt0, table0 = _model()
    manager0 = cv.CheckpointManager(ckpt0, d, format=fmt, max_to_keep=3, incremental=True)
    manager0.restore_or_initialize()
    table0.scatter_update(np.array([77]), np.full((1, WIDTH), 5.0, np.float32))
    manager0.save()  # step 3: the latest
    source = older
    if which == "elsewhere":  # the same name, another directory: not this manager's step
        other = tmp_path / "copy"
        _first_run(other, fmt)
        table0.scatter_update(np.array([1]), np.zeros((1, WIDTH), np.float32))
        source = cv.CheckpointManager(ckpt0, other, format=fmt, max_to_keep=3,
                                      incremental=True).save(checkpoint_number=3)
        assert Path(source).name == f"ckpt-3.{fmt}"  # the name of this manager's latest
    ckpt, _ = _model()
    manager = cv.CheckpointManager(ckpt, d, format=fmt, max_to_keep=3, incremental=True)
    ckpt.restore(source).assert_consumed()
    hashed = _watch_whole_hashes(monkeypatch)
    step = manager.save()  # its base: this manager's latest, ckpt-3
    assert sum(hashed) >= 2 * TABLE  # both values compared (hashed)
    with cv.open(step) as r:
        assert "table" not in r.deltas()
        assert "frozen" in r.shared()  # unchanged: found so by its checksums
    _check(step, ckpt)
    assert np.array_equal(cv.load(step)["table"], cv.load(source)["table"])


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_failed_restore_teaches_nothing(tmp_path: Path, fmt: str,
                                          fresh_graph: cv.Graph) -> None:
    d = tmp_path / "run"
    _first_run(d, fmt)
    table = cv.Variable(np.zeros((ROWS, WIDTH), np.float32), name="table")
    frozen = cv.Variable(np.zeros((ROWS, WIDTH // 2), np.float32), name="frozen")  # mismatch
    ckpt = cv.Checkpoint(table=table, frozen=frozen)
    manager = cv.CheckpointManager(ckpt, d, format=fmt, max_to_keep=3, incremental=True)
    with pytest.raises(CheckpointMismatchError):
        manager.restore_or_initialize()
    assert ckpt.last_restore() is None
    assert not table.numpy().any()  # nothing changed: its own zeros, not the stored rows
    step = manager.save()
    with cv.open(step) as r:
        assert "table" not in r.deltas() and "table" not in r.shared()
    assert _added(step) >= TABLE
    _check(step, ckpt)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_whole_every_still_writes_a_restarted_managers_first_step_whole(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """A manager that cannot know when the last whole step was writes its first step
    whole when ``whole_every`` is set, restored or not; the next one is a delta again."""
    d = tmp_path / "run"
    _first_run(d, fmt)
    opts = cv.IncrementalOptions(whole_every=4)
    manager, ckpt, table = _restart(d, fmt, "restore_or_initialize", incremental=opts)
    step = manager.save()
    assert _added(step) >= 2 * TABLE
    with cv.open(step) as r:
        assert r.deltas() == {} and r.shared() == {}
    table.scatter_update(np.array([9]), np.ones((1, WIDTH), np.float32))
    step = manager.save()
    assert _added(step) < SMALL
    with cv.open(step) as r:
        assert r.deltas()["table"]["rows"] == 1
    _check(step, ckpt)


def test_a_torch_modules_weights_written_in_place_are_saved(tmp_path: Path) -> None:
    """Torch writes a module's tensors in place (an optimizer step), unseen by the
    variables over their memory: an incremental step compares them by their checksums
    (it used to share the stale bytes of the last step), restored or not."""
    torch = pytest.importorskip("torch")
    module = torch.nn.Linear(256, 256)
    ckpt = cv.Checkpoint(model=module)
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", incremental=True)
    manager.save()
    for restore in (False, True):
        if restore:
            ckpt.restore(manager.latest_checkpoint).assert_consumed()
        with torch.no_grad():
            module.weight.add_(1.0)
        step = manager.save()
        got = cv.load(step)
        assert np.array_equal(got["model/weight"], module.weight.detach().numpy())
        with cv.open(step) as r:
            assert "model/weight" not in r.shared()
            assert r.shared()["model/bias"] == ["ckpt-1.h5"]  # unchanged: by checksums


def test_restore_or_initialize_past_a_damaged_newest_step_knows_nothing(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """``restore_or_initialize()`` skips a damaged newest step and restores the one
    before: the next save takes nothing from the damaged newest (still listed), whose
    recorded checksums may name lost bytes (the test below): it is written whole and
    bit-exact, and the save after it builds on it again. Zarr: a patch's chunk file is
    damaged in place (its own file, not linked elsewhere)."""
    d = tmp_path / "run"
    _first_run(d, "zarr")
    ckpt0, table0 = _model()
    manager0 = cv.CheckpointManager(ckpt0, d, format="zarr", max_to_keep=3,
                                    incremental=True)
    manager0.restore_or_initialize()
    table0.scatter_update(np.array([77]), np.full((1, WIDTH), 5.0, np.float32))
    newest = Path(manager0.save())
    own = [f for f in newest.rglob("c.*") if "patch" in f.parent.name
           and f.stat().st_nlink == 1]  # this step's patch's chunk
    assert own
    data = bytearray(own[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    own[0].write_bytes(bytes(data))
    ckpt, _ = _model()
    manager = cv.CheckpointManager(ckpt, d, format="zarr", max_to_keep=3, incremental=True)
    assert Path(manager.restore_or_initialize()).name == "ckpt-2.zarr"
    assert [Path(p).name for p, _ in manager.skipped] == ["ckpt-3.zarr"]
    step = manager.save()
    with cv.open(step) as r:
        assert not r.deltas() and not r.shared()
    _check(step, ckpt)
    after = manager.save()
    with cv.open(after) as r:
        assert {"table", "frozen"} <= set(r.shared())
    _check(after, ckpt)


def test_a_zarr_step_restored_by_a_path_ending_in_a_slash_teaches_the_same(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """A Zarr step is a directory, often named with a trailing ``/`` (shell completion):
    its directory was taken as the step itself, so the restore taught nothing and the
    first save wrote every value whole."""
    d = tmp_path / "run"
    _first_run(d, "zarr")
    ckpt, _ = _model()
    manager = cv.CheckpointManager(ckpt, d, format="zarr", max_to_keep=3, incremental=True)
    ckpt.restore(f"{manager.latest_checkpoint}/").assert_consumed()
    step = manager.save()  # nothing changed since the restore
    assert _added(step) < SMALL, _added(step)
    _check(step, ckpt)


# -- a restore made before the incremental manager was built (TensorFlow's order) --------

def _restore_first(d: Path, fmt: str, source: str | Path | None = None,
                   between: Any = None) -> tuple[cv.CheckpointManager, cv.Checkpoint,
                                                 cv.Variable]:
    """A new checkpoint over new variables, restored from ``source`` (default: ``d``'s
    latest step) BEFORE its incremental manager is built; ``between(ckpt)`` runs after
    the restore, before the manager exists."""
    ckpt, table = _model()
    ckpt.table.assign(np.zeros((ROWS, WIDTH), np.float32))
    ckpt.frozen.assign(np.zeros((ROWS, WIDTH), np.float32))
    status = ckpt.restore(source if source is not None else cv.latest_checkpoint(d))
    status.assert_consumed()
    if between is not None:
        between(ckpt)
    manager = cv.CheckpointManager(ckpt, d, format=fmt, max_to_keep=3, incremental=True)
    return manager, ckpt, table


def _check_kept(manager: cv.CheckpointManager, values: dict[str, dict[str, np.ndarray]]
                ) -> None:
    """Every kept step restores bit-exact into new variables (``values``: step name ->
    key -> the value it was saved with), and loads so plainly."""
    for path in manager.checkpoints:
        want = values.get(Path(path).name)
        if want is None:
            continue
        fresh, _ = _model()
        fresh.restore(path).assert_consumed()
        got = cv.load(path)
        for key, value in want.items():
            assert np.array_equal(getattr(fresh, key).numpy(), value), (path, key)
            assert np.array_equal(got[key], value), (path, key)


def _saved(manager: cv.CheckpointManager, ckpt: cv.Checkpoint,
           values: dict[str, dict[str, np.ndarray]]) -> str:
    step = manager.save()
    values[Path(step).name] = {k: getattr(ckpt, k).numpy() for k in ("table", "frozen")}
    return step


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_restore_before_the_manager_teaches_its_first_save(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``status = ckpt.restore(latest)``, then ``manager = CheckpointManager(ckpt, ...)``:
    as in the manager-first order, an unchanged step carries the delta over and shares
    the frozen value unhashed, and rows touched once the manager exists are a patch of
    exactly those rows (it used to write both 2 MiB values whole)."""
    d = tmp_path / "run"
    _first_run(d, fmt)
    manager, ckpt, table = _restore_first(d, fmt)
    hashed = _watch_whole_hashes(monkeypatch)
    values: dict[str, dict[str, np.ndarray]] = {}
    step = _saved(manager, ckpt, values)  # nothing changed since the restore
    assert _added(step) < SMALL, _added(step)
    with cv.open(step) as r:
        assert r.deltas() == {"table": {"base": f"ckpt-1.{fmt}", "patches": 1, "rows": 3}}
        assert "frozen" in r.shared()
    touched = np.array([1, 2000, 4096, 8191])
    table.scatter_add(touched, np.ones((4, WIDTH), np.float32))
    step = _saved(manager, ckpt, values)
    assert _added(step) < SMALL + touched.size * WIDTH * 4, _added(step)
    assert all(n < TABLE // 2 for n in hashed), hashed  # neither 2 MiB value hashed
    with cv.open(step) as r:
        assert r.deltas() == {"table": {"base": f"ckpt-1.{fmt}", "patches": 2, "rows": 7}}
        assert r.delta_rows("table").tolist() == [1, 5, 600, 2000, 4096, 7000, 8191]
        assert "frozen" in r.shared()
    _check_kept(manager, values)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_value_assigned_whole_before_the_manager_existed_is_written_whole(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A table assigned whole between the restore and the manager's creation is
    changed: written whole (never the restored step's bytes); the frozen value, still
    as restored, is shared unhashed."""
    d = tmp_path / "run"
    _first_run(d, fmt)
    new = np.random.default_rng(5).random((ROWS, WIDTH), dtype=np.float32)
    manager, ckpt, _ = _restore_first(d, fmt, between=lambda c: c.table.assign(new))
    hashed = _watch_whole_hashes(monkeypatch)
    values: dict[str, dict[str, np.ndarray]] = {}
    step = _saved(manager, ckpt, values)
    assert TABLE not in hashed or hashed.count(TABLE) == 1, hashed  # the frozen one unhashed
    assert _added(step) >= TABLE
    with cv.open(step) as r:
        assert "table" not in r.deltas() and "table" not in r.shared()
        assert "frozen" in r.shared()
    assert np.array_equal(cv.load(step)["table"], new)
    _check_kept(manager, values)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_rows_scattered_before_the_manager_existed_are_never_stale(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows written between the restore and the manager's creation are not tracked
    (tracking starts with the manager): the first save writes the table whole, never a
    patch missing them; the frozen value is shared unhashed; the next save is a patch of
    the rows touched since. Every kept step restores bit-exact."""
    d = tmp_path / "run"
    _first_run(d, fmt)
    early = np.array([11, 5000])

    def scatter(ckpt: cv.Checkpoint) -> None:
        ckpt.table.scatter_update(early, np.full((2, WIDTH), 3.0, np.float32))

    manager, ckpt, table = _restore_first(d, fmt, between=scatter)
    table.scatter_update(np.array([42]), np.full((1, WIDTH), 4.0, np.float32))
    hashed = _watch_whole_hashes(monkeypatch)
    values: dict[str, dict[str, np.ndarray]] = {}
    step = _saved(manager, ckpt, values)
    assert hashed.count(TABLE) <= 1, hashed  # the frozen value known unchanged: unhashed
    with cv.open(step) as r:
        assert "frozen" in r.shared()
        if "table" in r.deltas():  # a patch must hold every row written since the restore
            assert set(early.tolist()) | {42} <= set(r.delta_rows("table").tolist())
    assert np.array_equal(cv.load(step)["table"][early], np.full((2, WIDTH), 3.0, np.float32))
    table.scatter_update(np.array([7]), np.full((1, WIDTH), 6.0, np.float32))
    step = _saved(manager, ckpt, values)
    assert _added(step) < SMALL, _added(step)
    with cv.open(step) as r:
        assert r.deltas()["table"]["rows"] >= 1
        assert 7 in r.delta_rows("table").tolist()
    _check_kept(manager, values)


@pytest.mark.parametrize("which", ["older", "elsewhere", "cast"])
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_restore_before_the_manager_teaches_only_what_is_so(
        tmp_path: Path, fmt: str, which: str, fresh_graph: cv.Graph,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Restored before the manager existed: a step not the manager's latest (an older
    one, or one of the same name in another directory) teaches nothing (both values
    compared by their checksums, the table written whole); a cast restore teaches only
    the values not cast (the frozen value shared unhashed)."""
    d = tmp_path / "run"
    older = _first_run(d, fmt)  # step 2
    ckpt0, table0 = _model()
    manager0 = cv.CheckpointManager(ckpt0, d, format=fmt, max_to_keep=3, incremental=True)
    manager0.restore_or_initialize()
    table0.scatter_update(np.array([77]), np.full((1, WIDTH), 5.0, np.float32))
    manager0.save()  # step 3: the latest
    if which == "cast":
        table = cv.Variable(np.zeros((ROWS, WIDTH), np.float64), name="table")
        ckpt = cv.Checkpoint(table=table, frozen=cv.Variable(
            np.zeros((ROWS, WIDTH), np.float32), name="frozen"))
        with pytest.warns(UserWarning, match="table"):
            ckpt.restore(cv.latest_checkpoint(d), cast=True).assert_consumed()
        manager = cv.CheckpointManager(ckpt, d, format=fmt, max_to_keep=3, incremental=True)
        restored = ckpt.last_restore()
        assert restored is not None and set(restored.versions) == {"frozen", "save_counter"}
        hashed = _watch_whole_hashes(monkeypatch)
        step = manager.save()
        assert TABLE not in hashed
        with cv.open(step) as r:
            assert "table" not in r.deltas() and r["table"].dtype == np.float64
            assert "frozen" in r.shared()
        _check(step, ckpt)
        return
    source: str | Path = older
    if which == "elsewhere":  # the same name, another directory: not this manager's step
        other = tmp_path / "copy"
        _first_run(other, fmt)
        table0.scatter_update(np.array([1]), np.zeros((1, WIDTH), np.float32))
        source = cv.CheckpointManager(ckpt0, other, format=fmt, max_to_keep=3,
                                      incremental=True).save(checkpoint_number=3)
        assert Path(source).name == f"ckpt-3.{fmt}"
    manager, ckpt, _ = _restore_first(d, fmt, source=source)
    hashed = _watch_whole_hashes(monkeypatch)
    step = manager.save()  # its base: this manager's latest, ckpt-3
    assert sum(hashed) >= 2 * TABLE  # both values compared (hashed)
    with cv.open(step) as r:
        assert "table" not in r.deltas()
        assert "frozen" in r.shared()  # unchanged: found so by its checksums
    _check(step, ckpt)
    assert np.array_equal(cv.load(step)["table"], cv.load(source)["table"])


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_value_restored_on_create_before_the_manager_is_known(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """The restore comes first, the variable is created after it (restored on create,
    not materialised: its initializer never runs), the manager last: the variable is
    known unchanged, its delta carried over, and a row touched then is a patch."""
    d = tmp_path / "run"
    src = cv.Module(name="m")
    src.table = cv.Variable(np.random.default_rng(1).random((ROWS, WIDTH), dtype=np.float32),
                            name="table")
    first = cv.CheckpointManager(cv.Checkpoint(model=src), d, format=fmt, incremental=True)
    first.save()
    src.table.scatter_update(np.array([10, 20]), np.ones((2, WIDTH), np.float32))
    first.save()
    with cv.Graph().as_default():
        model = cv.Module(name="m")
        ckpt = cv.Checkpoint(model=model)
        ckpt.restore(cv.latest_checkpoint(d))
        model.table = cv.Variable(lambda: np.zeros((ROWS, WIDTH), np.float32),
                                  shape=(ROWS, WIDTH), dtype="float32", name="table")
        manager = cv.CheckpointManager(ckpt, d, format=fmt, incremental=True)
        step = manager.save()
        assert _added(step) < SMALL, _added(step)
        with cv.open(step) as r:
            assert r.deltas()["model/table"]["patches"] == 1
        model.table.scatter_update(np.array([30]), np.full((1, WIDTH), 2.0, np.float32))
        step = manager.save()
        assert _added(step) < SMALL, _added(step)
        with cv.open(step) as r:
            assert r.deltas()["model/table"] == {"base": f"ckpt-1.{fmt}", "patches": 2,
                                                 "rows": 3}
        want = model.table.numpy()
    assert np.array_equal(cv.load(step)["model/table"], want)
    assert np.array_equal(want[[10, 20]], np.ones((2, WIDTH), np.float32))


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_value_written_through_its_buffer_before_the_manager_is_saved_as_it_is(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """``value()`` hands the buffer out between the restore and the manager's creation,
    and the user writes rows through it, unseen: the note forgets the table (its
    version is unknown), so it is compared, here written whole, never patched stale; a
    failed restore after a good one leaves the good one's note."""
    d = tmp_path / "run"
    _first_run(d, fmt)

    def write_through(ckpt: cv.Checkpoint) -> None:
        ckpt.table.value()[100:102] = 8.0
        bad = cv.Checkpoint(table=ckpt.table, frozen=cv.Variable(
            np.zeros((ROWS, WIDTH // 2), np.float32), name="frozen"))  # mismatch
        with pytest.raises(CheckpointMismatchError):
            bad.restore(cv.latest_checkpoint(d))

    manager, ckpt, table = _restore_first(d, fmt, between=write_through)
    restored = ckpt.last_restore()
    assert restored is not None and "table" not in restored.versions
    assert "frozen" in restored.versions
    step = manager.save()
    with cv.open(step) as r:
        assert "table" not in r.deltas() and "frozen" in r.shared()
    got = cv.load(step)["table"]
    assert np.array_equal(got[100:102], np.full((2, WIDTH), 8.0, np.float32))
    assert np.array_equal(got, table.numpy())


def test_a_note_lets_a_dropped_variable_go(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """A note holds weak references: a variable dropped after the restore is freed, and
    the manager built later forgets its key (compared by checksums, if it comes back)."""
    import gc
    import weakref

    d = tmp_path / "run"
    _first_run(d, "h5")
    ckpt, _ = _model()
    ckpt.restore(cv.latest_checkpoint(d)).assert_consumed()
    gone = weakref.ref(ckpt.frozen)
    del ckpt.frozen
    gc.collect()
    assert gone() is None
    cv.CheckpointManager(ckpt, d, format="h5", max_to_keep=3, incremental=True)
    restored = ckpt.last_restore()
    assert restored is not None and set(restored.versions) == {"table", "save_counter"}


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_partitioned_variable_restored_before_the_manager_is_patched(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """A partitioned variable (saved as one value) restored before the manager was built:
    each part's rows are tracked from the manager's creation, so a row touched in one
    part then is a patch on the restored step's delta."""
    d = tmp_path / "run"

    def model() -> tuple[cv.Checkpoint, Any]:
        with cv.variable_scope("emb", partitioner=cv.fixed_size_partitioner(2)):
            part = cv.get_variable("part", shape=(ROWS, WIDTH))
        return cv.Checkpoint(part=part), part

    with cv.Graph().as_default():
        ckpt, part = model()
        for p in part:
            p.assign(np.random.default_rng(0).random(p.shape, dtype=np.float32))
        first = cv.CheckpointManager(ckpt, d, format=fmt, incremental=True)
        first.save()
        next(iter(part)).scatter_update([3], np.ones((1, WIDTH), np.float32))
        first.save()
    ckpt, part = model()
    ckpt.restore(cv.latest_checkpoint(d)).assert_consumed()
    manager = cv.CheckpointManager(ckpt, d, format=fmt, incremental=True)
    list(part)[1].scatter_update([7], np.full((1, WIDTH), 2.0, np.float32))
    step = manager.save()
    assert _added(step) < SMALL, _added(step)
    with cv.open(step) as r:
        assert r.deltas() == {"part": {"base": f"ckpt-1.{fmt}", "patches": 2, "rows": 2}}
    assert np.array_equal(cv.load(step)["part"], np.asarray(part))


def _lose_the_frozen_bytes(d: Path, fmt: str) -> None:
    """The frozen value's bytes, shared by every step, are lost: HDF5: the step file
    holding them is gone; Zarr: its chunk file (one inode in every step) damaged in place."""
    if fmt == "h5":
        (d / "ckpt-1.h5").unlink()
        return
    chunk = next((d / "ckpt-1.zarr" / "frozen").glob("c.*"))
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_save_after_restore_or_initialize_skipped_the_newest_does_not_refer_to_it(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str) -> None:
    """Every step shares the frozen value's bytes, which are lost: restore_or_initialize()
    skips every step and initializes. The next save must not take the frozen value from
    the newest (damaged) step by its recorded checksums: it writes it, and the step loads."""
    d = tmp_path / "run"
    _first_run(d, fmt)
    _lose_the_frozen_bytes(d, fmt)
    ckpt, table = _model()  # the same initial values: the frozen value's checksum matches
    manager = cv.CheckpointManager(ckpt, d, format=fmt, max_to_keep=3, incremental=True)
    assert manager.restore_or_initialize() is None
    assert Path(manager.skipped[0][0]).name == f"ckpt-2.{fmt}"
    table.scatter_update(np.array([1]), np.full((1, WIDTH), 3.0, np.float32))
    step = manager.save()
    _check(step, ckpt)
    table.scatter_update(np.array([2]), np.full((1, WIDTH), 4.0, np.float32))
    after = manager.save()  # and the steps after it build on it again
    _check(after, ckpt)
    with cv.open(after) as r:
        assert "frozen" in r.shared()


@pytest.mark.parametrize("order", ["manager_first", "restore_first"])
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_save_after_a_failed_restore_of_the_newest_does_not_refer_to_it(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str, order: str) -> None:
    """The user restores the latest step themselves, it fails (its frozen bytes are
    lost), they carry on from fresh values: the next save must not take the frozen value
    from that step by its recorded checksums (the step would name the lost bytes)."""
    d = tmp_path / "run"
    _first_run(d, fmt)
    _lose_the_frozen_bytes(d, fmt)
    ckpt, table = _model()  # the same initial values: the frozen value's checksum matches
    latest = cv.latest_checkpoint(d)
    assert latest is not None
    manager = None
    if order == "manager_first":
        manager = cv.CheckpointManager(ckpt, d, format=fmt, max_to_keep=3, incremental=True)
    with pytest.raises(cv.CkptError):
        ckpt.restore(latest)
    assert ckpt.failed_restores() == {latest}
    if manager is None:
        manager = cv.CheckpointManager(ckpt, d, format=fmt, max_to_keep=3, incremental=True)
    table.scatter_update(np.array([1]), np.full((1, WIDTH), 3.0, np.float32))
    step = manager.save()
    _check(step, ckpt)
    with cv.open(step) as r:
        assert not r.shared() and not r.deltas()
    table.scatter_update(np.array([2]), np.full((1, WIDTH), 4.0, np.float32))
    after = manager.save()  # and the steps after it build on it again
    _check(after, ckpt)
    with cv.open(after) as r:
        assert "frozen" in r.shared()


def test_a_restore_that_failed_by_a_mismatch_or_later_succeeded_is_not_held_against_it(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """A mismatch is the objects' fault, not the step's; a later good restore of the
    same path takes a failure off: neither stops the next save from building on it."""
    d = tmp_path / "run"
    latest = _first_run(d, "h5")
    wrong = cv.Checkpoint(table=cv.Variable(np.zeros((3, WIDTH), np.float32), name="table"))
    with pytest.raises(cv.CheckpointMismatchError):
        wrong.restore(latest)
    assert wrong.failed_restores() == frozenset()
    ckpt, table = _model()
    with pytest.raises(cv.CkptError):
        ckpt.restore(d / "no-such-step.h5")
    assert ckpt.failed_restores() == {os.fspath(d / "no-such-step.h5")}
    os.rename(latest, d / "aside.h5")
    with pytest.raises(cv.CkptError):
        ckpt.restore(latest)
    os.rename(d / "aside.h5", latest)
    ckpt.restore(latest).assert_consumed()
    assert ckpt.failed_restores() == {os.fspath(d / "no-such-step.h5")}
    manager = cv.CheckpointManager(ckpt, d, format="h5", max_to_keep=3, incremental=True)
    table.scatter_update(np.array([1]), np.full((1, WIDTH), 3.0, np.float32))
    step = manager.save()
    assert _added(step) < SMALL, _added(step)
    _check(step, ckpt)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_restore_by_a_relative_path_means_the_directory_it_was_made_in(
        tmp_path: Path, fresh_graph: cv.Graph, fmt: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step restored by a path relative to the working directory, which changes before
    the save: the step restored is the one of the directory the restore was made in (here
    another run's step of the same name), not the manager's, so the save shares none of
    the manager's step's bytes: it saved the manager's value in place of the one the
    variable held."""
    suffix = f".{fmt}"
    for run, value in (("mine", 1.0), ("other", 2.0)):
        frozen = cv.Variable(np.full(300_000, value, np.float32), name="frozen")
        cv.CheckpointManager(cv.Checkpoint(frozen=frozen), tmp_path / run, format=fmt,
                             incremental=True).save()
    frozen = cv.Variable(np.zeros(300_000, np.float32), name="frozen")
    ckpt = cv.Checkpoint(frozen=frozen)
    manager = cv.CheckpointManager(ckpt, tmp_path / "mine", format=fmt, incremental=True)
    monkeypatch.chdir(tmp_path / "other")
    ckpt.restore(f"ckpt-1{suffix}")  # the other run's step
    monkeypatch.chdir(tmp_path / "mine")  # the manager's own step has that name too
    step = manager.save()
    assert np.array_equal(cv.load(step)["frozen"], np.full(300_000, 2.0, np.float32))
