"""Atomic publication of a checkpoint file or directory: the rename strategy's names.

They live in :mod:`ckptvar.locations` (``_publish``: how a save becomes
visible, by rename or by marker), where the local location uses them too; this
module keeps the names the container writers and foreign writers import.

>>> is_partial(".ckpt-3.h5.0123456789abcdef0123456789abcdef.partial")
True
>>> is_partial("ckpt-3.h5")
False
"""

from __future__ import annotations

from ..locations import (
    check_destination,
    fsync_all,
    fsync_dir,
    fsync_path,
    is_partial,
    partial_path,
    publish,
    remove_path,
    temporary_sibling,
)

__all__ = [
    "check_destination",
    "fsync_all",
    "fsync_dir",
    "fsync_path",
    "is_partial",
    "partial_path",
    "publish",
    "remove_path",
    "temporary_sibling",
]
