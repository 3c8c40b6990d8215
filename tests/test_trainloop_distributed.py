"""A torch training loop on gloo processes (FSDP2, AdamW, an LR scheduler, the global
RNG) checkpointed by a CheckpointManager on 2 processes, stopped, and resumed on 1 and on
4: the losses and final parameters are those of one uninterrupted process, bit for bit
(``-m slow``; the default run checks what a collective save says of per-process state).

The ranks are forked by tests/mpi/torch_launch.py; the rank code is
tests/mpi/trainloop_cases.py."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from test_distributed_torch import launch, pytestmark  # noqa: F401 - skips without torch

from ckptvar.distributed import VariableLayout, check_replicas, plan_save
from ckptvar.errors import ShardLayoutError

torch = pytest.importorskip("torch")

STEPS, STOP = 8, 5  # saved at 2 and 4, stopped after 5


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(n: int, d: Path, stop: int) -> dict[str, Any]:
    proc, got = launch(n, "run", str(d), str(STEPS), str(stop),
                       env={"CASES_MODULE": "trainloop_cases", "MASTER_PORT": _free_port()})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(got["run"][0])


def _reference() -> tuple[list[float], list[list[float]]]:
    """The same loop in one plain process, no FSDP, no checkpoint."""
    sys.path.insert(0, str(Path(__file__).parent / "mpi"))
    import trainloop_cases as tc

    model, opt, sched = tc.build(None)
    return tc.train(model, opt, sched, 0, 0, STEPS), tc.full_params(model)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    d = tmp_path_factory.mktemp("trainloop") / "run"
    return d, _run(2, d, STOP)


@pytest.mark.slow  # 3 launches of gloo processes: over 30 s on 2 cores
@pytest.mark.parametrize("n", [1, 4])
def test_a_run_saved_on_2_processes_resumes_on_another_count(
        stopped: tuple[Path, dict[str, Any]], n: int, tmp_path: Path) -> None:
    d, first = stopped
    losses, params = _reference()
    assert first["start"] == 0 and first["losses"] == losses[:STOP]
    copy = tmp_path / "run"
    shutil.copytree(d, copy)
    resumed = _run(n, copy, STEPS)
    assert resumed["start"] == 4  # the latest step: 4, the loss of step 5 is drawn again
    assert first["losses"][:4] + resumed["losses"] == losses
    assert resumed["params"] == params


def test_replicas_that_differ_say_how_to_keep_a_state_of_each_process() -> None:
    # a generator seeded per process (rank-dependent augmentation) under a coordinator
    layouts = [{"rng/state": VariableLayout((5056,), "u1")} for _ in range(2)]
    plan = plan_save(layouts)
    with pytest.raises(ShardLayoutError, match=r"'rng/state' .* replicas differ: checksum 1 "
                       r"on rank 0; checksum 2 on rank 1\. .*seeded per process.*"
                       r"cv\.Shard\(full_shape=\(processes, \.\.\.\), offset=\(rank, \.\.\.\)\)"):
        check_replicas(plan, [{"rng/state": 1}, {"rng/state": 2}])
