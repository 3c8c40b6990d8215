"""Shared test helpers: a fresh default graph, and the GPU skip helper.

Other areas may append fixtures below their own section comment.
"""

from __future__ import annotations

from collections.abc import Iterator

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
