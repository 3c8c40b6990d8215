"""Saved by N processes, restored by M: odd layouts, dtypes, partitions and mismatches.

The rank code is tests/mpi/reshard_cases.py (``mpiexec``) and
tests/mpi/reshard_torch_cases.py (torch.distributed, gloo, forked by torch_launch.py).
Every value is checked bit for bit on every rank. All of it runs many processes, so
it is ``-m slow``.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from typing import Any

import pytest
from test_distributed_mpi import _mpi_skip_reason, run_mpi
from test_distributed_torch import launch

pytestmark = pytest.mark.slow

CASES = str(Path(__file__).parent / "mpi" / "reshard_cases.py")
needs_mpi = pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="PyTorch is not installed")


def _mpi(n: int, *args: str) -> dict[str, dict[int, dict[str, Any]]]:
    proc, got, _ = run_mpi(n, CASES, *args, timeout=240)
    assert "crash" not in got, got["crash"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return got


def _all_ok(got: dict[str, dict[int, dict[str, Any]]], case: str, m: int) -> None:
    assert sorted(got[case]) == list(range(m)), (case, got.get(case))
    bad = {r: v for r, v in got[case].items() if not v["ok"]}
    assert not bad, (case, bad)


@needs_mpi
@pytest.mark.parametrize(("saves", "restores"), [
    ([(3, "rows"), (4, "grid")], [(2, "cols"), (4, "grid"), (3, "ceil")]),
    ([(4, "ceil"), (2, "cols"), (1, "rows")], [(3, "rows"), (4, "grid"), (1, "rows")]),
])
def test_odd_layouts_and_dtypes_restore_on_any_process_count(
    tmp_path: Path, saves: list[tuple[int, str]], restores: list[tuple[int, str]]
) -> None:
    """Uneven rows, ranks holding no rows, a 2 x 2 grid to rows and back, column splits
    read from row-split boxes (strided parts of boxes over 1 MiB: float32, bool, complex
    in global Zarr arrays; float8 in per-process files), every float8 type, bfloat16,
    int4/uint4, complex, bool, an empty value, a 0-d value, a Fortran-ordered shard, in
    both formats."""
    for n, layout in saves:
        got = _mpi(n, "save", str(tmp_path / f"n{n}{layout}"), layout)
        for suffix in (".h5", ".zarr"):
            _all_ok(got, f"save{suffix}", n)
    for m, layout in restores:
        for n, saved in saves:
            got = _mpi(m, "restore", str(tmp_path / f"n{n}{saved}"), layout)
            for suffix in (".h5", ".zarr"):
                _all_ok(got, f"restore{suffix}", m)


@needs_mpi
def test_partitioned_tables_restore_in_other_partition_and_process_counts(
    tmp_path: Path,
) -> None:
    """Tables saved by 3 processes in 3 partitions each (or 2, 3, 4: one count per rank)
    restore on 2 and 4 processes into other partition counts, by a Checkpoint and by
    restore_on_create."""
    for how in ("same", "mixed"):
        got = _mpi(3, "psave", str(tmp_path), how)
        for suffix in (".h5", ".zarr"):
            _all_ok(got, f"psave{suffix}", 3)
    for m in (2, 4):
        for how in ("same", "mixed"):
            got = _mpi(m, "prestore", str(tmp_path), f"p{how}")
            for case in ("prestore.h5ckpt", "prestore.h5create", "prestore.zarrckpt",
                         "prestore.zarrcreate"):
                _all_ok(got, case, m)


@needs_mpi
@pytest.mark.parametrize(("kind", "error", "key"), [
    ("shape", "CheckpointMismatchError", "'odd'"),
    ("shape1", "CheckpointMismatchError", "'odd'"),
    ("dtype1", "CheckpointMismatchError", "'bf16'"),
    ("extra1", "MissingValueError", "'nothere'"),
])
def test_a_restore_that_cannot_succeed_names_key_and_rank_and_changes_nothing(
    tmp_path: Path, kind: str, error: str, key: str
) -> None:
    got = _mpi(3, "save", str(tmp_path), "rows")
    got = _mpi(3, "bad", str(tmp_path), kind)
    for suffix in (".h5", ".zarr"):
        ranks = got[f"bad{suffix}"]
        assert sorted(ranks) == [0, 1, 2]
        for rank, r in ranks.items():
            assert r["changed"] == [], r
            assert key in r["message"], r
            if kind == "shape" or rank == 1:  # the failing rank raises what one process would
                assert r["error"] == error, r
            else:  # the others name it
                assert r["error"] == "DistributedError" and r["ranks"] == [1], r
                assert f"rank 1: {error}" in r["message"], r


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _torch(n: int, *args: str) -> dict[str, dict[int, dict[str, Any]]]:
    proc, got = launch(n, *args, env={"CASES_MODULE": "reshard_torch_cases",
                                      "MASTER_PORT": _free_port()})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return got


@needs_torch
def test_dtensors_of_odd_placements_and_dtypes_load_on_another_process_count(
    tmp_path: Path,
) -> None:
    """2 x 2 meshes (both placements orders, one tensor axis sharded over both mesh
    axes, replicated over one), uneven and empty local shards, float8, bfloat16, complex,
    bool and a 0-d DTensor: saved by 4 processes, loaded in place by 3, and back."""
    for n, m in ((4, 3), (3, 4)):
        saved = tmp_path / f"n{n}"
        got = _torch(n, "save", str(saved))
        for suffix in (".h5", ".zarr"):
            _all_ok(got, f"save{suffix}", n)
        got = _torch(m, "restore", str(saved))
        for suffix in (".h5", ".zarr"):
            _all_ok(got, f"restore{suffix}", m)


@needs_torch
def test_rank_0_leaving_right_after_a_save_does_not_fail_the_slower_ranks(
    tmp_path: Path,
) -> None:
    """Rank 0 hosts the c10d store: it no longer returns from a collective before the
    other ranks have read their parts, so its exit cannot cut their reads off."""
    got = _torch(3, "exit", str(tmp_path))
    _all_ok(got, "exit", 3)
