"""A real torch.distributed (gloo) job saves one sharded checkpoint and another job,
with a different process count, restores it bit for bit.

The ranks are forked by tests/mpi/torch_launch.py (torch imported once) and join a
gloo group on 127.0.0.1; the rank code is tests/mpi/torch_save_cases.py. Every launch
has a timeout, so no test can hang.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_distributed_torch import launch, pytestmark  # noqa: F401 - skips without torch

import ckptvar as cv


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(n: int, *args: str) -> dict[str, dict[int, dict[str, Any]]]:
    proc, got = launch(n, *args, env={"CASES_MODULE": "torch_save_cases",
                                      "MASTER_PORT": _free_port()})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return got


@pytest.mark.parametrize(("n", "m"), [(3, 2), pytest.param(2, 3, marks=pytest.mark.slow)])
def test_save_on_n_torch_processes_restore_on_m(tmp_path: Path, n: int, m: int) -> None:
    saved = _run(n, "save", str(tmp_path))
    for suffix in (".h5", ".zarr"):
        assert sorted(saved[f"save{suffix}"]) == list(range(n))
        assert {r["engine"] for r in saved[f"save{suffix}"].values()} == {"TorchCoordinator"}
        path = tmp_path / f"ckpt-1{suffix}"
        values = cv.load(path)  # one process sees the logical values
        expect = (np.arange(37 * 5) * 7 / 3).astype("float32").reshape(37, 5)
        assert values["w"].tobytes() == expect.tobytes()
        assert values["e"].shape == (6, 10) and values["e"].dtype == np.int64
    got = _run(m, "restore", str(tmp_path))
    for suffix in (".h5", ".zarr"):
        ranks = got[f"restore{suffix}"]
        assert sorted(ranks) == list(range(m))
        for r in ranks.values():
            assert r["ok"] and r["counter"] == 1 and r["engine"] == "TorchCoordinator", r
