"""ckptvar: NumPy-first variables and names-preserved, crash-safe checkpoints.

>>> import ckptvar as cv
>>> v = cv.Variable([1.0, 2.0], name="v")
>>> v.assign_add([1.0, 1.0]).numpy()
array([2., 3.], dtype=float32)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Every public name is loaded on first use (PEP 562), so ``import ckptvar`` and the
# ``ckpt`` command's help import neither NumPy nor h5py/zarr until a name needs them.
# ``__all__`` at the end is the public contract (tests/test_public_api.py): add a name
# there only as a decision, with API.md, and to ``_LAZY`` (the module that defines it).

if TYPE_CHECKING:  # what the names are, for type checkers; loaded on first use
    from . import distributed, initializers
    from .checkpoint import (
        Checkpoint,
        CheckpointManager,
        IncrementalOptions,
        Saver,
        latest_checkpoint,
        restore_on_create,
        wait_for_pending_saves,
    )
    from .device import (
        device,
        list_devices,
        set_log_device_placement,
    )
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
    from .io import (
        list_variables,
        load,
        load_variable,
        open,
        save,
    )
    from .module import (
        Module,
    )
    from .trackable import (
        Trackable,
    )
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

_LAZY: dict[str, str] = {
    "Checkpoint": ".checkpoint",
    "CheckpointManager": ".checkpoint",
    "IncrementalOptions": ".checkpoint",
    "Saver": ".checkpoint",
    "latest_checkpoint": ".checkpoint",
    "restore_on_create": ".checkpoint",
    "wait_for_pending_saves": ".checkpoint",
    "CheckpointExistsError": ".errors",
    "CheckpointMismatchError": ".errors",
    "CheckpointNotFoundError": ".errors",
    "CkptError": ".errors",
    "CorruptCheckpointError": ".errors",
    "DeviceError": ".errors",
    "DistributedError": ".errors",
    "DistributedTimeoutError": ".errors",
    "RestoreAssertionError": ".errors",
    "ShardLayoutError": ".errors",
    "UninitializedVariableError": ".errors",
    "UnsupportedFormatError": ".errors",
    "Graph": ".graph",
    "GraphKeys": ".graph",
    "add_to_collection": ".graph",
    "get_collection": ".graph",
    "get_default_graph": ".graph",
    "global_variables": ".graph",
    "local_variables": ".graph",
    "name_scope": ".graph",
    "reset_default_graph": ".graph",
    "trainable_variables": ".graph",
    "AUTO_REUSE": ".variables",
    "PartitionedVariable": ".variables",
    "SaveSliceInfo": ".variables",
    "Shard": ".variables",
    "Variable": ".variables",
    "deferred_init": ".variables",
    "fixed_size_partitioner": ".variables",
    "get_variable": ".variables",
    "global_variables_initializer": ".variables",
    "min_max_variable_partitioner": ".variables",
    "report_uninitialized_variables": ".variables",
    "variable_axis_size_partitioner": ".variables",
    "variable_scope": ".variables",
    "device": ".device",
    "list_devices": ".device",
    "set_log_device_placement": ".device",
    "list_variables": ".io",
    "load": ".io",
    "load_variable": ".io",
    "open": ".io",
    "save": ".io",
    "Module": ".module",
    "Trackable": ".trackable",
}
#: Public subpackages, loaded on first use like the names.
_SUBMODULES = frozenset({"distributed", "initializers"})


class _Package(ModuleType):
    """The package: a public name that is also a submodule's name (``cv.device``, the
    function in ``ckptvar/device.py``) stays the public name when the submodule loads."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, ModuleType):
            return  # the import system binding the submodule over the public name
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    """Load a public name (or any submodule, ``cv.storage``) when it is first used."""
    where = _LAZY.get(name)
    if where is not None:
        value = getattr(importlib.import_module(where, __name__), name)
        globals()[name] = value  # later uses find it directly
        return value
    if name in _SUBMODULES or (
        not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None
    ):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, "__version__"})


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
    "IncrementalOptions",
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
