"""``ckpt`` commands run as real processes, for the tests of the foreign readers."""

from __future__ import annotations

import os
import subprocess
import sys


def ckpt_processes(*commands: tuple[object, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Several ``ckpt`` commands as real processes, run at once (start-up dominates their
    cost); each is bounded by a timeout."""
    procs = [
        subprocess.Popen([sys.executable, "-m", "ckptvar", *map(str, c)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        for c in commands
    ]
    done = []
    for c, p in zip(commands, procs, strict=True):
        out, err = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(c, p.returncode, out, err))
    return done


def ckpt(*args: object) -> subprocess.CompletedProcess[str]:
    """One ``ckpt ARGS`` as a real process."""
    return ckpt_processes(args)[0]
