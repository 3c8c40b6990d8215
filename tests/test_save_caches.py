"""What a background save keeps from one call to the next never goes stale.

The blocking part of ``write(..., blocking=False)`` keeps: the writer backend chosen for
a path's name (``storage.registry``), the last snapshot's variables and their
attributes (``SnapshotBuffer``), and one writer thread a process (``checkpoint._async``).
Each test changes what the kept answer was taken from and checks the next save sees it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import UnsupportedFormatError
from ckptvar.storage import backend_for, register_backend, registry


@pytest.fixture
def own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the registry for this test (registering here changes nothing else)."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    monkeypatch.setattr(registry, "_WRITERS", {})
    monkeypatch.setattr(registry, "_SUFFIXES", list(registry._SUFFIXES))


@pytest.mark.usefixtures("own_registry")
def test_the_writer_kept_for_a_name_follows_the_registry() -> None:
    h5 = backend_for("run/ckpt-1.h5", mode="w")
    assert h5.name == "h5"
    assert backend_for("run/ckpt-1.foo.h5", mode="w") is h5  # kept under ".foo.h5"
    assert backend_for("run/model_ckpt", mode="w") is h5  # no suffix: HDF5, kept too
    foo = register_backend(type("FooH5", (h5,), {"name": "cvtest-foo", "suffixes": (".foo.h5",)}))
    # a longer suffix registered since: the kept answers are dropped
    assert backend_for("run/ckpt-2.foo.h5", mode="w") is foo
    assert backend_for("run/ckpt-2.h5", mode="w") is h5
    undotted = register_backend(type("Undotted", (h5,), {"name": "cvtest-undotted",
                                                         "suffixes": ("_ckpt",)}))
    assert backend_for("run/model_ckpt", mode="w") is undotted  # a suffix without a dot
    assert backend_for("run/ckpt-3.foo.h5", mode="w") is foo
    assert backend_for("run/other", mode="w") is h5


@pytest.mark.usefixtures("own_registry")
def test_the_writer_kept_for_a_name_depends_on_the_format_and_never_keeps_an_error() -> None:
    assert backend_for("run/ckpt-1.h5", "zarr", mode="w").name == "zarr"
    assert backend_for("run/ckpt-2.h5", None, mode="w").name == "h5"
    assert backend_for("run/ckpt-3.H5", mode="w").name == "h5"  # suffixes ignore case
    for _ in range(2):  # refused each time, not kept
        with pytest.raises(UnsupportedFormatError, match="read-only"):
            backend_for("run/model.weights.h5", mode="w")
        with pytest.raises(UnsupportedFormatError, match="unknown suffix"):
            backend_for("run/ckpt.xyz", mode="w")
    # names whose end is not plainly after the last "/": asked as before
    assert backend_for("run/ckpt.zarr/", mode="w").name == "zarr"
    assert backend_for(Path("run") / "ckpt.zarr", mode="w").name == "zarr"
    for i in range(100):  # names with dots of their own: the kept answers stay few
        assert backend_for(f"run/step.{i}.zarr", mode="w").name == "zarr"
    assert len(registry._WRITERS) <= 64


def _saved(ckpt: cv.Checkpoint, path: Path) -> dict[str, np.ndarray]:
    return dict(cv.load(ckpt.write(path, blocking=False).wait()))


def test_a_snapshot_of_the_same_variables_reads_them_anew(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The second save takes the kept plan (one pass over the buffers), and what it
    saves is still each variable's value as of the call."""
    from ckptvar.checkpoint import _serialize

    passes: list[int] = []
    real = _serialize.read_buffers

    def spy(variables):  # type: ignore[no-untyped-def]
        got = real(variables)
        passes.append(0 if got is None else len(got))
        return got

    monkeypatch.setattr(_serialize, "read_buffers", spy)
    a = cv.Variable(np.zeros(3, "float32"), shape=(None,), name="a")
    b = cv.Variable(np.ones(2, "int64"), name="b")
    ckpt = cv.Checkpoint(a=a, b=b)
    assert _saved(ckpt, tmp_path / "s1.h5")["a"].tolist() == [0, 0, 0]
    assert passes == []  # the first snapshot of these variables: no plan yet
    a.assign([1, 2, 3])
    got = _saved(ckpt, tmp_path / "s2.h5")
    assert passes == [2] and got["a"].tolist() == [1, 2, 3] and got["b"].tolist() == [1, 1]
    # a restore of another shape gives ``a`` a new buffer: the kept plan reads that one
    big = cv.Checkpoint(a=cv.Variable(np.arange(5, dtype="float32"), name="a"))
    ckpt.restore(big.write(tmp_path / "big.h5"))
    got = _saved(ckpt, tmp_path / "s3.h5")
    assert got["a"].tolist() == [0, 1, 2, 3, 4] and got["b"].tolist() == [1, 1]
    assert passes[-1] == 2


def test_a_snapshot_sees_variables_replaced_swapped_or_removed(tmp_path: Path) -> None:
    a = cv.Variable(np.zeros(2), name="a")
    b = cv.Variable(np.ones(2), name="b")
    ckpt = cv.Checkpoint(x=a, y=b)
    assert _saved(ckpt, tmp_path / "1.h5")["x"].tolist() == [0, 0]
    ckpt.x, ckpt.y = b, a  # the same variables under swapped keys
    got = _saved(ckpt, tmp_path / "2.h5")
    assert got["x"].tolist() == [1, 1] and got["y"].tolist() == [0, 0]
    ckpt.x = cv.Variable(np.full(2, 7.0), name="c")  # another variable under a key
    assert _saved(ckpt, tmp_path / "3.h5")["x"].tolist() == [7, 7]
    del ckpt.y
    assert set(_saved(ckpt, tmp_path / "4.h5")) == {"x"}
    ckpt.y = cv.Variable(np.full(3, 5, "int8"), name="d")  # a new key, a new layout
    got = _saved(ckpt, tmp_path / "5.h5")
    assert got["y"].dtype == np.int8 and got["y"].tolist() == [5, 5, 5]


def test_a_forked_child_saves_in_the_background_on_its_own_writer_thread(tmp_path: Path) -> None:
    """The parent's writer thread does not exist in a child made by ``fork``: the
    child's first background save starts its own (it would otherwise never run)."""
    script = (
        "import os, sys, numpy as np, ckptvar as cv\n"
        "c = cv.Checkpoint(v=cv.Variable(np.arange(4.0), name='v'))\n"
        "c.save(sys.argv[1] + '/parent', blocking=False).wait()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    c.v.assign(np.full(4, 9.0))\n"
        "    got = c.save(sys.argv[1] + '/child', blocking=False).wait(timeout=60)\n"
        "    os._exit(0 if got else 3)\n"
        "code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
        "c.save(sys.argv[1] + '/parent', blocking=False).wait()\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert cv.load(tmp_path / "child-2.h5")["v"].tolist() == [9.0] * 4
    assert cv.load(tmp_path / "parent-2.h5")["v"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_forked_child_does_not_wait_for_the_parents_save_in_flight(tmp_path: Path) -> None:
    """A save in flight in the parent at the fork never runs in the child (it has no
    writer thread of its own yet): the child's waits, its own saves and its exit go on
    without it instead of hanging, and its handle there returns None, not a path."""
    script = (
        "import os, sys, threading, numpy as np, ckptvar as cv\n"
        "from ckptvar.checkpoint import _async\n"
        "gate = threading.Event()\n"
        "def held():\n"
        "    assert gate.wait(30)\n"
        "    return 'parent'\n"
        "h = _async.submit(held, 'parent')\n"  # the parent's writer busy at the fork
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    c = cv.Checkpoint(v=cv.Variable(np.arange(4.0), name='v'))\n"
        "    assert c.save(sys.argv[1] + '/child', blocking=False).wait(timeout=30)\n"
        "    cv.wait_for_pending_saves()\n"
        "    assert h.done() and h.wait(timeout=1) is None\n"
        "    sys.exit(7)\n"  # a normal exit: the exit wait runs
        "code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
        "gate.set()\n"
        "assert h.wait(timeout=30) == 'parent'\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 7, proc.stderr
    assert cv.load(tmp_path / "child-1.h5")["v"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.usefixtures("own_registry")
def test_a_backend_registered_while_a_writer_is_looked_up_is_not_hidden_by_it() -> None:
    """A look-up that began before ``register_backend`` may answer as before, but does
    not keep its answer past the registration (the next save would write the old format)."""
    h5 = backend_for("run/ckpt-1.h5", mode="w")
    asking, go_on = threading.Event(), threading.Event()

    class Slow(type(h5)):  # type: ignore[misc]
        @property
        def can_write(cls) -> bool:  # asked between the choice and keeping it
            if threading.current_thread().name == "cvtest-asker":
                asking.set()
                assert go_on.wait(30)
            return True

        @can_write.setter
        def can_write(cls, value: bool) -> None:  # set by Backend.__init_subclass__
            pass

    old = register_backend(Slow("Old", (h5,), {"name": "cvtest-slow", "suffixes": (".slow",)}))
    got: list[object] = []
    asker = threading.Thread(target=lambda: got.append(backend_for("run/a.slow", mode="w")),
                             name="cvtest-asker")
    asker.start()
    assert asking.wait(30)
    new = register_backend(type("New", (h5,), {"name": "cvtest-slow", "suffixes": (".slow",)}),
                           override=True)
    go_on.set()
    asker.join(30)
    assert got == [old]  # asked before the registration
    assert backend_for("run/b.slow", mode="w") is new


def test_the_kept_msgpack_packer_starts_each_state_afresh() -> None:
    # Each thread keeps one packer for the objects' Python state: a state it could not
    # pack, or one too big to keep the buffer of, leaves nothing behind in the next;
    # two threads never share one.
    import msgpack

    from ckptvar.checkpoint._serialize import encode_state

    good = {"d": [["lr", {"v": 0.5}], ["w", {"T": 1}], ["betas", {"t": [{"v": 0.9}]}]]}
    with pytest.raises(TypeError, match="'optimizer'"):
        encode_state({"d": [["n", {"v": 2**70}]]}, "optimizer")
    assert encode_state(good, "optimizer") == msgpack.packb(good, use_bin_type=True)
    big = {"v": b"x" * (3 << 20)}
    assert encode_state(big, "blob") == msgpack.packb(big, use_bin_type=True)
    assert encode_state(good, "optimizer") == msgpack.packb(good, use_bin_type=True)
    states = [{"d": [[f"k{i}", {"v": i}] for i in range(n)]} for n in range(1, 40)]
    results: dict[int, list[bytes]] = {}

    def encode_all(t: int) -> None:
        results[t] = [encode_state(s, f"t{t}") for s in states * 20]

    threads = [threading.Thread(target=encode_all, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    want = [msgpack.packb(s, use_bin_type=True) for s in states * 20]
    assert all(results[t] == want for t in range(4))
