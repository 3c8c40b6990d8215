"""CheckpointManager(incremental=True): unchanged values are not written again, and every
step stays a complete checkpoint for ckptvar, the CLI and plain h5py / zarr-python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import zarr

import ckptvar as cv
from ckptvar.storage import backend_for

N_FROZEN, N_HEAD = 300_000, 70_000  # 1.2 MB and 280 KB: stored as their own arrays


def _model(seed: int = 0) -> tuple[cv.Checkpoint, cv.Variable, cv.Variable]:
    rng = np.random.default_rng(seed)
    frozen = cv.Variable(rng.random(N_FROZEN, dtype=np.float32), name="frozen")
    head = cv.Variable(np.zeros(N_HEAD, np.float32), name="head")
    return cv.Checkpoint(frozen=frozen, head=head), frozen, head


def _size(path: Path) -> int:
    """Bytes a checkpoint adds on disk: a Zarr chunk file linked from elsewhere adds none."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*")
               if p.is_file() and p.stat().st_nlink == 1)


def _chunk(step: Path, key: str) -> os.stat_result:
    return (step / key / "c.0").stat()


def test_unchanged_values_are_not_written_again(tmp_path: Path, fmt: str,
                                                fresh_graph: cv.Graph) -> None:
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=None, format=fmt,
                                   incremental=True)
    paths, heads, sizes = [], [], []
    for i in range(4):
        head.assign(np.full(N_HEAD, float(i), np.float32))
        paths.append(Path(manager.save()))
        heads.append(head.numpy())
        sizes.append(_size(paths[-1]))  # before a later step links its chunks
    first, later = sizes[0], sizes[1:]
    assert first > frozen.numpy().nbytes
    assert all(n < frozen.numpy().nbytes // 2 for n in later), (first, later)
    for p, h in zip(paths, heads, strict=True):  # every step complete, bit-exact
        got = cv.load(p)
        assert np.array_equal(got["frozen"], frozen.numpy()) and np.array_equal(got["head"], h)
    if fmt == "zarr":  # one inode for the frozen value, a new one for the head each step
        assert len({_chunk(p, "frozen").st_ino for p in paths}) == 1
        assert len({_chunk(p, "head").st_ino for p in paths}) == len(paths)
    else:
        with cv.open(paths[-1]) as r:
            assert r.shared() == {"frozen": [paths[0].name]}  # the holder, never a chain


def test_a_changed_value_is_written_and_the_state_restores(tmp_path: Path, fmt: str,
                                                         fresh_graph: cv.Graph) -> None:
    ckpt, frozen, _ = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, format=fmt, incremental=True)
    manager.save()
    frozen[5] = 42.0  # a slice write is a change
    p2 = manager.save()
    assert cv.load(p2)["frozen"][5] == 42.0
    want = frozen.numpy()
    frozen.assign(np.zeros(N_FROZEN))
    ckpt.restore(p2)
    assert np.array_equal(frozen.numpy(), want)


def test_values_unknown_to_the_counter_are_compared_by_checksums(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """``value()`` handed out the buffer: an in-place write is found by the block checksums,
    and an untouched value is still shared."""
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, format=fmt, incremental=True)
    p1 = Path(manager.save())
    head.value()[7] = 3.0  # in place, unseen by the version counter
    frozen.value()  # handed out, not written
    p2 = Path(manager.save())
    assert cv.load(p2)["head"][7] == 3.0
    with cv.open(p2) as r:
        shared = r.shared()
    assert set(shared) == {"frozen"} and shared["frozen"] == [p1.name]


def test_a_new_manager_builds_on_the_latest_step_by_checksums(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    ckpt, _, _ = _model()
    cv.CheckpointManager(ckpt, tmp_path, format=fmt, incremental=True).save()
    ckpt2, _, head2 = _model(seed=0)  # a restarted process: same values, new variables
    manager = cv.CheckpointManager(ckpt2, tmp_path, format=fmt, incremental=True)
    manager.restore_or_initialize()
    head2.assign_add(1)
    p = Path(manager.save())
    with cv.open(p) as r:
        assert set(r.shared()) == {"frozen"}


def test_plain_h5py_and_zarr_read_every_value_by_name(tmp_path: Path, fmt: str,
                                                      fresh_graph: cv.Graph) -> None:
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, format=fmt, incremental=True)
    manager.save()
    head.assign_add(2)
    p2 = manager.save()
    if fmt == "h5":
        with h5py.File(p2, "r") as f:
            link = f.get("frozen", getlink=True)
            assert isinstance(link, h5py.ExternalLink) and link.filename == "ckpt-1.h5"
            assert np.array_equal(f["frozen"][()], frozen.numpy())  # h5py follows it
            assert np.array_equal(f["head"][()], head.numpy())
    else:
        root = zarr.open_group(p2, mode="r")
        assert np.array_equal(root["frozen"][...], frozen.numpy())
        assert np.array_equal(root["head"][...], head.numpy())


def test_pruning_keeps_the_bytes_a_kept_step_refers_to(tmp_path: Path, fmt: str,
                                                       fresh_graph: cv.Graph) -> None:
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2, format=fmt,
                                   incremental=True)
    for i in range(5):
        head.assign(np.full(N_HEAD, float(i), np.float32))
        manager.save()
    assert [Path(p).name for p in manager.checkpoints] == [f"ckpt-4.{fmt}", f"ckpt-5.{fmt}"]
    for p in manager.checkpoints:
        assert np.array_equal(cv.load(p)["frozen"], frozen.numpy())
    state = json.loads((tmp_path / "checkpoint_state.json").read_text())["sections"]["ckpt"]
    held = {e["path"]: e.get("held_for") for e in state["pending_delete"]}
    if fmt == "h5":  # the step holding the frozen bytes stays, held for the kept steps
        assert held == {"ckpt-1.h5": ["ckpt-4.h5", "ckpt-5.h5"]}
        assert (tmp_path / "ckpt-1.h5").is_file() and not (tmp_path / "ckpt-2.h5").exists()
    else:  # hard links: the pruned steps are gone, their shared chunks live on
        assert held == {} and not (tmp_path / "ckpt-1.zarr").exists()
    frozen.assign_add(1)  # now nothing refers to step 1 (nor to 5, which refers to 1)
    head.assign_add(1)
    manager.save()
    manager.save()
    assert not (tmp_path / f"ckpt-1.{fmt}").exists()
    for p in manager.checkpoints:
        assert np.array_equal(cv.load(p)["frozen"], frozen.numpy())


def test_a_run_that_went_back_builds_on_and_keeps_its_last_saves(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """Steps 100, 500, then (100 restored by hand) 200 and 300: each step builds on the
    last saved, the abandoned 500 is pruned before the run's own steps, and a pruned
    step stays on disk while a kept step refers to its bytes."""
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2, format=fmt,
                                   incremental=True)
    first = manager.save(checkpoint_number=100)
    head.assign(np.full(N_HEAD, 5.0, np.float32))
    manager.save(checkpoint_number=500)
    ckpt.restore(first)
    heads = {}
    for number in (200, 300):
        head.assign(np.full(N_HEAD, float(number), np.float32))
        manager.save(checkpoint_number=number)
        heads[number] = head.numpy()
    manager.wait_until_finished()
    assert [Path(p).name for p in manager.checkpoints] == [f"ckpt-200.{fmt}", f"ckpt-300.{fmt}"]
    for number, p in zip((200, 300), manager.checkpoints, strict=True):
        got = cv.load(p)
        assert np.array_equal(got["frozen"], frozen.numpy())
        assert np.array_equal(got["head"], heads[number])
    state = json.loads((tmp_path / "checkpoint_state.json").read_text())["sections"]["ckpt"]
    for entry in state["pending_delete"]:  # held (h5) only for steps still on disk
        assert entry["held_for"] and all((tmp_path / h).exists() for h in entry["held_for"])
    if fmt == "h5":  # the frozen bytes are step 100's: it stays for the kept steps
        assert {"ckpt-200.h5", "ckpt-300.h5"} <= set(
            next(e for e in state["pending_delete"] if e["path"] == "ckpt-100.h5")["held_for"])
    frozen.assign_add(1)
    for number in (400, 600):  # nothing refers to 100 nor 500 any more: both freed
        head.assign(np.full(N_HEAD, float(number), np.float32))
        manager.save(checkpoint_number=number)
    manager.wait_until_finished()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == [
        f"ckpt-400.{fmt}", f"ckpt-600.{fmt}"]


def test_an_h5_step_is_not_read_back_for_its_references_nor_as_the_next_base(
        tmp_path: Path, fresh_graph: cv.Graph, watch_calls: Any) -> None:
    """An incremental HDF5 step's record is kept as written: the manager's check of what
    the step refers to (its prune) and the next step's read of its base open no file
    of an incremental step, and what they get is what a reader reads."""
    from ckptvar.storage import _h5

    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2, format="h5",
                                   incremental=True)
    manager.save()
    opened = watch_calls(_h5, "H5Reader")
    for i in range(4):
        head.assign(np.full(N_HEAD, float(i), np.float32))
        manager.save()
    assert {Path(p).name for p in opened} <= {"ckpt-1.h5"}  # the first, full step, read once as a base
    for p in manager.checkpoints:  # kept as a reader decodes it
        kept = _h5._committed_record(Path(p))
        assert kept.external == {"frozen": ("ckpt-1.h5", "frozen")}
        assert _h5.external_files(Path(p)) == {"ckpt-1.h5"}
        _h5._RECORDS.clear()
        assert _h5._committed_record(Path(p)) == kept
    assert (tmp_path / "ckpt-1.h5").is_file()  # held for the kept steps
    assert np.array_equal(cv.load(manager.latest_checkpoint)["head"], head.numpy())


def test_a_referenced_step_is_not_written_again(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, _, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, format="h5", incremental=True)
    manager.save(checkpoint_number=1)
    head.assign_add(1)
    manager.save(checkpoint_number=2)
    with pytest.raises(cv.CkptError, match="committed already|refer to the bytes"):
        manager.save(checkpoint_number=1)
    assert np.array_equal(cv.load(tmp_path / "ckpt-2.h5")["head"], head.numpy())


def test_a_missing_holder_is_a_clear_error(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, _, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=None, format="h5",
                                   incremental=True)
    manager.save()
    head.assign_add(1)
    p2 = manager.save()
    os.remove(tmp_path / "ckpt-1.h5")  # by hand, behind the manager's back
    with pytest.raises(cv.CorruptCheckpointError, match=r"ckpt-1\.h5.*gone"):
        cv.load(p2)


def test_plain_arrays_are_shared_by_their_checksums(tmp_path: Path, fmt: str) -> None:
    """The storage level: a writer given a base reuses values whose block checksums match."""
    rng = np.random.default_rng(1)
    a, b = rng.random(100_000), rng.random((200, 300)).astype(np.float32)
    base = cv.save(tmp_path / f"a.{fmt}", {"a": a, "b": b})
    b2 = b.copy()
    b2[199, 299] += 1  # the last block changes
    writer = backend_for(tmp_path / f"b.{fmt}", None, mode="w").open_writer(
        tmp_path / f"b.{fmt}", base=base)
    writer.add("a", a)
    writer.add("b", b2)
    writer.commit()
    assert writer.reused == ["a"]
    got = cv.load(tmp_path / f"b.{fmt}")
    assert np.array_equal(got["a"], a) and np.array_equal(got["b"], b2)


def _ckpt_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptvar.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_cli_inspect_verify_convert(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=None, format=fmt,
                                   incremental=True)
    manager.save()
    head.assign_add(1)
    p2 = manager.save()
    res = _ckpt_cli("inspect", "--json", p2)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["shared"] == {"frozen": [f"ckpt-1.{fmt}"]}
    if fmt == "h5":  # (the text forms, once)
        res = _ckpt_cli("inspect", p2)
        assert "shared with other steps" in res.stdout and "ckpt-1.h5" in res.stdout
        res = _ckpt_cli("ls", "--json", str(tmp_path / "run"))
        rows = {Path(r["path"]).name: r for r in json.loads(res.stdout)["checkpoints"]}
        assert rows["ckpt-1.h5"]["referred_by"] == ["ckpt-2.h5"]
        assert "referred_by" not in rows["ckpt-2.h5"]
    res = _ckpt_cli("verify", p2)
    assert res.returncode == 0, res.stdout + res.stderr
    out = tmp_path / f"standalone.{fmt}"
    res = _ckpt_cli("convert", p2, str(out))
    assert res.returncode == 0, res.stderr
    cv.storage.remove_path(tmp_path / "run")  # every step gone: the copy stands alone
    got = cv.load(out)
    assert np.array_equal(got["frozen"], frozen.numpy()) and np.array_equal(got["head"],
                                                                            head.numpy())
    with cv.open(out) as r:
        assert r.shared() == {}


def test_background_saves_build_on_each_other(tmp_path: Path, fmt: str,
                                              fresh_graph: cv.Graph) -> None:
    """A background save snapshots the versions with the values: a write after the
    snapshot is a change for the next step, never lost."""
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=None, format=fmt,
                                   async_save=True, incremental=True)
    manager.save()
    head.assign_add(1)  # after the snapshot of step 1
    p2 = manager.save()
    want = head.numpy()
    ckpt.wait()
    assert np.array_equal(cv.load(p2)["head"], want)
    with cv.open(p2) as r:
        assert set(r.shared()) == {"frozen"}


def test_a_holder_is_never_reached_through_a_symlink(tmp_path: Path,
                                                     fresh_graph: cv.Graph) -> None:
    ckpt, _, head = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=None, format="h5",
                                   incremental=True)
    manager.save()
    head.assign_add(1)
    p2 = manager.save()
    os.rename(tmp_path / "ckpt-1.h5", tmp_path / "elsewhere.h5")
    os.symlink(tmp_path / "elsewhere.h5", tmp_path / "ckpt-1.h5")
    with pytest.raises(cv.CorruptCheckpointError, match="through a symbolic link"):
        cv.load(p2)


def _fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``os.fsync`` is called on from now (the real call still happens)."""
    synced: list[str] = []
    real = os.fsync

    def counting(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return synced


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_a_step_fsyncs_only_what_durability_needs(tmp_path: Path, fmt: str,
                                                 fresh_graph: cv.Graph,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with nothing changed (one older step pruned): no path fsynced twice, the
    directory once (after the rename), the state file (a cache) not at all; an HDF5
    step makes exactly 2 fsyncs, its file and the directory. Hard-linked Zarr chunk
    files are not fsynced again."""
    ckpt, _, _ = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2, format=fmt,
                                   incremental=True)
    for _ in range(3):
        manager.save()
    synced = _fsynced(monkeypatch)
    last = Path(manager.save())
    assert len(synced) == len(set(synced)), synced
    assert synced.count(str(tmp_path)) == 1, synced
    assert not [p for p in synced if "checkpoint_state" in p], synced
    linked = [p for p in synced if p.endswith(("/frozen/c.0", "/head/c.0"))]
    assert not linked, synced  # hard links of chunk files made durable by their writer
    if fmt == "h5":
        assert len(synced) == 2 and ".ckpt-4.h5." in synced[0], synced
    assert [Path(p).name for p in manager.checkpoints] == [f"ckpt-3.{fmt}", last.name]
    assert not (tmp_path / f"ckpt-2.{fmt}").exists()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_a_row_delta_step_fsyncs_each_file_once_and_no_kept_array(
        tmp_path: Path, fresh_graph: cv.Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Zarr step of a table stored as a row delta: no path fsynced twice (its group's
    document is written once), its own patch's files and directory fsynced, and none of
    the arrays it keeps from the step it took over (the base's whole copy, the earlier
    patches it links) nor their files; the directory once, after the rename."""
    rows, width = 8192, 64  # 2 MiB: a row delta
    table = cv.Variable(np.random.default_rng(0).random((rows, width), dtype=np.float32),
                        name="table")
    manager = cv.CheckpointManager(cv.Checkpoint(table=table), tmp_path, max_to_keep=2,
                                   format="zarr", incremental=True)
    for k in range(5):
        table.scatter_update([k, 1000 + k], np.full((2, width), k, np.float32))
        manager.save()
        manager.wait_until_finished()
    table.scatter_update([7], np.full((1, width), 9.0, np.float32))
    synced = _fsynced(monkeypatch)
    last = Path(manager.save())
    assert len(synced) == len(set(synced)), synced
    assert synced.count(str(tmp_path)) == 1, synced
    patches = sorted(p.name for p in (last / "table").iterdir() if p.name.startswith("patch-"))
    own = patches[-1]
    names = [p.split(".partial", 1)[-1] for p in synced if ".partial" in p]
    assert f"/table/{own}/c.0" in names and f"/table/{own}" in names, names
    assert "/table/zarr.json" in names and "/table" in names, names
    assert not [n for n in names if n.startswith("/table/base")], names
    kept = [n for n in names if n.startswith("/table/patch-") and not n.startswith(f"/table/{own}")]
    assert len(kept) <= 2, names  # only the patches the spare's step lacked: linked anew
    np.testing.assert_array_equal(cv.load(last)["table"], table.numpy())


def test_a_newly_preserved_step_makes_the_state_durable(tmp_path: Path,
                                                       fresh_graph: cv.Graph,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Only the state file knows a step kept by ``keep_checkpoint_every_n_hours``: the
    save that keeps one fsyncs the state (then the directory again)."""
    ckpt, _, _ = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1,
                                   keep_checkpoint_every_n_hours=1e-9, incremental=True)
    time.sleep(0.02)  # a step's time is its file's: a clock tick (a few ms) after the start
    manager.save()
    synced = _fsynced(monkeypatch)
    manager.save()  # step 1 leaves the window: preserved
    state = json.loads((tmp_path / "checkpoint_state.json").read_text())["sections"]["ckpt"]
    assert [e["path"] for e in state["preserved"]] == ["ckpt-1.h5"]
    assert [p for p in synced if "checkpoint_state" in p], synced
