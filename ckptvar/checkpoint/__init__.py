"""Object-based and name-based checkpoints over the storage formats.

The only layer that knows both the variable core and storage. Modules:
``_keys`` (key escaping), ``_walk`` (the object-graph walk), ``_serialize``
(objects -> arrays and metadata), ``_steps`` (``prefix-N.suffix`` names),
``_files`` (writing and discarding one checkpoint file), ``_state`` (a
directory's state file, ``latest_checkpoint``), ``_apply`` (all-or-nothing
application of values), ``_logical`` (logical variables: partitioned variables and
shards saved as one value, restored box by box), ``_object_restore`` (matching objects, deferred values),
``_status`` (``RestoreStatus``), ``_on_create`` (``restore_on_create``),
``_checkpoint`` (``Checkpoint``), ``_saver`` (``Saver``), ``_manager``
(``CheckpointManager``), ``_incremental_options`` (``IncrementalOptions``), ``_reclaim`` (``gc``: what dead saves left), ``_async``
(background saves), ``_deletes`` (a manager's pruned steps freed in the background).
``write_values`` (the one save path of a local file), ``destination_error`` and
``make_parents`` also serve ``ckptvar.io``.
"""

from __future__ import annotations

from ._async import SaveHandle, wait_for_pending_saves
from ._checkpoint import Checkpoint, SaveOptions
from ._files import destination_error, make_parents, write_values
from ._incremental_options import IncrementalOptions
from ._manager import CheckpointManager
from ._on_create import restore_on_create
from ._pytree import is_plain, load_tree, save_tree
from ._reclaim import Leftover, gc
from ._saver import Saver
from ._state import latest_checkpoint
from ._status import RestoreStatus
from ._steps import StepName, parse_step_name

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "IncrementalOptions",
    "Leftover",
    "RestoreStatus",
    "SaveHandle",
    "SaveOptions",
    "Saver",
    "StepName",
    "destination_error",
    "gc",
    "is_plain",
    "latest_checkpoint",
    "load_tree",
    "make_parents",
    "parse_step_name",
    "restore_on_create",
    "save_tree",
    "wait_for_pending_saves",
    "write_values",
]
