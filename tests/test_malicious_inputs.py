"""Malicious checkpoints made with the real libraries: code that a file would run is never
run, nothing outside the checkpoint is read, and declared sizes are refused before they
are allocated; each refusal is a ckptvar error naming what and where (the CLI: a non-zero
exit and one line, no traceback)."""

from __future__ import annotations

import bz2
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from ckpt_runs import ckpt
from ckpt_runs import ckpt_processes as ckpt_many

import ckptvar as cv

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ORBAX_ZARR = FIXTURES / "orbax" / "zarr_step"


class _Payload:
    """Unpickled, it would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def _edit_zarray(folder: Path, name: str, **changes: object) -> None:
    path = folder / name / ".zarray"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def _one_line_error(run: object) -> None:
    out = getattr(run, "stdout", "") + getattr(run, "stderr", "")
    assert getattr(run, "returncode", 0) != 0, out
    assert "Traceback" not in out, out


# -- Orbax per-array Zarr: the compressor is data, never a codec looked up by name ---------


def test_orbax_chunk_compressed_as_a_pickle_is_never_unpickled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # numcodecs' "pickle" codec unpickles a chunk; numcodecs refuses it only unless the
    # environment allows it, and ckptvar must not depend on that.
    import numcodecs.pickles

    monkeypatch.setattr(numcodecs.pickles, "ALLOW_UNSAFE_PICKLE_DECODE", True)
    marker = tmp_path / "ran"
    folder = tmp_path / "step"
    shutil.copytree(ORBAX_ZARR, folder)
    _edit_zarray(folder, "params.dense.bias", compressor={"id": "pickle"})
    (folder / "params.dense.bias" / "0").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(cv.UnsupportedFormatError,
                       match=r"params\.dense\.bias.*compressor 'pickle' is not read"):
        cv.load(folder)
    assert not marker.exists()
    with cv.open(folder) as reader:  # the other values still read
        np.testing.assert_array_equal(reader.read("opt_state/mu"), np.ones(3))


def test_orbax_bz2_chunk_bomb_is_stopped_at_its_cell(tmp_path: Path) -> None:
    folder = tmp_path / "step"
    shutil.copytree(ORBAX_ZARR, folder)
    _edit_zarray(folder, "params.big", compressor={"id": "bz2", "level": 9})
    # 64 streams of 1 MiB of zeros: a few KiB that bz2.decompress would make 64 MiB.
    (folder / "params.big" / "0.0").write_bytes(bz2.compress(bytes(1 << 20)) * 64)
    tracemalloc.start()
    try:
        with pytest.raises(cv.CorruptCheckpointError, match=r"params\.big/0\.0.*holds 2401 bytes"):
            cv.load(folder)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()


# -- symbolic links inside a checkpoint directory never lead out of it ---------------------


def _move_out(path: Path, outside: Path) -> None:
    """``path`` becomes a symbolic link to ``outside``, where its file or folder now is."""
    shutil.move(path, outside)
    path.symlink_to(outside)


def _dcp(tmp_path: Path, what: str) -> Path:
    folder = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp" / "single", folder)
    _move_out(folder / what, tmp_path / "elsewhere")
    return folder


def _hf(tmp_path: Path, what: str) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(FIXTURES / "hf_sharded", folder)
    _move_out(folder / what, tmp_path / "elsewhere")
    return folder


def _orbax(tmp_path: Path, what: str) -> Path:
    folder = tmp_path / "orbax"
    shutil.copytree(ORBAX_ZARR, folder)
    _move_out(folder / what, tmp_path / "elsewhere")
    return folder


LINKS_OUT = {
    "dcp data file": (_dcp, "__0_0.distcp"),
    "dcp metadata": (_dcp, ".metadata"),
    "hf shard": (_hf, "model-00002-of-00002.safetensors"),
    "orbax chunk": (_orbax, "params.dense.bias/0"),
    "orbax array folder": (_orbax, "params.dense.bias"),
    "orbax metadata": (_orbax, "_METADATA"),
}


@pytest.mark.parametrize("case", LINKS_OUT)
def test_a_symbolic_link_out_of_a_checkpoint_is_refused(case: str, tmp_path: Path) -> None:
    make, what = LINKS_OUT[case]
    folder = make(tmp_path, what)
    pattern = rf"{what.split('/')[-1]}'? is a symbolic link to '{tmp_path / 'elsewhere'}.*outside"
    with pytest.raises(cv.CorruptCheckpointError, match=pattern):
        cv.load(folder)


def test_cli_refuses_a_link_out_in_one_line(tmp_path: Path) -> None:
    folder = _dcp(tmp_path, "__0_0.distcp")
    run = ckpt("convert", folder, tmp_path / "out.safetensors")
    _one_line_error(run)
    assert "symbolic link" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.safetensors").exists()


def test_links_that_stay_inside_and_the_hub_cache_are_read(tmp_path: Path) -> None:
    # A link to another file of the same checkpoint stays inside it.
    folder = tmp_path / "orbax"
    shutil.copytree(ORBAX_ZARR, folder)
    chunk = folder / "params.dense.bias" / "0"
    shutil.move(chunk, folder / "params.dense.bias" / "real")
    chunk.symlink_to("real")
    np.testing.assert_array_equal(cv.load(folder)["params/dense/bias"],
                                  cv.load(ORBAX_ZARR)["params/dense/bias"])
    # The Hugging Face hub keeps each file of a snapshot as a link into the repo's blobs/.
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted((FIXTURES / "hf_sharded").iterdir())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    assert sorted(cv.load(snapshot)) == sorted(cv.load(FIXTURES / "hf_sharded"))
    # ... and older huggingface_hub made a local_dir download of links to the same blobs.
    local = tmp_path / "local_dir"
    local.mkdir()
    for f in snapshot.iterdir():
        (local / f.name).symlink_to(f.resolve())
    assert sorted(cv.load(local)) == sorted(cv.load(FIXTURES / "hf_sharded"))


# -- ckptvar's own incremental HDF5 steps: holders are the steps beside, never links -------


def _two_process_file_steps(run: Path) -> tuple[Path, Path]:
    """Two steps of the multi-process layout (one process), the second's unchanged value
    ``a`` held by the first (``../ckpt-1.h5/rank-00000.h5``)."""
    rows = 16
    a = cv.Variable(np.arange(rows * 4, dtype="f4").reshape(rows, 4), name="a",
                    shard=cv.Shard(full_shape=(rows, 4), offset=(0, 0)))
    b = cv.Variable(np.ones((rows, 4), "f4"), name="b",
                    shard=cv.Shard(full_shape=(rows, 4), offset=(0, 0)))
    manager = cv.CheckpointManager(cv.Checkpoint(a=a, b=b), run, format="h5", incremental=True,
                                   coordinator=cv.distributed.SingleProcessCoordinator())
    first = Path(manager.save())
    b.assign(np.zeros((rows, 4), "f4"))
    return first, Path(manager.save())


def test_an_incremental_step_does_not_read_a_base_step_linked_from_elsewhere(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    first, second = _two_process_file_steps(tmp_path / "run")
    _move_out(first, tmp_path / "elsewhere")
    with pytest.raises(cv.CorruptCheckpointError,
                       match=r"'a'.*'\.\./ckpt-1\.h5/rank-00000\.h5'.*symbolic link"):
        cv.load(second)
    _one_line_error(ckpt("convert", second, tmp_path / "out.h5"))
    assert not (tmp_path / "out.h5").exists()



def test_a_step_index_or_zarr_root_linked_from_elsewhere_is_refused(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    _, step = _two_process_file_steps(tmp_path / "run")
    _move_out(step / "ckptvar-index.msgpack", tmp_path / "elsewhere")
    with pytest.raises(cv.CorruptCheckpointError, match=(
            rf"ckptvar-index\.msgpack' is a symbolic link to '{tmp_path / 'elsewhere'}'")):
        cv.load(step)
    (step / "ckptvar-index.msgpack").unlink()
    shutil.copy(tmp_path / "elsewhere", step / "index-copy")
    (step / "ckptvar-index.msgpack").symlink_to("index-copy")  # inside the step: read
    assert sorted(cv.load(step)) == ["a", "b", "save_counter"]
    # ckptvar's own Zarr follows no link at all, its root zarr.json's included
    zarr = tmp_path / "model.zarr"
    cv.save(zarr, {"a": np.arange(4.0)})
    _move_out(zarr / "zarr.json", tmp_path / "elsewhere.json")
    with pytest.raises(cv.CorruptCheckpointError, match=(
            rf"zarr\.json' is a symbolic link to '{tmp_path / 'elsewhere.json'}'")):
        cv.load(zarr)


# -- never wait forever: a named pipe or a device where a file is expected -----------------


def _pipe_or_zero(path: Path, kind: str) -> None:
    """``path`` becomes a named pipe (no writer: a plain open waits forever) or a link to
    ``/dev/zero`` (a plain read never ends)."""
    if path.exists():
        path.unlink()
    if kind == "pipe":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["pipe", "zero"])
def test_a_pipe_or_device_for_a_foreign_index_is_refused_at_once(tmp_path: Path,
                                                                 kind: str) -> None:
    dcp = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp" / "single", dcp)
    _pipe_or_zero(dcp / ".metadata", kind)
    tf = tmp_path / "tf"
    shutil.copytree(FIXTURES / "tf2_object", tf)
    _pipe_or_zero(tf / "ckpt-1.index", kind)
    for path in (dcp, tf / "ckpt-1"):  # each call would block without a bound
        with pytest.raises(cv.CkptError):
            cv.load(path)
    if kind == "pipe":
        for run in ckpt_many(("inspect", dcp), ("inspect", tf / "ckpt-1")):
            _one_line_error(run)


@pytest.mark.parametrize("kind", ["pipe", "zero"])
def test_a_pipe_or_device_for_the_state_file_is_damage(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "run"
    manager = cv.CheckpointManager(cv.Checkpoint(v=cv.Variable(np.zeros(3, "f4"))), run,
                                   format="h5")
    manager.save()
    last = manager.save()
    _pipe_or_zero(run / "checkpoint_state.json", kind)
    with pytest.warns(UserWarning, match="checkpoint_state.json.*not a regular file"):
        assert cv.latest_checkpoint(run) == last
    if kind == "pipe":
        listing = ckpt("ls", run)
        assert listing.returncode == 0 and "ckpt-2.h5" in listing.stdout, listing


def _within(seconds: float, call: Callable[[], object]) -> object:
    """``call()``'s result, failing the test if it has not returned after ``seconds`` (a
    daemon thread: a call blocked for good does not keep the test process alive)."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert box, f"still blocked after {seconds} s"
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def test_an_incremental_save_over_a_base_whose_step_index_is_a_pipe(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    run = tmp_path / "run"
    _, second = _two_process_file_steps(run)
    _pipe_or_zero(second / "ckptvar-index.msgpack", "pipe")
    a = cv.Variable(np.full((16, 4), 7, "f4"), name="a",
                    shard=cv.Shard(full_shape=(16, 4), offset=(0, 0)))
    manager = cv.CheckpointManager(cv.Checkpoint(a=a), run, format="h5", incremental=True,
                                   coordinator=cv.distributed.SingleProcessCoordinator())
    third = Path(str(_within(20, manager.save)))  # the base is unusable: every value written
    np.testing.assert_array_equal(cv.load(third)["a"], np.full((16, 4), 7, "f4"))


def test_a_directory_named_like_an_hdf5_file_is_a_ckptvar_error(tmp_path: Path) -> None:
    folder = tmp_path / "model.h5"  # not a multi-process step: no step index in it
    folder.mkdir()
    (folder / "rank-00000.h5").write_bytes(b"")
    with pytest.raises(cv.UnsupportedFormatError, match=r"model\.h5' is a directory"):
        cv.load(folder)
    with pytest.raises(cv.UnsupportedFormatError, match=r"model\.h5' is a directory"):
        cv.Checkpoint(v=cv.Variable(np.zeros(2))).restore(folder)


def test_verify_names_the_values_it_did_not_check(tmp_path: Path) -> None:
    # An object array (a pickle inside the .npz) is never read, so never verified: the
    # verdict says so instead of "OK: 1 value verified" alone.
    path = tmp_path / "mixed.npz"
    marker = tmp_path / "ran"
    np.savez(path, a=np.array([_Payload(marker)], dtype=object), b=np.ones(3))
    run = ckpt("verify", path)
    assert run.returncode == 0, run
    assert "SKIPPED  a: dtype '|O' refused" in run.stdout, run.stdout
    assert run.stdout.strip().splitlines()[-1] == (
        "OK: 1 value verified; 1 skipped (not read, so not verified)")
    as_json = json.loads(ckpt("verify", path, "--json").stdout)
    assert as_json["status"] == "ok" and as_json["values"] == 1
    assert [s["key"] for s in as_json["skipped"]] == ["a"]
    assert not marker.exists()


def test_a_dcp_chunk_declaring_more_than_its_stored_bytes_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp" / "single", folder)
    # torch's pickle of the (3, 4) sizes (the tensors' and their chunks') made 2^20 x 2^20:
    # 4 TiB declared over 48 stored bytes
    raw = (folder / ".metadata").read_bytes()
    three_by_four, huge = b"K\x03K\x04\x86", b"J\x00\x00\x10\x00J\x00\x00\x10\x00\x86"
    assert three_by_four in raw
    (folder / ".metadata").write_bytes(raw.replace(three_by_four, huge))
    cv.load(FIXTURES / "dcp" / "single")  # the reader's modules imported: not measured
    tracemalloc.start()
    try:
        with pytest.raises(cv.CorruptCheckpointError,
                           match=r"'model\.0\.weight' at \[0, 0\] declares .* bytes are stored"):
            cv.load(folder)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", ["pipe", "zero"])
def test_a_pipe_or_device_at_a_file_url_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    url = f"file://{tmp_path}/model.h5"
    cv.save(url, {"a": np.arange(4.0)})
    _pipe_or_zero(tmp_path / "model.h5.commit", kind)  # the commit marker, read whole
    with pytest.raises(cv.CkptError, match=r"model\.h5\.commit.*not a regular file"):
        _within(10, lambda: cv.load(url))


def test_an_orbax_run_step_linked_from_elsewhere_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "orbax" / "run", run)  # steps 2 and 10
    shutil.move(run / "10", tmp_path / "elsewhere")
    (run / "11").symlink_to(tmp_path / "elsewhere")  # the latest step, another run's
    with pytest.raises(cv.CorruptCheckpointError,
                       match=rf"'{run / '11'}' is a symbolic link to '{tmp_path / 'elsewhere'}'"):
        cv.load(run)
    (run / "11").unlink()
    (run / "11").symlink_to("2")  # a link that stays inside the run reads
    assert float(cv.load(run)["w"][0, 0]) == 2.0


def test_an_orbax_array_of_fill_value_larger_than_memory_is_refused(tmp_path: Path) -> None:
    # Orbax writes no chunk equal to the fill value: 512 GiB declared over no bytes at all.
    folder = tmp_path / "step"
    shutil.copytree(ORBAX_ZARR, folder)
    shape = [1 << 18, 1 << 19]
    _edit_zarray(folder, "params.big", shape=shape, chunks=shape, fill_value=0.0)
    (folder / "params.big" / "0.0").unlink()
    with pytest.raises(cv.CkptError, match=(
            r"'params/big' \(shape \(262144, 524288\) float32, 549755813888 bytes\).*"
            r"memory.*cv\.open")):
        cv.load(folder)
    with cv.open(folder) as reader:  # sliced, it reads
        np.testing.assert_array_equal(reader["params/big"][:2, :3], np.zeros((2, 3), "f4"))


@pytest.mark.parametrize("what", ["zarr.json", "a/c.0"])
def test_a_pipe_in_a_zarr_checkpoint_is_refused_at_once(tmp_path: Path, what: str) -> None:
    path = tmp_path / "model.zarr"
    cv.save(path, {"a": np.arange(4.0)})
    _pipe_or_zero(path / what, "pipe")
    with pytest.raises(cv.CkptError, match="zarr.json is not a regular file" if what ==
                       "zarr.json" else r"'a' has a chunk of 0 bytes"):
        _within(10, lambda: cv.load(path))


def test_an_incremental_save_over_a_base_whose_step_index_links_out(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    run = tmp_path / "run"
    _, second = _two_process_file_steps(run)
    _move_out(second / "ckptvar-index.msgpack", tmp_path / "elsewhere")
    a = cv.Variable(np.full((16, 4), 7, "f4"), name="a",
                    shard=cv.Shard(full_shape=(16, 4), offset=(0, 0)))
    b = cv.Variable(np.zeros((16, 4), "f4"), name="b",  # as in the base: would be held there
                    shard=cv.Shard(full_shape=(16, 4), offset=(0, 0)))
    manager = cv.CheckpointManager(cv.Checkpoint(a=a, b=b), run, format="h5", incremental=True,
                                   coordinator=cv.distributed.SingleProcessCoordinator())
    third = Path(str(manager.save()))  # the base's index is not read: every value written
    shutil.rmtree(second)
    loaded = cv.load(third)
    np.testing.assert_array_equal(loaded["b"], np.zeros((16, 4), "f4"))


def test_an_allocation_that_fails_is_a_ckptvar_error(tmp_path: Path) -> None:
    # 2 GiB of fill value, under the machine's memory, over this process's address space
    folder = tmp_path / "step"
    shutil.copytree(ORBAX_ZARR, folder)
    _edit_zarray(folder, "params.big", shape=[1 << 14, 1 << 15], chunks=[1 << 14, 1 << 15],
                 fill_value=0.0)
    (folder / "params.big" / "0.0").unlink()
    script = (
        "import resource, sys\n"
        "import ckptvar as cv\n"
        "cv.load(sys.argv[1], keys=['mask'])  # readers imported before the limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_AS)\n"
        "used = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), hard))\n"
        "try:\n"
        "    cv.load(sys.argv[1])\n"
        "except cv.CkptError as exc:\n"
        "    print(exc)\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert "'params/big' (shape (16384, 32768) float32, 2147483648 bytes) could not be " \
           "allocated (out of memory)" in run.stdout, run.stdout
