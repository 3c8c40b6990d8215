"""Saved by N processes, restored by M.

The rank code is tests/mpi/reshard_torch_cases.py (torch.distributed, gloo, forked by
torch_launch.py). All of it runs many processes, so it is ``-m slow``.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from typing import Any

import pytest
from test_distributed_torch import launch

pytestmark = pytest.mark.slow

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="PyTorch is not installed")


def _all_ok(got: dict[str, dict[int, dict[str, Any]]], case: str, m: int) -> None:
    assert sorted(got[case]) == list(range(m)), (case, got.get(case))
    bad = {r: v for r, v in got[case].items() if not v["ok"]}
    assert not bad, (case, bad)


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
def test_rank_0_leaving_right_after_a_save_does_not_fail_the_slower_ranks(
    tmp_path: Path,
) -> None:
    """Rank 0 hosts the c10d store: it no longer returns from a collective before the
    other ranks have read their parts, so its exit cannot cut their reads off."""
    got = _torch(3, "exit", str(tmp_path))
    _all_ok(got, "exit", 3)
