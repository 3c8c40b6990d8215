"""Coordinator cases, run on every rank: ``mpiexec -n N python -m mpi4py
coordinator_cases.py CASE [CASE...]``, or for torch.distributed through
torch_launch.py (which forks the ranks and sets ``ENGINE=torch``).

Each rank writes one JSON line per case to ``$RESULT_DIR/rank<N>.jsonl`` (or prints
``RESULT <json>`` when ``RESULT_DIR`` is unset); the tests parse them. A case
that expects an error catches it and reports it, so a clean run exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from ckptvar.distributed import (
    Box,
    Coordinator,
    PlanCache,
    VariableLayout,
    from_env,
    gather_plan,
)
from ckptvar.errors import DistributedError, DistributedTimeoutError, ShardLayoutError

CURRENT = {"case": ""}


def report(coord: Coordinator, **fields: object) -> None:
    line = {"case": CURRENT["case"], "rank": coord.rank, "size": coord.size, **fields}
    out = os.environ.get("RESULT_DIR")
    if out:  # one file per rank: the ranks' stdout may be interleaved mid-line
        with open(os.path.join(out, f"rank{coord.rank}.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    else:
        print("RESULT " + json.dumps(line), flush=True)


def error_fields(exc: BaseException) -> dict[str, object]:
    return {
        "error": type(exc).__name__,
        "message": str(exc),
        "ranks": list(getattr(exc, "ranks", ())),
        "is_timeout": isinstance(exc, DistributedTimeoutError),
        "is_distributed": isinstance(exc, DistributedError),
    }


def collectives(coord: Coordinator) -> None:
    r, n = coord.rank, coord.size
    gathered = coord.allgather({"rank": r, "sq": r * r}, tag="g1", timeout=20)
    from_root = coord.broadcast(f"hello from {r}", root=n - 1, tag="b1", timeout=20)
    coord.barrier(tag="bar", timeout=20)
    # the background channel runs at the same time as the foreground's collectives
    bg = coord.background()
    bg_out: dict[str, object] = {}

    def run_bg() -> None:
        bg_out["g"] = [bg.allgather(r + 100 * i, tag=f"bg{i}", timeout=20) for i in range(5)]

    t = threading.Thread(target=run_bg)
    t.start()
    fg = [coord.allgather(-r - i, tag=f"fg{i}", timeout=20) for i in range(5)]
    t.join(30)
    coord.vote(None, tag="ok", timeout=20)
    report(
        coord,
        engine=type(coord).__name__,
        gathered=gathered,
        from_root=from_root,
        fg=fg,
        bg=bg_out.get("g"),
    )


def vote_raises(coord: Coordinator) -> None:
    outcome: BaseException | None = None
    if coord.rank == 1:
        outcome = OSError("disk full while writing shard 1")
    try:
        coord.vote(outcome, tag="save step 7", timeout=20)
    except (DistributedError, OSError) as exc:  # rank 1 raises its own error, as alone
        report(coord, **error_fields(exc), cause=repr(exc.__cause__),
               notes=list(getattr(exc, "__notes__", [])))
    else:
        report(coord, error=None)


def slow(coord: Coordinator) -> None:
    timeout = float(os.environ.get("CASE_TIMEOUT", "2"))
    slow_rank = coord.size - 1
    coord.barrier(tag="start", timeout=30)
    t0 = time.monotonic()
    outcome: BaseException | None = None
    if coord.rank == slow_rank:
        time.sleep(timeout + 2)
    try:
        coord.barrier(tag="after write", timeout=timeout)
    except DistributedTimeoutError as exc:
        outcome = exc
    elapsed = time.monotonic() - t0
    fields = error_fields(outcome) if outcome else {"error": None}
    try:  # the all-or-nothing step: everyone learns that the step failed
        coord.vote(outcome, tag="commit", timeout=timeout + 20)
        vote: dict[str, object] = {"error": None}
    except DistributedError as exc:
        vote = error_fields(exc)
    report(coord, elapsed=elapsed, timeout=timeout, slow_rank=slow_rank, vote=vote, **fields)


def killed(coord: Coordinator) -> None:
    coord.barrier(tag="start", timeout=30)
    if coord.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        coord.barrier(tag="after write", timeout=float(os.environ.get("CASE_TIMEOUT", "3")))
        report(coord, error=None)
    except DistributedError as exc:
        report(coord, elapsed=time.monotonic() - t0, **error_fields(exc))


def mismatch(coord: Coordinator) -> None:
    try:
        coord.allgather(coord.rank, tag=f"step {coord.rank % 2}", timeout=10)
        report(coord, error=None)
    except DistributedError as exc:
        report(coord, **error_fields(exc))


class CountingCoordinator(Coordinator):
    """Counts the allgathers of a real coordinator (it forwards every call)."""

    def __init__(self, inner: Coordinator) -> None:
        super().__init__(timeout=inner.timeout)
        self.inner = inner
        self.tags: list[str] = []

    rank = property(lambda self: self.inner.rank)  # type: ignore[assignment]
    size = property(lambda self: self.inner.size)  # type: ignore[assignment]

    def allgather(self, obj, *, tag, timeout=None):  # type: ignore[no-untyped-def]
        self.tags.append(tag)
        return self.inner.allgather(obj, tag=tag, timeout=timeout)

    def broadcast(self, obj, root=0, *, tag, timeout=None):  # type: ignore[no-untyped-def]
        return self.inner.broadcast(obj, root, tag=tag, timeout=timeout)

    def barrier(self, *, tag, timeout=None):  # type: ignore[no-untyped-def]
        self.inner.barrier(tag=tag, timeout=timeout)

    def background(self):  # type: ignore[no-untyped-def]
        return self.inner.background()


def plan(coord: Coordinator) -> None:
    r, n = coord.rank, coord.size
    rows = [3, 0, 5, 2][:n]  # uneven, with a zero-size shard on rank 1
    full = (sum(rows), 4)
    start = sum(rows[:r])
    layout = {
        "w": VariableLayout(full, "float32", (Box((start, 0), (rows[r], 4)),)),
        "bias": VariableLayout((4,), "float32"),
    }
    counting = CountingCoordinator(coord)
    cache = PlanCache()
    p1 = gather_plan(counting, layout, checksums={"bias": 7}, cache=cache, timeout=20)
    first = list(counting.tags)
    p2 = gather_plan(counting, layout, checksums={"bias": 7}, cache=cache, timeout=20)
    second = counting.tags[len(first) :]
    try:  # rank 0's replica differs from the others
        gather_plan(coord, layout, checksums={"bias": 7 if r else 8}, cache=cache, timeout=20)
        bad: dict[str, object] = {"error": None}
    except ShardLayoutError as exc:
        bad = error_fields(exc)
    report(
        coord,
        writes=[[it.key, list(it.box.offset), list(it.box.shape)] for it in p1.writes_for(r)],
        same=p1 == p2,
        first_tags=first,
        second_tags=second,
        bad=bad,
    )


CASES = {f.__name__: f for f in (collectives, vote_raises, slow, killed, mismatch, plan)}


def main(cases: list[str]) -> None:
    if os.environ.get("ENGINE") == "torch":
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=os.environ["INIT_METHOD"],
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    if os.environ.get("ENGINE") == "jax":
        import jax

        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR"],
            num_processes=int(os.environ["WORLD_SIZE"]),
            process_id=int(os.environ["RANK"]),
        )
    coord = from_env(timeout=60)
    for case in cases:
        CURRENT["case"] = case
        CASES[case](coord)
    coord.close()


if __name__ == "__main__":
    main(sys.argv[1:])
