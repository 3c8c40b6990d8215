"""``python torch_trainloop_job.py DIR STEPS KILL_AT``: the loop of
tests/test_trainloop_torch.py with a background-saving CheckpointManager on DIR (a save
every 4 steps). It restores DIR's latest step if there is one, prints
``{"start": steps done}`` then one ``{"loss": x}`` line a step, and at step KILL_AT
(0: never) kills itself with SIGKILL just after that step's save() returned, the
save still being written in the background."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch  # noqa: F401 - the loop's

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import test_trainloop_torch as tl  # noqa: E402 - the loop, from beside this folder

import ckptvar as cv  # noqa: E402


def main() -> None:
    d, steps, kill_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    parts = tl._build("lambda")
    mgr = cv.CheckpointManager(tl._checkpoint(parts), d, max_to_keep=2, async_save=True)
    mgr.restore_or_initialize()
    start = parts["progress"].epoch * 5 + parts["progress"].batch
    print(json.dumps({"start": start}), flush=True)
    done = start
    while done < steps:
        (loss,) = tl._train(parts, 1, 1)  # one step, no save
        done += 1
        print(json.dumps({"loss": loss}), flush=True)
        if done % 4 == 0:
            mgr.save()
            if done == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    mgr.wait_until_finished()


if __name__ == "__main__":
    main()
