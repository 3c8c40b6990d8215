"""Framework state saved and restored by real torch.distributed (gloo) jobs: FSDP2 models
and optimizers, DTensors on 1-D and 2-D meshes, uneven shards; restored on another
process count with bit-identical training, and read by one plain process.

The ranks are forked by tests/mpi/torch_launch.py; the rank code is
tests/mpi/framework_cases.py. Every launch has a timeout, so no test can hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_distributed_torch import launch, pytestmark  # noqa: F401 - skips without torch

import ckptvar as cv
from ckptvar.distributed import MPI_ENV_VARS

torch = pytest.importorskip("torch")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(n: int, *args: str) -> dict[str, dict[int, dict[str, Any]]]:
    proc, got = launch(n, *args, env={"CASES_MODULE": "framework_cases",
                                      "MASTER_PORT": _free_port()})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return got


def _reference(steps: int) -> list[float]:
    """The same training in one process, no FSDP: what every job must reproduce."""
    sys.path.insert(0, str(Path(__file__).parent / "mpi"))
    import framework_cases as fc

    model, opt = fc.build(None)
    return fc.train(model, opt, 0, steps)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    d = tmp_path_factory.mktemp("fsdp")
    return d, _run(4, "save", str(d))


def test_fsdp2_save_on_4_processes(saved: tuple[Path, dict[str, Any]]) -> None:
    d, got = saved
    assert {r["engine"] for r in got["fsdp"].values()} == {"TorchCoordinator"}
    # uneven FSDP2 shards (10 rows on 4 processes: 3, 3, 3, 1) train as one process does
    assert got["fsdp"][0]["losses"] == _reference(6)
    values = cv.load(d / "fsdp-1.h5")  # one plain process: the logical values
    assert {"model/0.weight", "model/2.bias", "optimizer/state/0/exp_avg",
            "optimizer/state/3/exp_avg_sq", "optimizer/state/0/step"} <= set(values)
    rank0 = got["fsdp"][0]
    assert values["model/0.weight"].shape == (10, 6)
    assert values["model/0.weight"].ravel().tolist() == rank0["w0"]
    assert values["optimizer/state/1/exp_avg"].tolist() == rank0["avg"]
    assert values["optimizer/state/0/step"] == 3.0
    # a second save of the same tensors asks torch for no DTensor box (all cached)
    assert [r["box_calls"] for r in got["again"].values()] == [0, 0, 0, 0]


def test_fsdp2_background_saves_hold_the_values_of_their_call(
        saved: tuple[Path, dict[str, Any]]) -> None:
    """Training goes on in place right after each background save returns (the second
    and third snapshots reuse the first one's host buffer): each file holds its call's
    values."""
    _, got = saved
    assert [r["same"] for r in got["background"].values()] == [True] * 4
    assert got["background"][0]["changed"]


@pytest.fixture(scope="module")
def jaxed(saved: tuple[Path, dict[str, Any]]) -> dict[str, Any]:
    """One JAX process with 8 CPU devices reads the torch checkpoints and writes its own."""
    pytest.importorskip("jax")
    d, _ = saved
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "mpi" /
                                               "jax_framework_case.py"), str(d)],
                          capture_output=True, text=True, timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_jax_named_shardings_reshard_and_cross_framework(jaxed: dict[str, Any]) -> None:
    assert jaxed["devices"] == 8
    assert "opt/0/mu/w" in jaxed["keys"] and "opt/0/count" in jaxed["keys"]
    for target in ("4x2", "8x1"):  # saved on a 2 x 4 mesh, read into another mesh shape
        assert all(jaxed[target].values()), jaxed[target]
    assert "'params/w'" in jaxed["mismatch"] and "(8, 11)" in jaxed["mismatch"]
    assert all(jaxed["from_torch"].values()), jaxed["from_torch"]  # torch 4 procs -> JAX 8
    assert jaxed["fsdp_to_jax"]


@pytest.mark.parametrize("m", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fsdp2_restore_on_another_process_count(saved: tuple[Path, dict[str, Any]],
                                                jaxed: dict[str, Any], m: int) -> None:
    d, got = saved
    restored = _run(m, "restore", str(d))
    # training goes on as if it had never stopped, bit for bit, on another process count
    assert restored["fsdp"][0]["losses"] == got["fsdp"][0]["losses"][3:] == _reference(6)[3:]
    for r in range(m):
        assert all(restored["dt"][r]["ok"].values()), restored["dt"][r]
        assert restored["from_jax"][r]["ok"]  # JAX (8 devices) -> torch DTensors
        # a process failing a save or a restore: all raise naming it, nothing changes
        save = restored["fail"][r]  # rank 1 raises its own error, the others name it
        assert save["raised"] == ("TypeError" if r == 1 else "DistributedError"), save
        assert ("rank 1: TypeError" in save["message"]) == (r != 1), save
        assert "'oops'" in save["message"], save
        # every process finds the checkpoint missing itself: each raises what one would
        assert restored["fail_restore"][r]["raised"] == "CheckpointNotFoundError"
        load = restored["fail_load"][r]  # the last rank asks for a key the checkpoint lacks
        if r == m - 1:  # it raises what one process would; the others name it
            assert load["raised"] == "MissingValueError", load  # a KeyError too
        else:
            assert load["raised"] == "DistributedError" and f"rank {m - 1}" in load["message"]
        assert "'nope'" in load["message"] and load["untouched"], load
        assert restored["untouched"][r]["ok"]
    assert not (d / "fail").exists() or not list((d / "fail").iterdir())  # nothing committed


def test_peak_host_memory_is_the_shard_at_most(saved: tuple[Path, dict[str, Any]]) -> None:
    _, got = saved
    for r, m in got["memory"].items():
        assert m["ok"], m
        assert m["save"] <= 0.05 * m["shard"], (r, m)  # written from the tensor's memory
        # read into one temporary of the shard (at most TEMPORARY_BUDGET bytes), then copied
        assert m["load"] <= 1.05 * m["shard"], (r, m)


def test_dtensors_saved_from_their_sharding(saved: tuple[Path, dict[str, Any]]) -> None:
    d, _ = saved
    import framework_cases as fc

    values = cv.load(d / "dt.h5")
    for i, key in enumerate(sorted(values)):
        want = fc.full(values[key].shape, i).numpy()
        assert values[key].tobytes() == want.tobytes(), key
    out = subprocess.run([sys.executable, "-m", "ckptvar.cli", "inspect", str(d / "dt.h5")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "grid" in out.stdout and "(6, 10)" in out.stdout.replace("6 x 10", "(6, 10)")
    ver = subprocess.run([sys.executable, "-m", "ckptvar.cli", "verify", str(d / "dt.h5")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert ver.returncode == 0, ver.stdout + ver.stderr
    assert np.all(values["rep"] == fc.full((5,), 2).numpy())


def test_jax_distributed_two_processes_save_and_reshard(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               JAX_COORDINATOR=f"127.0.0.1:{port}", WORLD_SIZE="2")
    script = str(Path(__file__).parent / "mpi" / "jax_dist_case.py")
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, out[-2000:] + err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in outs:
        assert r["engine"] == "JaxCoordinator" and r["local"] == 2 and r["global"] == 4, r
        assert r["ok"] and r["sharding"] and r["step"] == 4 and r["r"], r
        assert r["node"] == ["State", True, 4, True], r  # a registered node: the same
    values = cv.load(tmp_path / "jd.h5")  # one plain process: the logical value
    sys.path.insert(0, str(Path(__file__).parent / "mpi"))
    import jax_dist_case

    assert values["w"].tobytes() == jax_dist_case.FULL.tobytes()
    assert sorted(cv.load(tmp_path / "node.h5")) == ["params/r", "params/w"]
