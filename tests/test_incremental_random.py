"""Random training sequences under an incremental manager: every kept step loads bit-exact.

Each sequence mixes what a user's job does between saves: ``scatter_update`` at a few rows
(row deltas), slice and index assignment, whole assignments, writes through ``value()``
(compared by checksums), variables replaced (another dtype too), added and removed, a
restore of a kept step, a new manager on the same directory (a restart), and saves under
the save counter or a number given by hand, with ``max_to_keep`` pruning as it goes.
The values cover 1-D and 2-D tables of at least 1 MiB (row deltas), ``bool``,
``bfloat16`` and ``complex64`` tables, a table with no rows and small values. After
every save, every listed step and every step file on disk must load verified, holding
exactly the values of its step (dtype, shape, bytes). A few short sequences run in the
default suite; many long ones are ``slow``.
"""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptvar as cv

KINDS = ("rows2", "rows1", "bool", "bf16", "c64", "empty", "small")
OPS = ("scatter", "slice", "index", "assign", "value", "replace", "retype", "new", "drop",
       "restore", "restart", "resume")


_INITIAL = {
    "rows2": lambda rng: rng.random((4096, 64), dtype=np.float32),  # 1 MiB, 256-byte rows
    "rows1": lambda rng: rng.random(300_000, dtype=np.float32),  # 1-D: a row is an element
    "bool": lambda rng: rng.random((1 << 20) + 5) < 0.5,
    "bf16": lambda rng: rng.random((4096, 128)).astype(ml_dtypes.bfloat16),
    "c64": lambda rng: (rng.random((2048, 64)) + 1j * rng.random((2048, 64))).astype(
        np.complex64),
    "empty": lambda rng: np.zeros((0, 64), np.float32),
    "small": lambda rng: rng.random((10, 3), dtype=np.float32),
}


def _initial(kind: str, rng: np.random.Generator) -> np.ndarray:
    return np.asarray(_INITIAL[kind](rng))


def _other(rows: np.ndarray) -> np.ndarray:
    """Values unlike ``rows`` (of its dtype and shape)."""
    if rows.dtype == np.bool_:
        return ~rows
    if rows.dtype.kind == "c":
        return (rows + (1.5 + 0.5j)).astype(rows.dtype)
    return (rows.astype(np.float64) + 1.5).astype(rows.dtype)


class _Job:
    """A module of variables, its checkpoint and manager, and what each step holds."""

    def __init__(self, directory: Path, fmt: str, keep: int | None, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.directory, self.fmt, self.keep = directory, fmt, keep
        self.root = cv.Module()
        self.names: list[str] = []
        for kind in KINDS:
            self.add(kind)
        self.ckpt = cv.Checkpoint(root=self.root)
        self.restart()
        self.saved: dict[str, dict[str, np.ndarray]] = {}

    def add(self, kind: str) -> None:
        name = f"v{len(self.names)}_{kind}"
        while name in self.names or hasattr(self.root, name):
            name += "_"
        setattr(self.root, name, cv.Variable(_initial(kind, self.rng), name=name))
        self.names.append(name)

    def restart(self) -> None:
        self.manager = cv.CheckpointManager(
            self.ckpt, self.directory, format=self.fmt, max_to_keep=self.keep,
            incremental=cv.IncrementalOptions(max_patches=3))

    def values(self) -> dict[str, np.ndarray]:
        out = {f"root/{n}": np.array(getattr(self.root, n).numpy()) for n in self.names}
        out["save_counter"] = np.array(self.ckpt.save_counter.numpy())
        return out

    def apply(self, op: str, pick: int) -> None:  # noqa: C901, PLR0912 - one branch per operation
        name = self.names[pick % len(self.names)]
        var = getattr(self.root, name)
        n = var.shape[0]
        rows = self.rng.integers(0, max(n, 1), 5)
        if op == "scatter" and n:
            var.scatter_update(rows, _other(np.asarray(var.numpy()[rows])))
        elif op == "slice" and n > 2:
            var[1:3].assign(_other(np.asarray(var.numpy()[1:3])))
        elif op == "index" and n:
            var[rows] = _other(np.asarray(var.numpy()[rows]))
        elif op == "assign":
            var.assign(_other(np.asarray(var.numpy())))
        elif op == "value" and n and var.dtype == np.float32:
            var.value()[rows[0]] += 1  # around the version counter: compared by checksums
        elif op == "replace":
            setattr(self.root, name, cv.Variable(_other(np.asarray(var.numpy())), name=name))
        elif op == "retype" and var.dtype == np.float32:
            setattr(self.root, name, cv.Variable(var.numpy().astype(np.float64), name=name))
        elif op == "new":
            self.add(KINDS[pick % len(KINDS)])
        elif op == "drop" and len(self.names) > 1:
            delattr(self.root, name)
            self.names.remove(name)
        elif op == "restore" and self.manager.checkpoints:
            path = self.manager.checkpoints[pick % len(self.manager.checkpoints)]
            if self._fits(self.saved[path]):
                self.ckpt.restore(path)
        elif op == "restart":
            self.restart()
        elif op == "resume" and self.manager.checkpoints:  # a restart that restores
            path = self.manager.checkpoints[-1]
            if self._fits(self.saved[path]):
                self.restart()
                assert self.manager.restore_or_initialize() == path

    def _fits(self, stored: dict[str, np.ndarray]) -> bool:
        """Whether the variables now are those ``stored`` holds (keys, dtypes, shapes)."""
        now = self.values()
        return set(stored) == set(now) and all(
            stored[k].dtype == now[k].dtype and stored[k].shape == now[k].shape for k in now)

    def save(self, by_hand: bool) -> None:
        number = None
        if by_hand:  # past every step so far, skipping some numbers
            used = [int(re.findall(r"ckpt-(\d+)", Path(p).name)[0]) for p in self.saved]
            number = max([*used, int(self.ckpt.save_counter.numpy())]) + 2
        path = self.manager.save(checkpoint_number=number)
        self.saved[path] = self.values()

    def check(self) -> None:
        listed = self.manager.checkpoints
        on_disk = sorted(str(p) for p in self.directory.glob("ckpt-*"))
        assert set(listed) <= set(on_disk)
        for path in on_disk:  # listed, or held for a listed step: each loads exactly
            got = cv.load(path)
            want = self.saved[path]
            assert set(got) == set(want), path
            for key, value in want.items():
                have = np.asarray(got[key])
                assert have.dtype == value.dtype and have.shape == value.shape, (path, key)
                assert have.tobytes() == value.tobytes(), (path, key)


#: one step: the operations before the save (each with a number picking its variable,
#: kind or step), and whether the save's number is given by hand
_step = st.tuples(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 99)), max_size=4),
                  st.booleans())
Steps = list[tuple[list[tuple[str, int]], bool]]


def _run(tmp: Path, fmt: str, keep: int | None, seed: int, steps: Steps) -> None:
    with cv.Graph().as_default():
        job = _Job(tmp / "run", fmt, keep, seed)
        for ops, by_hand in steps:
            for op, pick in ops:
                job.apply(op, pick)
            job.save(by_hand)
            job.check()


@settings(max_examples=5, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(["h5", "zarr"]), keep=st.sampled_from([1, 2, None]),
       seed=st.integers(0, 2**16), steps=st.lists(_step, min_size=2, max_size=5))
def test_random_training_sequences(tmp_path_factory: pytest.TempPathFactory, fmt: str,
                                   keep: int | None, seed: int, steps: Steps) -> None:
    _run(tmp_path_factory.mktemp("random"), fmt, keep, seed, steps)


@pytest.mark.slow
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(["h5", "zarr"]), keep=st.sampled_from([1, 2, 3, None]),
       seed=st.integers(0, 2**16), steps=st.lists(_step, min_size=10, max_size=25))
def test_long_random_training_sequences(tmp_path_factory: pytest.TempPathFactory, fmt: str,
                                        keep: int | None, seed: int, steps: Steps) -> None:
    _run(tmp_path_factory.mktemp("random"), fmt, keep, seed, steps)


def test_a_step_sequence_that_found_a_bug(tmp_path: Path, fmt: str) -> None:
    """The sequence that found an empty table unreadable from an HDF5 step sharing it."""
    steps: Steps = [([], False), ([("assign", 0)], False), ([("scatter", 5)], True)]
    _run(tmp_path, fmt, 1, 0, steps)
