"""Reading row deltas (docs/FORMAT.md "Row deltas"): a whole value's patched rows are laid
once its base's pieces are all in, each patch in one step, later patches winning; damage
in a patch read beside the base changes nothing; the pieces a reader reads from are
exact at every file boundary."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.checkpoint import _apply
from ckptvar.errors import CorruptCheckpointError
from ckptvar.storage import checksum
from ckptvar.storage._container import delta as delta_mod
from ckptvar.storage._container import source as source_mod

WIDTH = 64
#: A table of three I/O pieces (8 MiB each), so its base is read on several threads.
ROWS = (24 << 20) // (WIDTH * 4)
HOT = [0, 1, 5, ROWS // 2, ROWS - 1]  # touched at every step: in every patch


def _steps(tmp_path: Path, fmt: str, steps: int) -> tuple[cv.Checkpoint, cv.Variable, Path]:
    """A table saved whole, then ``steps`` row deltas that each rewrite the rows ``HOT``
    (with values of their own step) and a few others."""
    table = cv.Variable(np.random.default_rng(0).random((ROWS, WIDTH), dtype=np.float32),
                        name="table")
    ckpt = cv.Checkpoint(table=table)
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format=fmt, incremental=True,
                                   max_to_keep=steps + 1)
    manager.save()
    rng = np.random.default_rng(1)
    step = ""
    for k in range(steps):
        ids = np.unique(np.concatenate([HOT, rng.integers(0, ROWS, 50)]))
        table.scatter_update(ids, np.full((ids.size, WIDTH), k + 1.5, np.float32))
        step = manager.save()
    manager.wait_until_finished()
    return ckpt, table, Path(step)


@pytest.mark.parametrize("budget", [None, 0], ids=["staged", "two-pass"])
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_rows_in_several_patches_read_bit_exact_the_last_patch_winning(
        tmp_path: Path, fresh_graph: cv.Graph, monkeypatch: pytest.MonkeyPatch, fmt: str, *,
        budget: int | None) -> None:
    if budget is not None:  # 0: verified first, then read straight into the variable
        monkeypatch.setattr(_apply, "TEMPORARY_BUDGET", budget)
    ckpt, table, step = _steps(tmp_path, fmt, 4)
    want = table.numpy().copy()
    assert (want[HOT] == 4.5).all()  # the last step's value
    with cv.open(step) as reader:
        info = reader.deltas()["table"]
        assert info["patches"] == 4
        assert info["rows"] > reader.delta_rows("table").size  # rows repeat across patches
        assert np.array_equal(reader["table"].read(), want)
        for lo, hi in ((0, 2), (ROWS // 2 - 1, ROWS // 2 + 1), (ROWS - 3, ROWS)):
            assert np.array_equal(reader["table"][lo:hi], want[lo:hi])
    assert np.array_equal(cv.load(step)["table"], want)
    for verify in (True, False):
        table.assign(np.zeros((ROWS, WIDTH), np.float32))
        ckpt.restore(str(step), verify=verify)
        assert np.array_equal(table.numpy(), want)


@pytest.mark.parametrize("budget", [None, 0], ids=["staged", "two-pass"])
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_damaged_patch_read_beside_the_base_leaves_the_variable_unchanged(
        tmp_path: Path, fresh_graph: cv.Graph, monkeypatch: pytest.MonkeyPatch, fmt: str, *,
        budget: int | None) -> None:
    if budget is not None:
        monkeypatch.setattr(_apply, "TEMPORARY_BUDGET", budget)
    ckpt, table, step = _steps(tmp_path, fmt, 3)
    with cv.open(step) as r:
        f, path, offset, n, _ = r.record.deltas["table"].patches[1]  # a middle one
    if fmt == "zarr":
        where, at = step / path / "c.0", 8 * n + 7  # a byte of its rows
    else:
        where, at = step.parent / f if f else step, offset + 8 * n + 7
    with open(where, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x5A]))
    table.assign(np.full((ROWS, WIDTH), -1.0, np.float32))
    before = table.numpy().copy()
    with pytest.raises(CorruptCheckpointError, match=r"'table' has a row patch .* checksum"):
        ckpt.restore(str(step))
    assert np.array_equal(table.numpy(), before)
    with pytest.raises(CorruptCheckpointError, match="row patch"):
        cv.load(step)


def test_a_patch_row_past_the_signed_range_is_refused() -> None:
    """Row indices are unsigned 64-bit: one of 2**63 or more (negative as a signed index)
    is refused even under a valid checksum, as a row past the value's end is."""
    rows = np.array([2**63 + 1, 2**63 + 2], "<u8")
    raw = np.concatenate([rows.view(np.uint8), np.zeros(2 * 4, np.uint8)])
    crc = checksum.crc(raw, 3)
    with pytest.raises(ValueError, match="sorted, unique and inside"):
        delta_mod.decode_patch(raw, 2, 4, 10, crc=crc, seed=3)
    one = np.concatenate([rows[:1].view(np.uint8), np.zeros(4, np.uint8)])
    with pytest.raises(ValueError, match="sorted, unique and inside"):
        delta_mod.decode_patch(one, 1, 4, 10, crc=checksum.crc(one, 3), seed=3)


def test_pieces_and_patched_sources_read_exact_at_every_boundary(tmp_path: Path) -> None:
    data = np.arange(48, dtype=np.uint8)
    fds = []
    for i in range(3):  # three files of 16 bytes
        (tmp_path / f"c{i}").write_bytes(data[16 * i: 16 * (i + 1)].tobytes())
        fds.append(os.open(tmp_path / f"c{i}", os.O_RDONLY))
    pieces = source_mod.Pieces(fds, [16, 16, 16])
    rows = np.array([0, 5, 11])  # rows of 4 bytes: the first, one inside, the last
    patch = np.frombuffer(bytes(range(200, 212)), "V4")
    want = data.copy()
    want.reshape(12, 4)[rows] = patch.view(np.uint8).reshape(3, 4)
    patched = source_mod.Patched(pieces, 0, 48, 4, (rows, patch), owned=False)
    try:
        for lo in range(48):
            for hi in range(lo, 49):
                buf = bytearray(hi - lo)
                assert pieces.pread_into(buf, lo) == hi - lo
                assert bytes(buf) == data[lo:hi].tobytes(), (lo, hi)
                assert patched.pread_into(buf, lo) == hi - lo
                assert bytes(buf) == want[lo:hi].tobytes(), (lo, hi)
        assert pieces.pread_into(bytearray(4), 46) == 2  # past the end: what there is
    finally:
        pieces.close()


def test_the_row_delta_restore_benchmark_runs(tmp_path: Path) -> None:
    """``python -m benchmarks.row_delta_restore``: both formats, a delta of 10 patches
    restored against a full step and its base's step, every restore timed."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.row_delta_restore", "--mib", "2", "--shares", "3",
         "--rounds", "2", "--json", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
        cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert set(got["cases"]) == {"h5-2-3", "zarr-2-3"}
    assert all(d["patches"] == 10 for d in got["cases"].values())
    for case in got["times"]["this"].values():
        assert {k: len(v) for k, v in case.items()} == {
            k: 2 for k in ("inc", "full", "base", "inc_cpu", "full_cpu", "base_cpu")}
