"""The errors ckptvar raises on purpose.

Every error derives from :class:`CkptError` and from the builtin a caller would
naturally catch, so ``except ValueError`` keeps working::

    CkptError(Exception)
    ├── UninitializedVariableError(CkptError, ValueError)  reading a deferred variable
    ├── ShapeLockError(CkptError, ValueError)              a value's shape != the variable's
    ├── DTypeLockError(CkptError, TypeError)               a value's dtype can't be cast same_kind
    ├── VariableScopeError(CkptError, ValueError)          get_variable reuse / exists clashes
    ├── CheckpointMismatchError(CkptError, ValueError)     restore: stored vs expected shape/dtype
    ├── RestoreAssertionError(CkptError, AssertionError)   a status assertion found unmatched keys
    ├── CorruptCheckpointError(CkptError, ValueError)      damaged, truncated or hostile file
    ├── UnsupportedFormatError(CkptError, ValueError)      unknown suffix/format, or read-only format
    ├── DeviceError(CkptError, ValueError)                 a device that does not exist
    ├── CheckpointNotFoundError(CkptError, FileNotFoundError)
    ├── DestinationIsDirectoryError(CkptError, IsADirectoryError)  a save onto a directory not ours
    ├── DestinationExistsError(CkptError, FileExistsError)  a file in the way of a directory save
    └── MissingKeyError(CkptError, KeyError)               a key that is not in a checkpoint

Messages say what failed, for which object, expected vs found, and a hint.
"""

from __future__ import annotations

__all__ = [
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CkptError",
    "CorruptCheckpointError",
    "DTypeLockError",
    "DestinationExistsError",
    "DestinationIsDirectoryError",
    "DeviceError",
    "MissingKeyError",
    "RestoreAssertionError",
    "ShapeLockError",
    "UninitializedVariableError",
    "UnsupportedFormatError",
    "VariableScopeError",
]


class CkptError(Exception):
    """Base class of every error ckptvar raises on purpose."""


class UninitializedVariableError(CkptError, ValueError):
    """A variable was read before it was given a value."""


class ShapeLockError(CkptError, ValueError):
    """A value's shape does not match the variable's locked shape."""


class DTypeLockError(CkptError, TypeError):
    """A value cannot be converted to the variable's dtype under ``same_kind`` rules."""


class VariableScopeError(CkptError, ValueError):
    """``get_variable`` was asked to create an existing variable or reuse a missing one."""


class CheckpointMismatchError(CkptError, ValueError):
    """A stored value's shape or dtype does not match the object it is restored into."""


class RestoreAssertionError(CkptError, AssertionError):
    """A restore-status assertion found unmatched values or objects."""


class CorruptCheckpointError(CkptError, ValueError):
    """A checkpoint is damaged, truncated, inconsistent or hostile."""


class UnsupportedFormatError(CkptError, ValueError):
    """The path's format is unknown, or the format cannot be written."""


class DeviceError(CkptError, ValueError):
    """A device was asked for that does not exist here."""


class CheckpointNotFoundError(CkptError, FileNotFoundError):
    """No checkpoint exists at the given path."""


class DestinationIsDirectoryError(CkptError, IsADirectoryError):
    """A save would replace a directory that is not a ckptvar checkpoint of the same kind."""


class DestinationExistsError(CkptError, FileExistsError):
    """A save of a directory checkpoint found a file (or link) at its path."""


class MissingKeyError(CkptError, KeyError):
    """A key is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class CheckpointExistsError(CkptError, FileExistsError):
    """A step is already committed: a create-only write (the commit marker) found it there."""
