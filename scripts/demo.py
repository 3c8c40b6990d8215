"""A two-minute tour of ckptvar: variables, a model, checkpoints in HDF5 and Zarr,
restore-as-initialization, and the ``ckpt`` command on what was saved.

Run it with ``python scripts/demo.py [WORKDIR]`` (default: a fresh temporary directory).
The files it writes stay there, so the ``ckpt`` commands it prints at the end can be
tried on them; it says which directory to remove when done.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import ckptvar as cv


class Dense(cv.Module):
    """A layer that creates its variables on first call, when the input size is known."""

    def __init__(self, n_out: int, name: str | None = None) -> None:
        super().__init__(name=name)
        self.n_out = n_out
        self.kernel: cv.Variable | None = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.kernel is None:
            init = cv.initializers.glorot_uniform(seed=0)
            self.kernel = cv.Variable(init, shape=(x.shape[-1], self.n_out), dtype="float32")
            self.bias = cv.Variable(cv.initializers.zeros, shape=(self.n_out,), dtype="float32")
        return x @ self.kernel + self.bias


class MLP(cv.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [Dense(8), Dense(2)]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        for layer in self.layers:
            x = np.maximum(layer(x), 0)
        return x


def main(workdir: Path) -> None:
    print(f"ckptvar {cv.__version__}: working in {workdir}\n")

    # 1. Variables: named, dtype and shape locked, assigned in place.
    v = cv.Variable([[1.0, 2.0], [3.0, 4.0]], name="v")
    v.assign_add(np.ones((2, 2)))
    v[0].assign([0.0, 0.0])
    print("a variable:", repr(v))

    # 2. A model and a checkpoint in each format.
    model = MLP()
    x = np.ones((1, 4), dtype="float32")
    model(x)  # builds the variables
    step = cv.Variable(0, dtype="int64", name="step", trainable=False)  # a counter
    ckpt = cv.Checkpoint(model=model, step=step)
    step.assign(42)
    h5_path = ckpt.save(workdir / "runs" / "ckpt")
    zarr_path = workdir / "final.zarr"
    ckpt.write(zarr_path)
    print(f"saved {len(model.variables)} model variables to {h5_path} and {zarr_path}")

    # 3. Restore as initialization: restore first, build later. Each variable is born
    #    with its stored value and its initializer never runs.
    fresh = MLP()
    status = cv.Checkpoint(model=fresh, step=cv.Variable(0, dtype="int64")).restore(zarr_path)
    y = fresh(x)  # the variables are created here, already holding the stored values
    status.assert_consumed()
    assert np.array_equal(y, model(x))
    print("a model rebuilt from the Zarr checkpoint gives the same output:", y.ravel())

    # 4. Read values back lazily, from either format.
    with cv.open(zarr_path) as reader:
        kernel = reader["model/layers/0/kernel"]
        print(f"lazy read of one row of {kernel.shape} kernel:", kernel[0])
    print("\nwhat was saved (`ckpt inspect`):")
    ckpt_cmd = [sys.executable, "-m", "ckptvar", "inspect", str(h5_path)]
    sys.stdout.flush()  # keep our lines before the command's when stdout is a pipe
    subprocess.run(ckpt_cmd, check=True)
    h5, zr = shlex.quote(str(h5_path)), shlex.quote(str(zarr_path))
    print(f"\nthe files stay in {workdir}; try next:\n"
          f"  ckpt inspect {h5} --tree\n"
          f"  ckpt show {h5} model/layers/1/bias\n"
          f"  ckpt diff {h5} {zr}\n"
          f"  ckpt convert {zr} {shlex.quote(str(workdir / 'model.safetensors'))}\n"
          f"(remove them with: rm -r {shlex.quote(str(workdir))})")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:  # kept: the commands printed at the end read these files
        main(Path(tempfile.mkdtemp(prefix="ckptvar-demo-")))
