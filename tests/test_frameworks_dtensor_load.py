"""``cv.load(path, like=tree)`` with DTensor leaves, on real torch.distributed (gloo)
processes: any placement (rows, columns, uneven rows, replicated, 0-d, bfloat16) is
filled in place from a one-process HDF5 or Zarr checkpoint and from DTensors saved in
another placement. On CUDA (``gpu``), each local shard is filled through the pinned
staging buffer, a slab of rows at a time, never read to the host whole.

The ranks are forked by tests/mpi/torch_launch.py; the rank code is
tests/mpi/dtensor_load_cases.py. Every launch has a timeout, so no test can hang.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from test_distributed_torch import launch, pytestmark  # noqa: F401 - skips without torch

import ckptvar as cv

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
import dtensor_load_cases as cases

N = 2


def _run(d: Path, device: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    vals = cases.values()
    cv.save(d / "plain.h5", vals)
    cv.save(d / "plain.zarr", vals)
    proc, got = launch(N, str(d), device, env={"CASES_MODULE": "dtensor_load_cases",
                                               **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return got


def _all_ok(got: dict[str, Any], case: str) -> None:
    assert set(got[case]) == set(range(N)), got
    for rank, r in got[case].items():
        assert set(r["ok"]) == set(cases.SPECS), (case, rank, r)
        bad = [k for k, ok in r["ok"].items() if not ok]
        assert not bad, f"{case} on rank {rank}: {bad} not filled in place with their box"


def test_dtensors_of_any_placement_are_filled_in_place(tmp_path: Path) -> None:
    got = _run(tmp_path, "cpu")
    for case in ("plain.h5", "plain.zarr", "resharded"):
        _all_ok(got, case)


@pytest.mark.gpu
def test_cuda_dtensors_are_filled_through_the_pinned_buffer(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # a 64 KiB staging buffer: the 2 MiB local shard of "big" goes in 32 slabs
    got = _run(tmp_path, "cuda", env={"CKPTVAR_STAGING_BYTES": str(64 << 10)})
    for case in ("plain.h5", "plain.zarr", "resharded"):
        _all_ok(got, case)
    shard = 2048 * 512 * 4 // N
    for rank, r in got["plain.zarr"].items():  # imports were made by the first load
        assert r["peak"] < shard // 2, (rank, r["peak"])  # never a host copy of the shard
