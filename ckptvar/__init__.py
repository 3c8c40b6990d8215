"""ckptvar: NumPy-first variables and names-preserved, crash-safe checkpoints.

>>> import ckptvar as cv
>>> v = cv.Variable([1.0, 2.0], name="v")
>>> v.assign_add([1.0, 1.0]).numpy()
array([2., 3.], dtype=float32)
"""

from __future__ import annotations

__version__ = "0.1.0"

# Each area of the library adds its public names in its own section below.
# ``__all__`` at the end is the public contract (tests/test_public_api.py): add a name
# there only as a decision, with API.md.

# --- errors -----------------------------------------------------------------
# --- core: devices, graph, variables, initializers ---------------------------
# --- many processes (API.md §11) ----------------------------------------------
from . import distributed, initializers

# --- trackable objects and checkpoints ----------------------------------------
from .checkpoint import (
    Checkpoint,
    CheckpointManager,
    Saver,
    latest_checkpoint,
    restore_on_create,
    wait_for_pending_saves,
)
from .device import device, list_devices, set_log_device_placement
from .errors import (
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    DeviceError,
    DistributedError,
    DistributedTimeoutError,
    RestoreAssertionError,
    ShardLayoutError,
    UninitializedVariableError,
    UnsupportedFormatError,
)
from .graph import (
    Graph,
    GraphKeys,
    add_to_collection,
    get_collection,
    get_default_graph,
    global_variables,
    local_variables,
    name_scope,
    reset_default_graph,
    trainable_variables,
)

# --- loading and inspection ---------------------------------------------------
from .io import list_variables, load, load_variable, open, save
from .module import Module
from .trackable import Trackable
from .variables import (
    AUTO_REUSE,
    PartitionedVariable,
    SaveSliceInfo,
    Shard,
    Variable,
    deferred_init,
    fixed_size_partitioner,
    get_variable,
    global_variables_initializer,
    min_max_variable_partitioner,
    report_uninitialized_variables,
    variable_axis_size_partitioner,
    variable_scope,
)

__all__ = [
    "AUTO_REUSE",
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CkptError",
    "CorruptCheckpointError",
    "DeviceError",
    "DistributedError",
    "DistributedTimeoutError",
    "Graph",
    "GraphKeys",
    "Module",
    "PartitionedVariable",
    "RestoreAssertionError",
    "SaveSliceInfo",
    "Saver",
    "Shard",
    "ShardLayoutError",
    "Trackable",
    "UninitializedVariableError",
    "UnsupportedFormatError",
    "Variable",
    "add_to_collection",
    "deferred_init",
    "device",
    "distributed",
    "fixed_size_partitioner",
    "get_collection",
    "get_default_graph",
    "get_variable",
    "global_variables",
    "global_variables_initializer",
    "initializers",
    "latest_checkpoint",
    "list_devices",
    "list_variables",
    "load",
    "load_variable",
    "local_variables",
    "min_max_variable_partitioner",
    "name_scope",
    "open",
    "report_uninitialized_variables",
    "reset_default_graph",
    "restore_on_create",
    "save",
    "set_log_device_placement",
    "trainable_variables",
    "variable_axis_size_partitioner",
    "variable_scope",
    "wait_for_pending_saves",
]
