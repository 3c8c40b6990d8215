"""A truncated ckptvar ``.h5`` file is damage, even when every value's bytes survive.

The values and the root record sit early in the file and HDF5's own metadata after
them, so a cut that spares the values used to pass ``ckpt verify`` and load, while
h5py refused the file. The HDF5 superblock's end-of-file address is checked against
the file's size at open: a file shorter than it says is a ``CorruptCheckpointError``
(loads included, as for any truncation: docs/reliability.md §2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.distributed import SingleProcessCoordinator


def _values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {f"layer{i}/w": rng.standard_normal(32).astype(np.float32) for i in range(6)}


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(cv.save(tmp_path_factory.mktemp("trunc") / "orig.h5", _values()))


def _cuts(size: int) -> list[int]:
    """Sampled cut points: every class from just past the values to one byte short."""
    return sorted({*range(3_500, size, 300), size // 2, size - 100, size - 8, size - 1})


def _truncated_error(exc: BaseException, file: Path, size: int, cut: int) -> None:
    msg = str(exc)
    assert file.name in msg and "truncated" in msg, msg
    assert str(size) in msg and str(cut) in msg, msg


def _ckpt(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptvar", *map(str, args)],
                          check=False, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONWARNINGS="error"))


def test_every_cut_is_a_corrupt_checkpoint_on_load_and_open(original: Path,
                                                            tmp_path: Path) -> None:
    data = original.read_bytes()
    size = len(data)
    victim = tmp_path / "cut.h5"
    for cut in _cuts(size):
        victim.write_bytes(data[:cut])
        with pytest.raises(OSError, match="truncated"):  # h5py refuses it too
            h5py.File(victim, "r")
        with pytest.raises(cv.CorruptCheckpointError) as info:
            cv.load(victim)
        _truncated_error(info.value, victim, size, cut)
        with pytest.raises(cv.CorruptCheckpointError), cv.open(victim) as reader:
            reader["layer0/w"].read()


def test_a_file_longer_than_it_says_still_loads(original: Path, tmp_path: Path) -> None:
    """HDF5 allows bytes past its end of file (h5py opens it); so does ckptvar."""
    victim = tmp_path / "long.h5"
    victim.write_bytes(original.read_bytes() + b"\0" * 64)
    h5py.File(victim, "r").close()
    got = cv.load(victim)
    assert all(np.array_equal(got[k], v) for k, v in _values().items())


def test_ckpt_verify_says_the_file_is_truncated(original: Path, tmp_path: Path) -> None:
    back = 1  # one byte short (every other cut point: in process, above)
    data = original.read_bytes()
    victim = tmp_path / "cut.h5"
    victim.write_bytes(data[: len(data) - back])
    proc = _ckpt("verify", victim)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "cut.h5" in out and "truncated" in out, out
    assert str(len(data)) in out and str(len(data) - back) in out, out
    assert "Traceback" not in out


def test_a_truncated_process_file_of_a_multi_process_step(tmp_path: Path,
                                                          fresh_graph: cv.Graph) -> None:
    w = cv.Variable(np.arange(24, dtype="f4").reshape(8, 3), name="w",
                    shard=cv.Shard(full_shape=(8, 3), offset=(0, 0)))
    step = Path(cv.Checkpoint(w=w).save(tmp_path / "ckpt.h5",
                                        coordinator=SingleProcessCoordinator()))
    rank = step / "rank-00000.h5"
    data = rank.read_bytes()
    for cut in (len(data) - 1, len(data) - 100, len(data) - 1000):
        rank.write_bytes(data[:cut])
        with pytest.raises(cv.CorruptCheckpointError) as info:
            cv.load(step)
        _truncated_error(info.value, rank, len(data), cut)


def test_a_truncated_holder_of_an_incremental_step(tmp_path: Path,
                                                   fresh_graph: cv.Graph) -> None:
    """The step an incremental step's unchanged values are read from is checked too."""
    a = cv.Variable(np.arange(64, dtype="f4"), name="a")
    b = cv.Variable(np.ones(64, "f4"), name="b")
    manager = cv.CheckpointManager(cv.Checkpoint(a=a, b=b), tmp_path / "run",
                                   incremental=True)
    first = Path(manager.save())
    b.assign(np.zeros(64, "f4"))
    second = Path(manager.save())
    kept = tmp_path / "second.h5"
    shutil.copyfile(second, kept)
    size = first.stat().st_size
    os.truncate(first, size - 8)
    with pytest.raises(cv.CorruptCheckpointError) as info:
        cv.load(second)
    _truncated_error(info.value, first, size, size - 8)
    proc = _ckpt("verify", second)
    assert proc.returncode == 1 and first.name in proc.stdout + proc.stderr, proc.stdout



def test_ckpt_verify_reports_a_truncated_zarr_chunk(tmp_path: Path) -> None:
    orig = Path(cv.save(tmp_path / "orig.zarr", _values()))
    chunk = next(f for f in sorted((orig / "layer3" / "w").rglob("*"))
                 if f.is_file() and f.name != "zarr.json")
    os.truncate(chunk, chunk.stat().st_size - 1)
    proc = _ckpt("verify", orig)
    assert proc.returncode == 1 and "layer3/w" in proc.stdout, proc.stdout + proc.stderr


def test_ckpt_verify_reports_a_truncated_zarr_root_metadata(tmp_path: Path) -> None:
    other = Path(cv.save(tmp_path / "other.zarr", _values()))
    root = other / "zarr.json"
    os.truncate(root, root.stat().st_size // 2)
    proc = _ckpt("verify", other)
    assert proc.returncode == 1 and "other.zarr" in proc.stdout + proc.stderr, proc.stdout
