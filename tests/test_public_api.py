"""The public names are a contract (API.md): adding or removing one is a decision."""

from __future__ import annotations

import builtins

import pytest

import ckptvar as cv

DOCUMENTED = {
    # errors (API.md §10)
    "CkptError", "UninitializedVariableError", "CheckpointMismatchError",
    "RestoreAssertionError", "CorruptCheckpointError", "DeviceError",
    "UnsupportedFormatError", "CheckpointNotFoundError", "CheckpointExistsError",
    # variables, names, collections, initialization (§1, §2)
    "Variable", "Graph", "GraphKeys", "AUTO_REUSE", "name_scope", "variable_scope",
    "get_variable", "get_default_graph", "reset_default_graph", "global_variables",
    "trainable_variables", "local_variables", "add_to_collection", "get_collection",
    "deferred_init", "global_variables_initializer", "report_uninitialized_variables",
    "initializers",
    # devices (§3)
    "device", "list_devices", "set_log_device_placement",
    # trackables and checkpoints (§4-§6)
    "Module", "Trackable", "Checkpoint", "Saver", "CheckpointManager", "latest_checkpoint",
    "wait_for_pending_saves", "restore_on_create",
    # loading (§7), plus save(): the writing counterpart of load() used by `ckpt convert`
    "list_variables", "load_variable", "load", "open", "save",
    # partitioned variables and shards (§11)
    "PartitionedVariable", "SaveSliceInfo", "Shard", "fixed_size_partitioner",
    "min_max_variable_partitioner", "variable_axis_size_partitioner",
    # many processes (§11) and object stores (§12)
    "distributed", "DistributedError", "DistributedTimeoutError", "ShardLayoutError",
    "CheckpointExistsError",
    # incremental checkpoints (§15): CheckpointManager(incremental=IncrementalOptions(...))
    "IncrementalOptions",
}


def test_all_is_exactly_the_documented_names() -> None:
    assert set(cv.__all__) == DOCUMENTED
    assert cv.__all__ == sorted(cv.__all__)


def test_every_public_name_resolves() -> None:
    for name in cv.__all__:
        assert getattr(cv, name) is not None


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        ("UninitializedVariableError", ValueError),
        ("CheckpointMismatchError", ValueError),
        ("RestoreAssertionError", AssertionError),
        ("CorruptCheckpointError", ValueError),
        ("DeviceError", ValueError),
        ("UnsupportedFormatError", ValueError),
        ("CheckpointNotFoundError", FileNotFoundError),
        ("ShardLayoutError", ValueError),
        ("DistributedError", Exception),
        ("DistributedTimeoutError", TimeoutError),
        ("CheckpointExistsError", FileExistsError),
    ],
)
def test_errors_are_ckpt_errors_and_builtins(error: str, builtin: type) -> None:
    cls = getattr(cv, error)
    assert issubclass(cls, cv.CkptError)
    assert issubclass(cls, builtin)
    assert getattr(builtins, builtin.__name__) is builtin


def test_version_is_a_string() -> None:
    assert isinstance(cv.__version__, str) and cv.__version__.count(".") >= 1



def test_the_scale_out_names_are_the_ones_api_md_describes() -> None:
    assert issubclass(cv.DistributedTimeoutError, cv.DistributedError)
    assert callable(cv.distributed.from_env)
    assert cv.distributed is __import__("ckptvar.distributed").distributed
