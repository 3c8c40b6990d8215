"""A checkpoint directory on a read-only mount (an evaluation job reading a training job's).

The directory is made read-only for real: a read-only bind mount in a private
mount namespace (``unshare -rm``, no privileges needed where user namespaces are
allowed). Where no mount namespace can be made and the tests do not run as root,
``chmod`` makes the directory unwritable instead; as root without namespaces there
is no way to make a directory read-only, and the test says so.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv

_CHECK = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import ckptvar as cv

    d = sys.argv[1]
    out = {}
    w = cv.Variable(np.zeros(3, np.float32), name="w")
    mgr = cv.CheckpointManager(cv.Checkpoint(w=w), d, max_to_keep=2)
    out["read_only"] = mgr.read_only
    out["checkpoints"] = mgr.checkpoints
    out["latest"] = mgr.latest_checkpoint
    out["cv_latest"] = cv.latest_checkpoint(d)
    out["restored"] = mgr.restore_or_initialize()
    out["value"] = w.numpy().tolist()
    try:
        mgr.save()
    except cv.CkptError as exc:
        out["save_error"] = str(exc)
    for name, call in [
        ("cv_save", lambda: cv.save(d + "/new/x.h5", {"w": np.zeros(2)})),
        ("ckpt_save", lambda: cv.Checkpoint(w=w).save(d + "/other")),
        ("ckpt_write", lambda: cv.Checkpoint(w=w).write(d + "/other.zarr")),
    ]:
        try:
            call()
            out[name] = None
        except OSError as exc:
            out[name] = [type(exc).__name__, exc.errno, str(exc)]
    print(json.dumps(out))
    """
)


def _unshare_works(probe: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    cmd = f"mount --bind {probe} {probe} && mount -o remount,bind,ro {probe} && ! touch {probe}/x"
    r = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, timeout=30, check=False)
    return r.returncode == 0


def _run_read_only(directory: Path, script: Path, tmp_path: Path) -> dict:
    env = dict(os.environ)
    probe = tmp_path / "probe"
    probe.mkdir()
    if _unshare_works(probe):
        mount = (f"mount --bind {directory} {directory} && "
                 f"mount -o remount,bind,ro {directory} && ")
        cmd = ["unshare", "-rm", "sh", "-c",
               mount + f"exec {sys.executable} {script} {directory}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                           check=False)
    elif os.geteuid() != 0:  # fall back: an unwritable directory (a mount is the real case)
        mode = directory.stat().st_mode
        directory.chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            r = subprocess.run([sys.executable, str(script), str(directory)],
                               capture_output=True, text=True, timeout=120, env=env,
                               check=False)
        finally:
            directory.chmod(mode)
    else:
        pytest.skip("root without mount namespaces (unshare -rm failed): no way to make a "
                    "directory read-only here")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_manager_on_a_read_only_directory(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    d = tmp_path / "train"
    w = cv.Variable(np.arange(3, dtype=np.float32), name="w")
    mgr = cv.CheckpointManager(cv.Checkpoint(w=w), d, max_to_keep=2)
    for _ in range(3):
        w.assign_add(np.ones(3, np.float32))
        mgr.save()
    mgr.wait_until_finished()  # the pruned step's bytes freed (in the background)
    (d / ".checkpoint_state.lock").unlink()  # also without a lock file to open
    kept = mgr.checkpoints
    before = sorted(p.name for p in d.iterdir())
    script = tmp_path / "check.py"
    script.write_text(_CHECK)

    out = _run_read_only(d, script, tmp_path)
    print(json.dumps(out, indent=1))

    assert out["read_only"] is True
    assert out["checkpoints"] == kept and out["latest"] == kept[-1] == out["cv_latest"]
    assert out["restored"] == kept[-1] and out["value"] == [3.0, 4.0, 5.0]
    assert str(d) in out["save_error"] and "read-only" in out["save_error"]
    for name in ("cv_save", "ckpt_save", "ckpt_write"):
        _kind, _errno, msg = out[name]
        assert ".partial" not in msg, msg
        assert str(d) in msg, msg
    assert sorted(p.name for p in d.iterdir()) == before  # nothing was written or removed
