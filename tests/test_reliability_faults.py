"""Deterministic fault points over whole saves: every write, fsync and rename can fail.

A tiny C library preloaded into a worker process (``LD_PRELOAD``) interposes the
libc calls that put bytes on disk, so faults hit Python's ``os`` calls, zarr's
file writes *and* libhdf5's own writes alike:

- ``write``/``pwrite``/``pwritev`` on regular files fail with ``ENOSPC`` or ``EFBIG``,
- ``fsync``/``fdatasync`` fail with ``EIO``,
- ``rename``/``renameat``/``renameat2`` fail with ``EXDEV``.

For ``k = 1 .. N`` (``N`` = how many such calls one save makes) the worker arms the
k-th call to fail, runs a whole ``Checkpoint.save`` or ``CheckpointManager.save`` in
the same process, disarms, and checks the contract (docs/reliability.md):

- every earlier checkpoint still loads, verified and bit-exact;
- the new checkpoint is complete and verified, or absent;
- no partial file or directory sits under a final name, no temporary is left behind;
- the manager never lists a checkpoint that does not load with the values saved for it,
  and a new manager opened on the directory agrees.

Real resource limits complete the picture: ``RLIMIT_FSIZE`` (the kernel's ``EFBIG``)
and a small tmpfs mounted in a user namespace (the kernel's ``ENOSPC``, with short
writes), each swept over many sizes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* op classes: 0 write, 1 fsync, 2 rename */
static volatile int enabled = 0;
static volatile int fail_op = -1;
static volatile long fail_at = 0;
static volatile int fail_errno = 0;
static long counts[3];
static volatile long fired = 0;

void ckf_arm(int op, long k, int err) {
    counts[0] = counts[1] = counts[2] = 0;
    fired = 0; fail_op = op; fail_at = k; fail_errno = err;
    __atomic_store_n(&enabled, 1, __ATOMIC_SEQ_CST);
}
void ckf_disarm(void) { __atomic_store_n(&enabled, 0, __ATOMIC_SEQ_CST); }
long ckf_count(int op) { return counts[op]; }
long ckf_fired(void) { return fired; }

static int regular(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) return 0;
    return S_ISREG(st.st_mode);
}

static int hit(int op) {
    if (!__atomic_load_n(&enabled, __ATOMIC_SEQ_CST)) return 0;
    long c = __atomic_add_fetch(&counts[op], 1, __ATOMIC_SEQ_CST);
    if (op == fail_op && c == fail_at) {
        fired = 1;
        errno = fail_errno;
        return 1;
    }
    return 0;
}

#define REAL(name) static __typeof__(name) *real = NULL; \
    if (!real) real = (__typeof__(name) *)dlsym(RTLD_NEXT, #name)

ssize_t write(int fd, const void *b, size_t n) {
    REAL(write);
    if (regular(fd) && hit(0)) return -1;
    return real(fd, b, n);
}
ssize_t pwrite(int fd, const void *b, size_t n, off_t o) {
    REAL(pwrite);
    if (regular(fd) && hit(0)) return -1;
    return real(fd, b, n, o);
}
ssize_t pwrite64(int fd, const void *b, size_t n, off64_t o) {
    REAL(pwrite64);
    if (regular(fd) && hit(0)) return -1;
    return real(fd, b, n, o);
}
ssize_t writev(int fd, const struct iovec *v, int c) {
    REAL(writev);
    if (regular(fd) && hit(0)) return -1;
    return real(fd, v, c);
}
ssize_t pwritev(int fd, const struct iovec *v, int c, off_t o) {
    REAL(pwritev);
    if (regular(fd) && hit(0)) return -1;
    return real(fd, v, c, o);
}
ssize_t pwritev64(int fd, const struct iovec *v, int c, off64_t o) {
    REAL(pwritev64);
    if (regular(fd) && hit(0)) return -1;
    return real(fd, v, c, o);
}
ssize_t pwritev2(int fd, const struct iovec *v, int c, off_t o, int f) {
    REAL(pwritev2);
    if (regular(fd) && hit(0)) return -1;
    return real(fd, v, c, o, f);
}
/* CKF_FAST_FSYNC: count fsyncs but skip the real flush (these tests are not about power
   loss, and a real flush per call would make the sweeps slow). */
int fsync(int fd) {
    REAL(fsync);
    if (hit(1)) return -1;
    if (getenv("CKF_FAST_FSYNC")) return 0;
    return real(fd);
}
int fdatasync(int fd) {
    REAL(fdatasync);
    if (hit(1)) return -1;
    if (getenv("CKF_FAST_FSYNC")) return 0;
    return real(fd);
}
int rename(const char *a, const char *b) {
    REAL(rename);
    if (hit(2)) return -1;
    return real(a, b);
}
int renameat(int da, const char *a, int db, const char *b) {
    REAL(renameat);
    if (hit(2)) return -1;
    return real(da, a, db, b);
}
int renameat2(int da, const char *a, int db, const char *b, unsigned int f) {
    REAL(renameat2);
    if (hit(2)) return -1;
    return real(da, a, db, b, f);
}
"""

# Shared by every worker: build values, load and compare, check a directory.
COMMON = r'''
import errno, json, os, re, sys
from pathlib import Path
import numpy as np
import ckptvar as cv
from ckptvar.storage.atomic import is_partial

FINAL = re.compile(r"^ckpt-(\d+)\.(h5|zarr)$")


def values(tag):
    rng = np.random.default_rng(tag)
    return {
        "big": rng.standard_normal(20000).astype(np.float32),   # own dataset / array
        "mid": rng.integers(-9, 9, (70, 130)).astype(np.int64),  # own dataset / array
        "small": rng.standard_normal((3, 4)),                     # packed
        "flag": np.array(tag % 2 == 0),
    }


class Model:
    def __init__(self):
        self.vars = {k: cv.Variable(v, name=k) for k, v in values(0).items()}
        self.ckpt = cv.Checkpoint(**self.vars)

    def set(self, tag):
        for k, v in values(tag).items():
            self.vars[k].assign(v)


def same(path, tag):
    """True if path loads (verified) with exactly values(tag); raises if it does not load."""
    got = cv.load(path)
    want = values(tag)
    for k, v in want.items():
        g = got[k]
        if g.dtype != v.dtype or g.shape != v.shape or g.tobytes() != v.tobytes():
            return False
    return True


def loads_as_one_of(path, tags):
    for t in tags:
        if t is not None and same(path, t):
            return t
    raise AssertionError(f"{path} loads but with values of no known save ({tags})")


def leftovers(directory):
    return sorted(e for e in os.listdir(directory) if is_partial(e))
'''

FAULT_WORKER = COMMON + r'''
import ctypes
shim = ctypes.CDLL(os.environ["CKF_SHIM"])
shim.ckf_arm.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
shim.ckf_count.restype = ctypes.c_long
shim.ckf_count.argtypes = [ctypes.c_int]
shim.ckf_fired.restype = ctypes.c_long

fmt, scenario, workdir, journal = sys.argv[1:5]
OPS = {"write": 0, "fsync": 1, "rename": 2}
# (call kind, errno for odd k, errno for even k)
PHASES = [("write", "ENOSPC", "EFBIG"), ("fsync", "EIO", "EIO"), ("rename", "EXDEV", "EXDEV")]
d = Path(workdir)
m = Model()
NAME = f"{scenario} {fmt}"
MANAGER = scenario in ("manager", "async")
ASYNC = scenario == "async"


def nfds():
    return len(os.listdir("/proc/self/fd"))


def note_error(stats, exc, want):
    # Count what a failed save raised: the injected OSError, or what else.
    if isinstance(exc, OSError) and exc.errno == want:
        name = "OSError(injected errno)"
    else:
        name = f"{type(exc).__name__}: {str(exc)[:40]}"
    stats["errors"][name] = stats["errors"].get(name, 0) + 1


def save_journal(j):
    tmp = journal + ".tmp"
    with open(tmp, "w") as f:
        json.dump(j, f)
    os.replace(tmp, journal)


def check_dir(tags, k, allow_leftovers=False):
    # every known checkpoint loads bit-exact; every final name is a known, complete one
    for path, t in tags.items():
        assert os.path.exists(path), f"{NAME} #{k}: {path} vanished"
        assert same(path, t), f"{NAME} #{k}: {path} changed"
    for e in os.listdir(d):
        if FINAL.match(e):
            assert str(d / e) in tags, f"{NAME} #{k}: unknown checkpoint {e} under a final name"
    if not allow_leftovers:
        if MANAGER:  # a pruned step's temporary is freed in the background
            mgr.wait_until_finished()
        assert leftovers(d) == [], f"{NAME} #{k}: temporaries left: {leftovers(d)}"


def settle(tags, target, tag, k):
    # after a failed save: the target is absent, complete (new values) or unchanged (old)
    if os.path.exists(target):
        got = loads_as_one_of(target, [tag, tags.get(target)])
        tags[target] = got
        return "published_anyway" if got == tag else "absent"
    assert target not in tags, f"{NAME} #{k}: earlier {target} vanished"
    return "absent"


if os.path.exists(journal):
    j = json.load(open(journal))
    tags = j["tags"]
    k = j["current"]
    phase = j["phase"]
    j["crashes"].append(f"{PHASES[phase][0]}#{k}")
    m.ckpt.save_counter.assign(j["counter"])
    if MANAGER:   # opening a manager cleans up its own temporaries
        mgr = cv.CheckpointManager(m.ckpt, d, max_to_keep=2, format=fmt, async_save=ASYNC)
        for path in mgr.checkpoints:
            assert same(path, tags[path]), f"{NAME} after crash at #{k}: {path} not intact"
        tags = {p: t for p, t in tags.items() if os.path.exists(p)}
    j["stats"][settle(tags, j["target"], j["tag"], k)] += 1
    if scenario == "checkpoint":   # a crash may leave a temporary; a user deletes it
        for e in leftovers(d):
            cv.storage.atomic.remove_path(d / e)
    check_dir(tags, k)
    stats = j["stats"]
    crashes = j["crashes"]
else:
    stats = {"tried": 0, "raised": 0, "published_anyway": 0, "absent": 0, "N": {},
             "errors": {}, "fd_growth": []}
    crashes = []
    phase = 0
    tags = {}       # path -> tag of the values it holds (every known complete checkpoint)
    k = 0
    if MANAGER:
        mgr = cv.CheckpointManager(m.ckpt, d, max_to_keep=2, format=fmt, async_save=ASYNC)
        for t in (1, 2, 3):
            m.set(t)
            tags[mgr.save()] = t
            mgr.checkpoint.wait()
        tags = {p: t for p, t in tags.items() if os.path.exists(p)}
    else:
        for t in (1, 2):
            m.set(t)
            tags[m.ckpt.save(d / "ckpt", format=fmt)] = t

fds0 = nfds()
while phase < len(PHASES):
    op_name = PHASES[phase][0]
    op = OPS[op_name]
    k += 1
    err = getattr(errno, PHASES[phase][1 + (k + 1) % 2])
    tag = 1000 * (phase + 1) + k
    m.set(tag)
    before = m.ckpt.save_counter.numpy().item()
    target = str(d / f"ckpt-{before + 1}.{fmt}")
    listed_before = list(mgr.checkpoints) if MANAGER else []
    save_journal({"current": k, "phase": phase, "tags": tags, "counter": before,
                  "target": target, "tag": tag, "stats": stats, "crashes": crashes})
    shim.ckf_arm(op, k, err)
    raised = None
    try:
        if MANAGER:
            p = mgr.save()
            if ASYNC:
                assert p == target
                mgr.checkpoint.wait()   # a background error surfaces here
        else:
            p = m.ckpt.save(d / "ckpt", format=fmt)
    except Exception as exc:
        raised = exc
    finally:
        shim.ckf_disarm()
    if not shim.ckf_fired():
        assert raised is None, raised
        stats["N"][op_name] = k - 1
        assert p == target, (p, target)
        assert same(p, tag), "an unfaulted save does not load as saved"
        tags[p] = tag
        if MANAGER:
            assert mgr.latest_checkpoint == p
            tags = {p: t for p, t in tags.items() if os.path.exists(p)}
        check_dir(tags, k)
        phase += 1
        k = 0
        continue
    stats["tried"] += 1
    assert raised is not None, f"{NAME} {op_name}#{k} fired but save() did not raise"
    stats["raised"] += 1
    note_error(stats, raised, err)
    if ASYNC:   # reported exactly once
        mgr.checkpoint.wait()
        cv.wait_for_pending_saves()
    if scenario == "checkpoint":
        # the counter is unchanged after a failed save
        assert m.ckpt.save_counter.numpy().item() == before
    stats[settle(tags, target, tag, k)] += 1
    if MANAGER:
        listed = list(mgr.checkpoints)
        for path in listed:
            assert same(path, tags[path]), f"{NAME} #{k}: listed {path} is not intact"
        if target not in listed:   # nothing listed before disappears, unless pruned for it
            assert set(listed_before) <= set(listed), (k, listed_before, listed)
        assert mgr.latest_checkpoint == (listed[-1] if listed else None)
        latest = cv.latest_checkpoint(d)
        assert latest is not None and same(latest, tags[latest])
        m2 = Model()
        mgr2 = cv.CheckpointManager(m2.ckpt, d, max_to_keep=2, format=fmt)
        for path in mgr2.checkpoints:
            assert same(path, tags[path])
        assert mgr2.restore_or_initialize() == mgr2.latest_checkpoint
        assert mgr2.skipped == []
        tags = {p: t for p, t in tags.items() if os.path.exists(p)}   # pruned ones
        # a manager pruned by a later save must see the intact set; keep counters in step
        m.ckpt.save_counter.assign(max(m.ckpt.save_counter.numpy().item(), before))
    check_dir(tags, k)
    if nfds() > fds0:
        stats["fd_growth"].append(f"{op_name}#{k}: +{nfds() - fds0}")
        fds0 = nfds()

# A fresh save after all that works and loads.
m.set(7)
p = mgr.save() if MANAGER else m.ckpt.save(d / "ckpt", format=fmt)
if ASYNC:
    mgr.checkpoint.wait()
assert same(p, 7)
stats["crashes"] = crashes
os.unlink(journal)
print("STATS " + json.dumps(stats))
'''


@pytest.fixture(scope="module")
def shim_or_none(tmp_path_factory: pytest.TempPathFactory) -> Path | str:
    """The built fault-injection shim, or why it cannot be built here."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler: the libc fault-injection shim cannot be built"
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(SHIM_C)
    out = d / "libckfault.so"
    proc = subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(d / "shim.c"), "-ldl"],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        return f"the fault-injection shim does not build here: {proc.stderr[-300:]}"
    return out


@pytest.fixture(scope="module")
def shim(shim_or_none: Path | str) -> Path:
    if isinstance(shim_or_none, str):
        pytest.skip(shim_or_none)
    return shim_or_none


def _fast_env(shim_or_none: Path | str) -> dict[str, str]:
    """Environment that skips real fsyncs (speed only) when the shim is available."""
    if isinstance(shim_or_none, str):
        return {}
    return {"LD_PRELOAD": str(shim_or_none), "CKF_SHIM": str(shim_or_none),
            "CKF_FAST_FSYNC": "1"}


def _run_worker(script: str, args: list[str], env: dict[str, str] | None = None,
                prefix: list[str] | None = None, timeout: float = 120) -> dict[str, object]:
    proc = subprocess.run(
        [*(prefix or []), sys.executable, "-c", script, *args],
        capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, PYTHONWARNINGS="error", **(env or {})),
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("STATS ")][-1]
    return json.loads(line[6:])


#: Totals of every sweep in this module (printed with -s; docs/reliability.md quotes them).
TOTALS: dict[str, int] = {"fault points tried": 0, "survived": 0}
_SWEEPS: dict[tuple[str, str], dict[str, object]] = {}


def _sweep(shim: Path, base: Path, fmt: str, scenario: str) -> dict[str, object]:
    """Run (once per module) the whole fault sweep of one format and scenario."""
    key = (fmt, scenario)
    if key in _SWEEPS:
        return _SWEEPS[key]
    work = base / "d"
    work.mkdir()
    journal = base / "journal.json"
    env = dict(os.environ, PYTHONWARNINGS="error", LD_PRELOAD=str(shim), CKF_SHIM=str(shim),
               CKF_FAST_FSYNC="1")
    for _restart in range(50):  # a worker killed by a signal restarts from its journal
        proc = subprocess.run(
            [sys.executable, "-c", FAULT_WORKER, fmt, scenario, str(work), str(journal)],
            capture_output=True, text=True, timeout=300, env=env,
        )
        if proc.returncode >= 0:
            break
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    stats = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("STATS ")][-1][6:])
    n = sum(stats["N"].values())
    TOTALS["fault points tried"] += n
    TOTALS["survived"] += n
    print(f"{fmt} {scenario}: {stats}")
    _SWEEPS[key] = stats
    return stats


@pytest.mark.parametrize("scenario", ["checkpoint", "manager", "async"])
def test_every_fault_point_of_a_save(
    shim: Path, tmp_path: Path, fmt: str, scenario: str
) -> None:
    """Fail the k-th write/fsync/rename for every k; the contract holds after each.

    The worker asserts the contract after every fault point (and after a restart when
    a fault point crashed the process, which is then checked like a kill -9).
    """
    stats = _sweep(shim, tmp_path, fmt, scenario)
    # The sweep really covered the save: at least one call of every kind per save.
    assert set(stats["N"]) == {"write", "fsync", "rename"}, stats
    assert all(int(v) >= 1 for v in stats["N"].values()), stats
    assert stats["tried"] + len(stats["crashes"]) == sum(stats["N"].values()), stats


@pytest.mark.parametrize("scenario", ["checkpoint", "manager", "async"])
@pytest.mark.parametrize("format_", ["h5", "zarr"])
def test_no_fault_point_crashes_the_process(
    shim: Path, tmp_path: Path, format_: str, scenario: str
) -> None:
    """A failed write/fsync/rename is an exception in the caller, never a dead process."""
    stats = _sweep(shim, tmp_path, format_, scenario)
    assert stats["crashes"] == [], f"the saving process crashed at fault points {stats}"


@pytest.mark.parametrize("scenario", ["checkpoint", "manager", "async"])
@pytest.mark.parametrize("format_", ["h5", "zarr"])
def test_io_errors_surface_as_oserror(
    shim: Path, tmp_path: Path, format_: str, scenario: str
) -> None:
    """Every failed save raises the OSError the system gave (catchable as ``OSError``)."""
    stats = _sweep(shim, tmp_path, format_, scenario)
    assert set(stats["errors"]) == {"OSError(injected errno)"}, stats["errors"]


def test_no_file_descriptor_leaks_across_failed_saves(shim: Path, tmp_path: Path, fmt: str) -> None:
    """Failed saves close every file they opened."""
    stats = _sweep(shim, tmp_path, fmt, "checkpoint")
    assert stats["fd_growth"] == [], stats["fd_growth"]


def test_the_shim_sees_libhdf5_writes(shim: Path, tmp_path: Path) -> None:
    """libhdf5's own writes go through the interposed calls (not only Python's os.*)."""
    script = textwrap.dedent(r'''
        import ctypes, json, os, sys
        import h5py, numpy as np
        shim = ctypes.CDLL(os.environ["CKF_SHIM"])
        shim.ckf_count.restype = ctypes.c_long
        shim.ckf_arm(0, 0, 0)
        with h5py.File(sys.argv[1], "w") as f:
            f["x"] = np.arange(10)
        shim.ckf_disarm()
        print("STATS " + json.dumps({"writes": shim.ckf_count(0), "fsyncs": shim.ckf_count(1)}))
    ''')
    stats = _run_worker(script, [str(tmp_path / "x.h5")],
                        env={"LD_PRELOAD": str(shim), "CKF_SHIM": str(shim)})
    assert int(stats["writes"]) >= 1, stats


# --------------------------------------------------------------------------- real limits

FSIZE_WORKER = COMMON + r'''
import resource, signal
fmt, workdir, journal = sys.argv[1:4]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of a signal
d = Path(workdir)
m = Model()
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
limits = list(range(0, 4096, 512)) + list(range(4096, 270000, 16381))
if os.path.exists(journal):   # the previous worker died at limits[i]: check, then go on
    j = json.load(open(journal))
    tags, stats, start = j["tags"], j["stats"], j["i"] + 1
    stats["crashes"].append(limits[j["i"]])
    m.ckpt.save_counter.assign(j["counter"])
    mgr = cv.CheckpointManager(m.ckpt, d, max_to_keep=3, format=fmt)
    if os.path.exists(j["target"]):
        assert same(j["target"], j["tag"])
        tags[j["target"]] = j["tag"]
else:
    mgr = cv.CheckpointManager(m.ckpt, d, max_to_keep=3, format=fmt)
    tags = {}
    for tag in (1, 2):
        m.set(tag)
        tags[mgr.save()] = tag
    stats = {"tried": 0, "refused": 0, "saved": 0, "errors": {}, "crashes": []}
    start = 0
for path in mgr.checkpoints:
    assert same(path, tags[path])
for i in range(start, len(limits)):
    limit = limits[i]
    tag = 100 + i
    m.set(tag)
    listed_before = list(mgr.checkpoints)
    number = m.ckpt.save_counter.numpy().item() + 1
    target = str(d / f"ckpt-{number}.{fmt}")
    with open(journal + ".tmp", "w") as f:
        json.dump({"i": i, "tags": tags, "stats": stats, "counter": number - 1,
                   "target": target, "tag": tag}, f)
    os.replace(journal + ".tmp", journal)
    stats["tried"] += 1
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        p = mgr.save()
        ok = True
    except Exception as exc:
        kind = "OSError(EFBIG)" if getattr(exc, "errno", None) == errno.EFBIG else (
            f"{type(exc).__name__}: {str(exc)[:40]}")
        stats["errors"][kind] = stats["errors"].get(kind, 0) + 1
        ok = False
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    if ok:
        stats["saved"] += 1
        tags[p] = tag
        assert same(p, tag)
    else:
        stats["refused"] += 1
        if os.path.exists(target):
            assert same(target, tag)
            tags[target] = tag
        assert set(listed_before) <= set(mgr.checkpoints) | {target}
    for path in mgr.checkpoints:
        assert same(path, tags[path])
    mgr.wait_until_finished()  # a pruned step's temporary is freed in the background
    assert leftovers(d) == [], leftovers(d)
m2 = Model()
mgr2 = cv.CheckpointManager(m2.ckpt, d, max_to_keep=3, format=fmt)
assert mgr2.checkpoints == mgr.checkpoints
assert mgr2.restore_or_initialize() == mgr.latest_checkpoint
os.unlink(journal)
print("STATS " + json.dumps(stats))
'''

_FSIZE: dict[str, dict[str, object]] = {}


def _fsize_sweep(base: Path, fmt: str, shim_or_none: Path | str) -> dict[str, object]:
    if fmt in _FSIZE:
        return _FSIZE[fmt]
    work = base / "d"
    work.mkdir()
    for _restart in range(50):
        proc = subprocess.run(
            [sys.executable, "-c", FSIZE_WORKER, fmt, str(work), str(base / "journal.json")],
            capture_output=True, text=True, timeout=300,
            env=dict(os.environ, PYTHONWARNINGS="error", **_fast_env(shim_or_none)),
        )
        if proc.returncode >= 0:
            break
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    stats = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("STATS ")][-1][6:])
    TOTALS["fault points tried"] += int(stats["tried"])
    TOTALS["survived"] += int(stats["tried"])
    print(f"{fmt} RLIMIT_FSIZE: {stats}")
    _FSIZE[fmt] = stats
    return stats


def test_rlimit_fsize_efbig_sweep(tmp_path: Path, fmt: str, shim_or_none: Path | str) -> None:
    """The kernel refuses to grow any file past RLIMIT_FSIZE (EFBIG), at many limits.

    The worker checks the contract after each (and after a restart if the process died).
    """
    stats = _fsize_sweep(tmp_path, fmt, shim_or_none)
    assert stats["refused"] >= 5 and stats["saved"] >= 1, stats
    assert set(stats["errors"]) == {"OSError(EFBIG)"}, stats["errors"]


@pytest.mark.parametrize("format_", ["h5", "zarr"])
def test_rlimit_fsize_never_crashes_the_process(
    tmp_path: Path, format_: str, shim_or_none: Path | str
) -> None:
    """A real EFBIG is an exception in the caller, never a dead process."""
    stats = _fsize_sweep(tmp_path, format_, shim_or_none)
    assert stats["crashes"] == [], stats


TMPFS_WORKER = COMMON + r'''
import subprocess
fmt, mnt = sys.argv[1:3]
d = Path(mnt)
m = Model()
mgr = cv.CheckpointManager(m.ckpt, d, max_to_keep=None, format=fmt)
tags = {}
stats = {"saved": 0, "enospc": 0, "errors": {}}
tag = 0
# fill the file system with checkpoints until it is full
while True:
    tag += 1
    m.set(tag)
    number = m.ckpt.save_counter.numpy().item() + 1
    target = str(d / f"ckpt-{number}.{fmt}")
    try:
        p = mgr.save()
    except Exception as exc:
        kind = "OSError(ENOSPC)" if getattr(exc, "errno", None) == errno.ENOSPC else (
            f"{type(exc).__name__}: {str(exc)[:120]}")
        stats["errors"][kind] = stats["errors"].get(kind, 0) + 1
        stats["enospc"] += 1
        if os.path.exists(target):
            assert same(target, tag)
            tags[target] = tag
        break
    tags[p] = tag
    stats["saved"] += 1
    assert tag < 500
for path in mgr.checkpoints:
    assert same(path, tags[path])
mgr.wait_until_finished()  # a pruned step's temporary is freed in the background
assert leftovers(d) == [], leftovers(d)
# a new manager agrees and restores the newest intact checkpoint
m2 = Model()
mgr2 = cv.CheckpointManager(m2.ckpt, d, max_to_keep=None, format=fmt)
assert mgr2.checkpoints == mgr.checkpoints, (mgr2.checkpoints, mgr.checkpoints)
assert mgr2.restore_or_initialize() == mgr.latest_checkpoint
# freeing space (retention) makes saving work again
mgr3 = cv.CheckpointManager(m.ckpt, d, max_to_keep=1, format=fmt)
m.set(999)
try:
    p = mgr3.save()
except Exception:   # the state file itself may not fit; then nothing is lost either
    p = None
for path in mgr3.checkpoints:
    assert same(path, tags.get(path, 999))
print("STATS " + json.dumps(stats))
'''


def _unshare_works() -> str | None:
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return "needs Linux and unshare(1)"
    try:
        proc = subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && echo ok"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -rm failed: {exc}"
    if proc.stdout.strip() != "ok":
        return f"unprivileged user+mount namespaces are not available: {proc.stderr.strip()}"
    return None


@pytest.mark.parametrize("size_kib", [260, 900])
def test_small_tmpfs_enospc(tmp_path: Path, fmt: str, size_kib: int) -> None:
    """A real full file system (tmpfs in a user namespace): nothing listed is lost."""
    reason = _unshare_works()
    if reason:
        pytest.skip(reason)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script_file = tmp_path / "worker.py"
    script_file.write_text(TMPFS_WORKER)
    cmd = (f"mount -t tmpfs -o size={size_kib}k tmpfs {mnt} && "
           f"exec {sys.executable} {script_file} {fmt} {mnt}")
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONWARNINGS="error"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    stats = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("STATS ")][-1][6:])
    assert stats["enospc"] == 1 and stats["saved"] >= 1, stats
    TOTALS["fault points tried"] += 1
    TOTALS["survived"] += 1


REAL_EFBIG_WORKER = COMMON + r'''
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of a signal
d = Path(sys.argv[1])
m = Model()
m.set(1)
size = os.path.getsize(m.ckpt.save(d / "ckpt", format="h5"))
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
for limit in range(size - 24000, size, 400):   # limits that stop libhdf5's closing writes
    m.set(limit)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        m.ckpt.save(d / "ckpt", format="h5")
    except OSError:
        pass
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
print("STATS {}")
'''


def test_real_efbig_at_the_end_of_an_h5_save_does_not_crash(tmp_path: Path) -> None:
    """No injection: the kernel's EFBIG while libhdf5 writes its last metadata."""
    proc = subprocess.run([sys.executable, "-c", REAL_EFBIG_WORKER, str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="error"))
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stderr[-2000:]}"
