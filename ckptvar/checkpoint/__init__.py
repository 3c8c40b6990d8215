"""Object-based and name-based checkpoints over the storage formats.

The only layer that knows both the variable core and storage. Modules:
``_keys`` (key escaping), ``_walk`` (the object-graph walk), ``_serialize``
(objects -> arrays and metadata), ``_restore`` (plan, validate, apply; status;
restore-on-create), ``_checkpoint`` (``Checkpoint``), ``_saver`` (``Saver``),
``_manager`` (``CheckpointManager``, ``latest_checkpoint``), ``_async``
(background saves).
"""

from __future__ import annotations

from ._async import SaveHandle, wait_for_pending_saves
from ._checkpoint import Checkpoint
from ._manager import CheckpointManager, latest_checkpoint
from ._restore import RestoreStatus, restore_on_create
from ._saver import Saver

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "RestoreStatus",
    "SaveHandle",
    "Saver",
    "latest_checkpoint",
    "restore_on_create",
    "wait_for_pending_saves",
]
