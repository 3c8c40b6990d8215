"""kill -9 at random moments of saving: earlier checkpoints survive, nothing partial is final.

One helper process imports ckptvar once, then for each trial forks a child that
opens a ``CheckpointManager`` on the same directory (recovering from the previous
kill), restores the latest checkpoint and saves in a loop; the helper kills it with
SIGKILL after a seeded random delay, then forks a checker. The checker asserts that
every listed checkpoint and every file under a final ``ckpt-N`` name is complete,
verifies its checksums and is consistent (each checkpoint holds one step's values).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_distributed_mpi import _mpi_skip_reason

import ckptvar as cv
from ckptvar.storage.atomic import is_partial

#: The multi-process kinds need ``mpiexec`` and mpi4py (the test extra has both).
needs_mpi = pytest.mark.skipif(_mpi_skip_reason() is not None,
                               reason=_mpi_skip_reason() or "")

SCRIPT = textwrap.dedent(
    r'''
    import json, os, random, re, signal, sys, time
    import numpy as np
    import h5py  # noqa: F401 - loaded before the fork, so a child's first save is not an import
    import zarr  # noqa: F401
    import ckptvar as cv
    from ckptvar.storage import backend_for

    cv.CheckpointManager  # noqa: B018 - ckptvar loads names on first use: load before the fork

    directory, fmt, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    budget, window = float(sys.argv[4]), float(sys.argv[5])
    MIN_TRIALS = 12  # a loaded machine runs fewer trials in the budget: never fewer than this
    FINAL = re.compile(r"^ckpt-\d+\.(h5|zarr)$")
    N = 50_000

    def saver():
        big = cv.Variable(np.zeros(N), name="big")
        small = [cv.Variable(np.zeros(3, np.float32), name=f"s{i}") for i in range(20)]
        step = cv.Variable(0, dtype="int64", name="step")
        ckpt = cv.Checkpoint(big=big, small=small, step=step)
        manager = cv.CheckpointManager(ckpt, directory, max_to_keep=3, format=fmt)
        manager.restore_or_initialize()
        os.write(1, b"r")
        while True:
            s = int(step.numpy()) + 1
            step.assign(s)
            big.assign(np.full(N, float(s)))
            for v in small:
                v.assign(np.full(3, float(s), np.float32))
            manager.save()

    def check_file(path):
        with backend_for(path).open_reader(__import__("pathlib").Path(path)) as r:
            values = dict(r.read_many(list(r.keys()), verify=True))
        s = int(values["step"])
        for key, value in values.items():
            if key not in ("step", "save_counter") and not (value == s).all():
                raise AssertionError(f"{path}: {key} does not hold step {s}")

    def checker():
        state_file = os.path.join(directory, "checkpoint_state.json")
        listed = []
        if os.path.exists(state_file):
            with open(state_file) as f:
                state = json.load(f)
            listed = [e["path"] for e in state["sections"].get("ckpt", {}).get("checkpoints", [])]
        for name in listed:
            check_file(os.path.join(directory, name))
        finals = [n for n in os.listdir(directory) if FINAL.match(n)]
        for name in finals:
            check_file(os.path.join(directory, name))
        # The committed files are the record (the state file caches them): the latest is
        # the newest committed step, listed or not yet.
        latest = cv.latest_checkpoint(directory)
        newest = max(finals, key=lambda n: int(n.split("-")[1].split(".")[0]), default=None)
        if newest is not None and latest != os.path.join(directory, newest):
            raise AssertionError(f"latest {latest} is not the newest committed {newest}")
        return len(listed)

    rng = random.Random(seed)
    deadline = time.monotonic() + budget
    trials = survived = 0
    while trials < MIN_TRIALS or time.monotonic() < deadline:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.dup2(w, 1)
            try:
                saver()
            finally:
                os._exit(3)
        os.close(w)
        os.read(r, 1)  # imported, manager open, restored: now saving
        os.close(r)
        time.sleep(rng.uniform(0.0, window))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        trials += 1
        cpid = os.fork()
        if cpid == 0:
            try:
                checker()
            except BaseException as exc:
                print(f"trial {trials}: {exc!r}", file=sys.stderr, flush=True)
                os._exit(1)
            os._exit(0)
        _, cstatus = os.waitpid(cpid, 0)
        if os.waitstatus_to_exitcode(cstatus) != 0:
            print(f"FAILED after {trials} trials", flush=True)
            sys.exit(1)
        survived += 1
    print(f"{trials} {survived}", flush=True)
    '''
)


def test_kill_9_during_saves_never_damages_checkpoints(tmp_path: Path, fmt: str) -> None:
    script = tmp_path / "crash_loop.py"
    script.write_text(SCRIPT)
    directory = tmp_path / "run"
    seed = {"h5": 1234, "zarr": 4321}[fmt]
    window = {"h5": "0.15", "zarr": "0.4"}[fmt]  # a few saves' time: kills land anywhere
    proc = subprocess.run(
        [sys.executable, str(script), str(directory), fmt, str(seed), "5", window],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trials, survived = map(int, proc.stdout.split())
    assert trials >= 12 and survived == trials, proc.stdout
    # a manager opened afterwards cleans the temporaries and restores a whole step
    with cv.Graph().as_default():
        big = cv.Variable(np.zeros(50_000), name="big")
        small = [cv.Variable(np.zeros(3, np.float32), name=f"s{i}") for i in range(20)]
        step = cv.Variable(0, dtype="int64", name="step")
        manager = cv.CheckpointManager(
            cv.Checkpoint(big=big, small=small, step=step), directory, max_to_keep=3, format=fmt
        )
        assert not [p for p in directory.iterdir() if is_partial(p.name)]
        assert manager.restore_or_initialize() is not None
        assert int(step.numpy()) > 0
        assert (big.numpy() == int(step.numpy())).all()
        # killed saves may have committed steps they could not record: they are listed too,
        # and pruned by the rule at the next save
        manager.save()
        assert len(manager.checkpoints) == 3
    print(f"{fmt}: {trials} kill -9 trials, all survived")


@pytest.mark.parametrize("fail_at", ["add", "commit"])
def test_an_exception_mid_save_leaves_the_previous_checkpoint(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph, fail_at: str
) -> None:
    """A writer that raises (e.g. disk full) mid-save: no final file, earlier one intact."""
    v = cv.Variable(np.arange(5.0), name="v")
    manager = cv.CheckpointManager(cv.Checkpoint(v=v), tmp_path, format=fmt)
    first = manager.save()

    class Boom(Exception):
        pass

    def explode(*args: object, **kwargs: object) -> None:
        raise Boom

    from ckptvar.storage import backend_for

    writer_cls = type(backend_for(first).open_writer(tmp_path / f"probe.{fmt}", durable=False))
    mp = pytest.MonkeyPatch()
    mp.setattr(writer_cls, fail_at, explode)
    try:
        v.assign(np.zeros(5))
        with pytest.raises(Boom):
            manager.save()
    finally:
        mp.undo()
    assert manager.checkpoints == [first] and cv.latest_checkpoint(tmp_path) == first
    leftovers = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert leftovers == ["checkpoint_state.json", Path(first).name]
    cv.Checkpoint(v=v).restore(first).expect_partial()
    np.testing.assert_array_equal(v.numpy(), np.arange(5.0))


# --------------------------------------------------------------------------- restart harness
# SIGKILL at random moments of saves (one process, three processes on a shared directory,
# three processes to S3), then a restarted job (fresh processes, tests/mpi/crash_job.py)
# restores the latest committed step bit-exact and saves the next, with nothing of the dead
# save left after that first save. A few kills of each kind in the default run; >= 100 with
# ``pytest -m slow``.

JOB = Path(__file__).parent / "mpi" / "crash_job.py"


def _committed(where: str, fmt: str, opts: dict[str, object] | None) -> dict[int, str]:
    """The committed steps at ``where`` (number -> path), by the record itself (names or
    markers)."""
    from ckptvar.locations import list_committed_steps, open_location, step_number

    if "://" in where:
        steps = list_committed_steps(open_location(where, storage_options=opts))
        return {n: f"{where}/{s}" for s in steps if (n := step_number(s)) is not None}
    if not os.path.isdir(where):
        return {}
    found = [re.fullmatch(rf"ckpt-(\d+)\.{fmt}", n) for n in os.listdir(where)]
    return {int(m.group(1)): os.path.join(where, m.group()) for m in found if m}


def _local_steps(tier: str | None, fmt: str, processes: int) -> dict[int, str]:
    """The local tier's committed steps; on per-node disks (``{node}`` in ``tier``, 2
    processes a node) those committed on every node (number -> node 0's path)."""
    if tier is None:
        return {}
    if "{node}" not in tier:
        return _committed(tier, fmt, None)
    nodes = [_committed(tier.format(node=k), fmt, None) for k in range(processes // 2)]
    return {n: p for n, p in nodes[0].items() if all(n in other for other in nodes[1:])}


def _number(path: object) -> int:
    """The step number of a restored path (0: nothing restored)."""
    m = re.search(r"ckpt-(\d+)\.", str(path or ""))
    return int(m.group(1)) if m else 0


def _events(results: Path, job: int) -> dict[int, list[dict[str, object]]]:
    out: dict[int, list[dict[str, object]]] = {}
    for path in results.glob(f"job{job}-rank*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                out.setdefault(int(e["rank"]), []).append(e)
    return out


def _intact(path: str, n: int, opts: dict[str, object] | None, *, same: bool = True) -> bool:
    """Whether committed step ``n`` at ``path`` loads, verified, holding step ``n``'s values
    (``same=False``: one consistent state of a step up to ``n``, which a save numbered
    past a step committed on some node only holds)."""
    got = cv.load(path, storage_options=opts)
    held = int(got["step"])
    grid = np.arange(48 * 2000, dtype=np.float64).reshape(48, 2000)
    return ((held == n if same else 0 < held <= n)
            and np.array_equal(got["w"], grid * 1e-3 + held)
            and np.array_equal(got["b"], np.full(7, held, np.float32)))


def restart_harness(  # noqa: C901, PLR0912, PLR0915 - the harness, step by step
    where: str, fmt: str, *, processes: int, kills: int, seed: int, work: Path,
    opts: dict[str, object] | None = None, window: float = 1.0, tier: str | None = None,
    incremental: bool = False,
) -> dict[str, int]:
    """Kill ``kills`` jobs saving to ``where`` at random moments; each restarted job must
    restore the latest committed step bit-exact and save the next, leaving nothing of the
    dead save. With ``tier``, the jobs save every step to that local directory and persist
    each to ``where`` in the background (the kills land in those uploads too); with
    ``incremental``, an incremental manager (a value that never changes: every step
    refers to the first one's bytes). Returns the counts (every one but ``kills`` must
    be 0)."""
    import random
    import signal
    import time

    from test_distributed_mpi import find_mpiexec

    from ckptvar.distributed import MPI_ENV_VARS

    rng = random.Random(seed)
    # per-node tiers: a step committed on some node only (a kill between the nodes'
    # renames) is not restored, and its number is not used again, so the next save
    # holds the previous step's state under a later number ("continues past")
    per_node = tier is not None and "{node}" in tier
    results, tmpdir = work / "results", work / "tmp"
    results.mkdir(parents=True, exist_ok=True)
    tmpdir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    env.update(RESULT_DIR=str(results), TMPDIR=str(tmpdir),
               PYTHONPATH=os.pathsep.join(sys.path), S3_OPTIONS=json.dumps(opts),
               LOCAL_TIER=tier or "", INCREMENTAL="1" if incremental else "")
    if processes > 1:
        mpiexec = find_mpiexec()
        assert mpiexec is not None
        prefix = [mpiexec, "-n", str(processes), sys.executable, "-m", "mpi4py"]
    else:
        prefix = [sys.executable]
    counts = {"kills": 0, "broken": 0, "lost": 0, "blocked": 0, "leftovers": 0,
              "not_latest": 0}
    problems: list[str] = []
    last_saved = 0
    for job in range(kills + 1):
        tiers = [_committed(where, fmt, opts), _local_steps(tier, fmt, processes)]
        committed = sorted(set(tiers[0]) | set(tiers[1])) if job else []
        if tier is not None and "{node}" in tier:
            tiers = tiers[:1]  # a node's part of a step is not a whole checkpoint
        if committed and committed[-1] < last_saved:
            counts["lost"] += 1
            problems.append(f"job {job}: step {last_saved} was saved, newest committed is "
                            f"{committed[-1]}")
        for found in tiers:
            for n, path in found.items():
                if not _intact(path, n, opts, same=not per_node):
                    counts["broken"] += 1
                    problems.append(f"job {job}: committed step {path} is not intact")
        proc = subprocess.Popen([*prefix, str(JOB), where, fmt, str(job)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        try:
            while True:  # until every process saved its first step (or the job failed)
                events = _events(results, job)
                firsts = [e for es in events.values() for e in es if e["event"] == "first"]
                if len(firsts) == processes or proc.poll() is not None:
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            if len(firsts) < processes:
                counts["blocked"] += 1
                proc.kill()
                problems.append(f"job {job} never saved: {proc.communicate()[1][-2000:]!r}")
                continue
            restored = [e for es in events.values() for e in es if e["event"] == "restored"]
            expect = committed[-1] if committed else 0
            for e in restored:
                got = _number(e["path"]) if per_node else e["step"]
                if got != expect or not e["exact"] or e["skipped"]:
                    counts["not_latest"] += 1
                    problems.append(f"job {job}: restored {e} but step {expect} is the newest")
            left = [x for e in firsts for x in e["leftovers"]]  # type: ignore[union-attr]
            if left:
                counts["leftovers"] += 1
                problems.append(f"job {job}: left after the first save: {left}")
            if job == kills:
                break
            time.sleep(rng.uniform(0.0, window))
            if processes > 1 and job % 2:  # one rank dies first, then the rest
                victim = rng.choice([int(e["pid"]) for e in restored])
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                time.sleep(0.3)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            counts["kills"] += 1
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            proc.stderr.close()  # type: ignore[union-attr]
            # the ranks (their own process groups) die with their launcher, but one in a
            # system call (a rename, an fsync) finishes it first: check only when all are
            # gone, as a restarted job starts after them
            _wait_gone([int(e["pid"]) for es in _events(results, job).values() for e in es
                        if "pid" in e])
        saved = [int(e["step"]) for e in _events(results, job).get(0, [])
                 if e["event"] in ("saved", "first")]
        last_saved = max([last_saved, *saved])
    tiered = f", local tier {tier}" if tier else ""
    print(f"restart harness {where} ({processes} process(es), {fmt}{tiered}): {counts}")
    assert not problems, "\n".join(problems[:10])
    return counts


def _wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    """Wait until none of ``pids`` runs any more (gone, or a zombie)."""
    import time

    deadline = time.monotonic() + timeout
    for pid in set(pids):
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state == "Z":
                break
            time.sleep(0.01)


def _check(counts: dict[str, int], kills: int) -> None:
    assert counts["kills"] == kills
    assert {k: v for k, v in counts.items() if k != "kills"} == dict.fromkeys(
        ("broken", "lost", "blocked", "leftovers", "not_latest"), 0)


def test_restart_after_kills_of_one_process(tmp_path: Path) -> None:
    where = str(tmp_path / "run")
    _check(restart_harness(where, "h5", processes=1, kills=3, seed=7, work=tmp_path,
                           window=0.5), 3)


@needs_mpi
def test_restart_after_kills_of_three_processes(tmp_path: Path) -> None:
    where = str(tmp_path / "run")
    _check(restart_harness(where, "h5", processes=3, kills=1, seed=11, work=tmp_path), 1)


@pytest.mark.parametrize("fmt", ["h5", pytest.param("zarr", marks=pytest.mark.slow)])
@needs_mpi
def test_restart_after_kills_of_three_processes_saving_incremental_steps(
        tmp_path: Path, fmt: str) -> None:
    """Kills during incremental multi-process saves (and their pruning): every committed
    step, held ones included, stays loadable bit-exact; nothing of a dead save is left."""
    where = str(tmp_path / "run")
    _check(restart_harness(where, fmt, processes=3, kills=2, seed=13, work=tmp_path,
                           incremental=True), 2)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
@needs_mpi
def test_restart_after_100_kills_of_three_processes_saving_incremental_steps(
        tmp_path: Path, fmt: str) -> None:
    _check(restart_harness(str(tmp_path / "run"), fmt, processes=3, kills=100, seed=109,
                           work=tmp_path, incremental=True), 100)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_restart_after_100_kills_of_one_process(tmp_path: Path, fmt: str) -> None:
    where = str(tmp_path / "run")
    _check(restart_harness(where, fmt, processes=1, kills=100, seed=101, work=tmp_path,
                           window=0.5), 100)


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
@needs_mpi
def test_restart_after_kills_of_four_processes_with_per_node_tiers(tmp_path: Path) -> None:
    """4 processes as 2 nodes, each its own local directory, every step persisted: kills
    land in the local saves and in the persistent copies."""
    _check(restart_harness(str(tmp_path / "run"), "h5", processes=4, kills=2, seed=13,
                           work=tmp_path, tier=str(tmp_path / "node{node}")), 2)


@pytest.mark.slow
@needs_mpi
def test_restart_after_100_kills_of_four_processes_with_per_node_tiers(tmp_path: Path) -> None:
    _check(restart_harness(str(tmp_path / "run"), "h5", processes=4, kills=100, seed=107,
                           work=tmp_path, tier=str(tmp_path / "node{node}")), 100)


@pytest.mark.slow
@needs_mpi
def test_restart_after_100_kills_of_three_processes(tmp_path: Path) -> None:
    where = str(tmp_path / "run")
    _check(restart_harness(where, "h5", processes=3, kills=100, seed=103, work=tmp_path), 100)
