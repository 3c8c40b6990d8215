"""The fault the multi-process incremental cases inject: one rank's process file fails
after its bytes were written (``ENOSPC``), so the save must fail on every rank."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any


def save_failing_on(rank: int, mgr: Any, coord: Any, **save_kw: Any) -> str | None:
    """``mgr.save(**save_kw)`` with rank ``rank``'s file write failing once its bytes are
    written: the name of the error this process raised (``None``: it did not raise).
    Every rank waits for the others before returning."""
    from ckptvar.checkpoint import _collective_targets as targets

    real = targets._write_file

    def failing(path: Path, *args: Any, **kw: Any) -> None:
        real(path, *args, **kw)
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))

    if coord.rank == rank:
        targets._write_file = failing  # type: ignore[assignment]
    failed = None
    try:
        mgr.save(**save_kw)
    except Exception as exc:  # noqa: BLE001 - reported
        failed = type(exc).__name__
    finally:
        targets._write_file = real  # type: ignore[assignment]
    coord.barrier(tag="failed", timeout=60)
    return failed
