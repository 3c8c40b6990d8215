"""Real torch training loops checkpointed by a CheckpointManager: a run stopped at step k
and resumed from its latest checkpoint continues bit for bit like the run that never
stopped (losses and final parameters), with AdamW, an LR scheduler, a GradScaler, a
seeded DataLoader and the RNG states in the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ckptvar as cv

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the test extra has it)")

_DATA = torch.utils.data.TensorDataset(
    torch.randn(40, 6, generator=torch.Generator().manual_seed(11)),
    torch.randn(40, 1, generator=torch.Generator().manual_seed(12)))
_BATCH = 8  # 5 batches an epoch


class Progress(cv.Trackable):
    """The loop's position: epoch, batch within it, and the sampler's generator state at
    the start of the epoch (what the epoch's shuffle is drawn from)."""

    def __init__(self, gen: Any) -> None:
        self.gen = gen
        self.epoch = 0
        self.batch = 0
        self.epoch_gen_state = gen.get_state()

    def python_state(self) -> Any:
        return {"epoch": self.epoch, "batch": self.batch,
                "gen": bytes(self.epoch_gen_state.numpy().tobytes())}

    def restore_python_state(self, state: Any) -> None:
        self.epoch, self.batch = state["epoch"], state["batch"]
        self.epoch_gen_state = torch.frombuffer(bytearray(state["gen"]), dtype=torch.uint8)


def _lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


def _build(sched_kind: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if sched_kind == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    gen = torch.Generator().manual_seed(5)
    sampler = torch.utils.data.RandomSampler(_DATA, generator=gen)
    # the loader's own generator too: each iter() draws a base seed from it, else from
    # the global RNG, which the steps between two epochs' starts move
    loader = torch.utils.data.DataLoader(_DATA, batch_size=_BATCH, sampler=sampler, generator=gen)
    torch.manual_seed(123)  # the global RNG (dropout) from here
    return {"model": model, "opt": opt, "sched": sched, "scaler": scaler, "gen": gen,
            "loader": loader, "progress": Progress(gen)}


def _train(parts: dict[str, Any], steps: int, every: int,
           mgr: Any | None = None) -> list[float]:
    """``steps`` optimizer steps from where ``parts`` stand; a save every ``every``."""
    model, opt, sched, scaler = parts["model"], parts["opt"], parts["sched"], parts["scaler"]
    gen, loader, progress = parts["gen"], parts["loader"], parts["progress"]
    losses: list[float] = []
    while len(losses) < steps:
        gen.set_state(progress.epoch_gen_state)
        batches = iter(loader)
        for _ in range(progress.batch):  # the batches this epoch took before the stop
            next(batches)
        for x, y in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = ((out.float() - y) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            losses.append(loss.item())
            progress.batch += 1
            if mgr is not None and len(losses) % every == 0:
                mgr.save()
            if len(losses) == steps:
                break
        else:
            progress.epoch += 1
            progress.batch = 0
            progress.epoch_gen_state = gen.get_state()
    return losses


def _checkpoint(parts: dict[str, Any]) -> Any:
    return cv.Checkpoint(model=parts["model"], optimizer=parts["opt"],
                         scheduler=parts["sched"], scaler=parts["scaler"],
                         progress=parts["progress"], rng=torch.default_generator)


def _params(model: Any) -> list[Any]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("sched_kind", "options"), [
    ("onecycle", {}),
    pytest.param("lambda", {"async_save": True}, marks=pytest.mark.slow),
    pytest.param("onecycle", {"incremental": True, "format": "zarr"}, marks=pytest.mark.slow),
    ("lambda", {"async_save": True, "incremental": True, "format": "zarr"}),
])
def test_a_stopped_run_resumes_bit_for_bit(tmp_path: Path, sched_kind: str,
                                           options: dict[str, Any]) -> None:
    total, stop, every = 17, 11, 4
    ref = _build(sched_kind)
    expected = _train(ref, total, every)
    expected_params = _params(ref["model"])

    run = _build(sched_kind)
    mgr = cv.CheckpointManager(_checkpoint(run), tmp_path, max_to_keep=2, **options)
    first = _train(run, stop, every, mgr)
    mgr.wait_until_finished()
    assert Path(mgr.latest_checkpoint).name.startswith("ckpt-2.")  # step 8
    del run, mgr

    again = _build(sched_kind)
    torch.manual_seed(999)  # whatever the new process's RNG is, the checkpoint's comes back
    mgr = cv.CheckpointManager(_checkpoint(again), tmp_path, max_to_keep=2, **options)
    assert mgr.restore_or_initialize() is not None
    mgr.restore_status.assert_consumed()
    done = 8
    assert again["progress"].epoch * 5 + again["progress"].batch == done
    rest = _train(again, total - done, every, mgr)
    mgr.wait_until_finished()
    assert first[:done] + rest == expected
    assert all(torch.equal(a, b) for a, b in zip(_params(again["model"]), expected_params,
                                                   strict=True))


def test_a_torch_generator_is_checkpointed_with_its_state(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    torch.randn(5, generator=gen)
    ckpt = cv.Checkpoint(rng=gen, global_rng=torch.default_generator)
    path = ckpt.save(tmp_path / "ckpt")
    expected, expected_global = torch.randn(4, generator=gen), torch.rand(3)
    stored = {k: (shape, dtype) for k, shape, dtype in cv.list_variables(path)}
    assert stored["rng/state"][1] == "uint8" and "global_rng/state" in stored

    gen2 = torch.Generator().manual_seed(99)
    torch.manual_seed(99)
    again = cv.Checkpoint(rng=gen2, global_rng=torch.default_generator)
    status = again.restore(path)
    assert torch.equal(torch.randn(4, generator=gen2), expected)
    assert torch.equal(torch.rand(3), expected_global)
    status.assert_consumed()  # the generators drew since: still the objects restored
    path = again.save(tmp_path / "ckpt")  # their state now, not the restored one
    gen2.manual_seed(99)
    again.restore(path).assert_consumed()
    assert torch.equal(gen2.get_state(), gen.get_state())

    # all or nothing: a value that does not fit leaves the generator as it was
    cv.Checkpoint(rng=gen, w=cv.Variable([1.0, 2.0], name="w")).save(tmp_path / "other")
    gen3 = torch.Generator().manual_seed(7)
    before = gen3.get_state()
    with pytest.raises(cv.CheckpointMismatchError, match="'w'"):
        cv.Checkpoint(rng=gen3, w=cv.Variable([1.0, 2.0, 3.0], name="w")).restore(
            tmp_path / "other-1.h5")
    assert torch.equal(gen3.get_state(), before)


@pytest.mark.slow
def test_a_run_killed_during_a_background_save_resumes_bit_for_bit(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    job = Path(__file__).parent / "mpi" / "torch_trainloop_job.py"

    def run(kill_at: int) -> tuple[int, list[float], int]:
        proc = subprocess.run([sys.executable, str(job), str(tmp_path), "17", str(kill_at)],
                              capture_output=True, text=True, timeout=300, check=False)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert lines, proc.stderr[-3000:]
        return lines[0]["start"], [x["loss"] for x in lines[1:]], proc.returncode

    expected = _train(_build("lambda"), 17, 4)
    start, first, code = run(12)  # SIGKILL just after the save of step 12 returned
    assert (start, code) == (0, -9) and first == expected[:12]
    start, rest, code = run(0)
    assert code == 0 and start in (8, 12)  # step 12 committed before the kill, or not
    assert rest == expected[start:]


def test_objects_attached_after_the_restore_take_their_whole_state(tmp_path: Path) -> None:
    # ckpt.restore(path) first, the objects built later (restore as initialization)
    parts = _build("lambda")
    _train(parts, 6, 100)
    path = _checkpoint(parts).save(tmp_path / "ckpt")
    expected = _train(parts, 4, 100)

    again = _build("lambda")
    ckpt = cv.Checkpoint()
    status = ckpt.restore(path)
    for name, obj in [("model", again["model"]), ("optimizer", again["opt"]),
                      ("scheduler", again["sched"]), ("scaler", again["scaler"]),
                      ("progress", again["progress"]), ("rng", torch.default_generator)]:
        setattr(ckpt, name, obj)
    assert len(again["opt"].state) == 4 and again["sched"].last_epoch == 6
    status.assert_consumed()
    assert _train(again, 4, 100) == expected
