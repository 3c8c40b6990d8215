"""Variables: named, mutable arrays with a locked dtype and shape, and the TF1 variable API.

The package's modules, each owning one idea:

- :mod:`._variable`: :class:`Variable`, its lifecycle (one explicit state) and writes;
- :mod:`._array`: operators, the NumPy protocols, ``VariableSlice``, buffer copies;
- :mod:`._shapes`: shape locks; :mod:`._slices`: :class:`Shard`, :class:`SaveSliceInfo`,
  :class:`LogicalBox` (what box of a logical variable a variable holds);
- :mod:`._hooks`: creation hooks and :func:`deferred_init`;
- :mod:`.tf1`: variable scopes, :func:`get_variable` and its store;
- :mod:`.partitioned`: :class:`PartitionedVariable` and the TF partitioners.

The restore seam (:func:`is_materialized`, :func:`host_buffer`, :func:`restore_value`,
:func:`set_initial_value_source`, :func:`give_restored`) is what the checkpoint layer
may do to a variable beyond its public API; it is exported here, not from ``cv``.

Importing this package loads NumPy and ml_dtypes only: no storage library, no CuPy.

>>> from ckptvar.graph import Graph
>>> with Graph().as_default():
...     v = Variable([1.0, 2.0], name="v")
...     (v + 1).tolist(), v.logical_box.full_shape
([2.0, 3.0], (2,))
"""

from __future__ import annotations

from ._array import VariableSlice
from ._hooks import CreationHookHandle, deferred_init, register_creation_hook
from ._lifecycle import FreshValue, convert_value
from ._shapes import VariableArgumentError
from ._slices import LogicalBox, SaveSliceInfo, Shard
from ._variable import (
    Variable,
    VariableStateError,
    device_buffer,
    device_value,
    give_restored,
    host_buffer,
    host_buffers,
    is_materialized,
    read_buffer,
    read_buffers,
    restore_value,
    rows_written,
    set_device_value,
    set_initial_value_source,
    set_save_slice_info,
    shapes_and_dtypes,
    shares_memory,
    track_rows,
    unsharded,
    write_counts,
    write_version,
)
from .partitioned import (
    PartitionedVariable,
    PartitionInfo,
    fixed_size_partitioner,
    min_max_variable_partitioner,
    variable_axis_size_partitioner,
)
from .tf1 import (
    AUTO_REUSE,
    VariableScope,
    get_variable,
    get_variable_scope,
    global_variables_initializer,
    report_uninitialized_variables,
    variable_scope,
)

__all__ = [
    "AUTO_REUSE",
    "CreationHookHandle",
    "FreshValue",
    "LogicalBox",
    "PartitionInfo",
    "PartitionedVariable",
    "SaveSliceInfo",
    "Shard",
    "Variable",
    "VariableArgumentError",
    "VariableScope",
    "VariableSlice",
    "VariableStateError",
    "convert_value",
    "deferred_init",
    "device_buffer",
    "device_value",
    "fixed_size_partitioner",
    "get_variable",
    "get_variable_scope",
    "give_restored",
    "global_variables_initializer",
    "host_buffer",
    "host_buffers",
    "is_materialized",
    "min_max_variable_partitioner",
    "read_buffer",
    "read_buffers",
    "register_creation_hook",
    "report_uninitialized_variables",
    "restore_value",
    "rows_written",
    "set_device_value",
    "set_initial_value_source",
    "set_save_slice_info",
    "shapes_and_dtypes",
    "shares_memory",
    "track_rows",
    "unsharded",
    "variable_axis_size_partitioner",
    "variable_scope",
    "write_counts",
    "write_version",
]
