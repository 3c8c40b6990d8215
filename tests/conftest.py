"""Shared test helpers: a fresh default graph, and the GPU skip helper.

Other areas may append fixtures below their own section comment.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptvar as cv
from ckptvar.device import gpu_count


def _gpu_skip_reason() -> str | None:
    try:
        import cupy  # noqa: F401, PLC0415
    except ImportError:
        return "CuPy is not installed (pip install 'ckptvar[gpu]')"
    if gpu_count() == 0:
        return "CuPy found no CUDA device"
    return None


GPU_SKIP_REASON = _gpu_skip_reason()


def gpu_test(fn):  # type: ignore[no-untyped-def]
    """Mark a test ``gpu`` and skip it, with the reason, when no CUDA device is usable."""
    fn = pytest.mark.gpu(fn)
    return pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")(fn)


@pytest.fixture
def fresh_graph() -> Iterator[cv.Graph]:
    """A new, empty default graph for the test (names, collections, store)."""
    cv.reset_default_graph()
    yield cv.get_default_graph()
    cv.reset_default_graph()


# --- trackable objects and checkpoints -------------------------------------------------


@pytest.fixture(params=["h5", "zarr"])
def fmt(request: pytest.FixtureRequest) -> str:
    """Each checkpoint test runs once per writable format."""
    return str(request.param)


@pytest.fixture
def zarr_opens(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """How many times the Zarr reader opens each file from here on, by inode (its
    ``open_in`` watched, the files opened as before)."""
    import os

    from ckptvar.storage import _zarr

    opened: dict[int, int] = {}
    real = _zarr.open_in

    def counted(root_fd: int, rel: str, **kw: bool) -> int:
        fd = real(root_fd, rel, **kw)
        ino = os.fstat(fd).st_ino
        opened[ino] = opened.get(ino, 0) + 1
        return fd

    monkeypatch.setattr(_zarr, "open_in", counted)
    return opened


@pytest.fixture
def watch_calls(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``watch(owner, name)``: a list that gets the first argument of each call of
    ``owner.name`` from here on (the calls go through as before; undone after the test).
    """
    def watch(owner: object, name: str) -> list[Any]:
        seen: list[Any] = []
        real = getattr(owner, name)

        def called(first: Any, *args: Any, **kw: Any) -> Any:
            seen.append(first)
            return real(first, *args, **kw)

        monkeypatch.setattr(owner, name, called)
        return seen

    return watch


@pytest.fixture
def older_delta_writer(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``enable(base_checksums=False)``: row deltas written from then on as a writer of
    format 1.5 wrote them: with the assembled value's checksums (hashed whole: the bytes
    are the same), not verified by their parts, and with the base's checksums only when
    ``base_checksums`` (undone after the test)."""
    from ckptvar.storage._container import writer

    def enable(*, base_checksums: bool = False) -> None:
        real = writer.ContainerWriter._match_rows

        def older(self: Any, arrays: list[Any], *args: Any) -> None:
            real(self, arrays, *args)
            for it in arrays:
                if it.delta is not None:
                    it.delta.by_parts = False
                    if not base_checksums:
                        it.delta.base_checksum = it.delta.base_blocks = None
                    it.hash()
                    it.hashed = True

        monkeypatch.setattr(writer.ContainerWriter, "_match_rows", older)

    return enable


# --- multi-process runs ------------------------------------------------------------------


def _mapped_shm_names() -> set[str]:
    """The names under /dev/shm that a live process has mapped (Linux ``/proc/*/maps``)."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:  # the process ended, or is not ours to read
            continue
        names.update(part.split("/dev/shm/", 1)[1].split()[0]
                     for part in text.splitlines() if "/dev/shm/mpich_shm_" in part)
    return names


@pytest.fixture(autouse=True, scope="session")
def _reclaim_mpich_segments() -> Iterator[None]:
    """Remove the shared-memory segments of MPI jobs this session aborted or killed.

    MPICH removes its ``/dev/shm/mpich_shm_*`` segment at ``MPI_Finalize``; a job whose
    rank aborts (``python -m mpi4py`` on an exception) or is SIGKILLed by a crash test
    leaves it behind, a few MiB each. At the end of the session, the segments made
    during it that no live process maps are removed (another job's are left alone).
    """
    shm = Path("/dev/shm")
    before = {p.name for p in shm.glob("mpich_shm_*")} if shm.is_dir() else set()
    yield
    if not shm.is_dir():
        return
    made = {p.name for p in shm.glob("mpich_shm_*")} - before
    if not made:
        return
    for name in made - _mapped_shm_names():
        (shm / name).unlink(missing_ok=True)
