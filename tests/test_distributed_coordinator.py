"""The coordinator interface in one process: the single-process engine, ``from_env``,
timeouts, ``vote`` and the distributed errors. (Many processes: test_distributed_mpi.py
and test_distributed_torch.py.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import ckptvar.distributed as dist
from ckptvar.errors import CkptError, DistributedError, DistributedTimeoutError


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in dist.MPI_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_from_env_outside_any_engine_is_one_process(no_engine: None) -> None:
    coord = dist.from_env(timeout=5)
    assert isinstance(coord, dist.SingleProcessCoordinator)
    assert (coord.rank, coord.size, coord.timeout, coord.is_primary) == (0, 1, 5.0, True)
    assert coord.allgather({"a": 1}, tag="t") == [{"a": 1}]
    assert coord.broadcast("x", tag="t") == "x"
    coord.barrier(tag="t", timeout=1)
    bg = coord.background()
    assert bg is coord.background() and bg is not coord
    assert repr(coord) == "<SingleProcessCoordinator rank 0 of 1>"


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_a_timeout_is_always_finite_and_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="positive, finite"):
        dist.SingleProcessCoordinator(timeout=bad)
    with pytest.raises(ValueError, match="positive, finite"):
        dist.SingleProcessCoordinator().barrier(tag="t", timeout=bad)


def test_vote_passes_on_success_and_raises_naming_the_rank() -> None:
    coord = dist.SingleProcessCoordinator()
    coord.vote(None, tag="save")
    coord.vote(True, tag="save")
    cause = OSError("no space left on device")
    with pytest.raises(OSError) as own:  # the failing process raises its own error, as alone
        coord.vote(cause, tag="save 3")
    assert own.value is cause
    assert own.value.__notes__ == [
        "(on rank 0: 'save 3' failed on 1 of 1 processes (rank 0): "
        "rank 0: OSError: no space left on device)"
    ]
    timeout = DistributedTimeoutError("barrier timed out", ranks=(2,))
    with pytest.raises(DistributedError, match=r"'save 4' failed on 1 of 1") as info:
        coord.vote(timeout, tag="save 4")  # a distributed failure: the vote's error, chained
    assert info.value.ranks == (0,)
    assert info.value.failures == {0: "DistributedTimeoutError: barrier timed out"}
    assert info.value.__cause__ is timeout
    with pytest.raises(DistributedError, match="no exception given"):
        coord.vote(False, tag="save")
    with pytest.raises(TypeError, match="vote"):
        coord.vote("ok", tag="save")  # type: ignore[arg-type]


def test_error_classes() -> None:
    exc = DistributedTimeoutError(
        "barrier(tag='x') timed out after 2 s on rank 0: nothing arrived from rank 3",
        collective="barrier",
        tag="x",
        timeout=2.0,
        ranks=(3,),
    )
    assert isinstance(exc, DistributedError) and isinstance(exc, CkptError)
    assert isinstance(exc, TimeoutError)
    assert (exc.collective, exc.tag, exc.timeout, exc.ranks) == ("barrier", "x", 2.0, (3,))
    assert "rank 3" in str(exc)


TORCH_CHECKS = """
import torch.distributed as tdist
import ckptvar.distributed as dist
from ckptvar.errors import DistributedError, DistributedTimeoutError

assert not tdist.is_initialized()
try:
    dist.TorchCoordinator()
except DistributedError as exc:
    assert "not initialised" in str(exc), exc
else:
    raise AssertionError("TorchCoordinator() without a process group did not raise")

# a bare FileStore: rank 0 alone at a barrier times out naming rank 1
store = tdist.FileStore(STORE, 2)
r0 = dist.TorchCoordinator(store=store, rank=0, size=2, timeout=5)
try:
    r0.barrier(tag="b", timeout=0.3)
except DistributedTimeoutError as exc:
    assert exc.ranks == (1,) and exc.collective == "barrier", exc
    assert "nothing arrived from rank 1" in str(exc), exc
else:
    raise AssertionError("the barrier did not time out")
print("ok")
"""


def test_the_torch_coordinator_alone(tmp_path: Path) -> None:
    """No process group: a clear error; a bare store: the timeout names the missing rank.

    Runs in a child process, so this test process never imports torch."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed")
    code = f"STORE = {str(tmp_path / 'store')!r}\n" + TORCH_CHECKS
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
