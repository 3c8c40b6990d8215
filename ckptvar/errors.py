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
    ├── CheckpointExistsError(CkptError, FileExistsError)  a step already committed (create-only write)
    ├── DestinationIsDirectoryError(CkptError, IsADirectoryError)  a save onto a directory not ours
    ├── DestinationExistsError(CkptError, FileExistsError)  a file in the way of a directory save
    ├── MissingKeyError(CkptError, KeyError)               a key that is not in a checkpoint
    │   └── MissingValueError(CheckpointMismatchError, MissingKeyError)  a like= tree's key
    │                                                      the checkpoint lacks
    ├── ShardLayoutError(CkptError, ValueError)            shards that overlap, leave a gap,
    │                                                      disagree across processes, or a
    │                                                      restore box no stored slice covers
    └── DistributedError(CkptError)                        another process failed (names `rank N`)
        └── DistributedTimeoutError(DistributedError, TimeoutError)  a collective ran past timeout=

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
    "DistributedError",
    "DistributedTimeoutError",
    "MissingKeyError",
    "MissingValueError",
    "RestoreAssertionError",
    "ShapeLockError",
    "ShardLayoutError",
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


class MissingValueError(CheckpointMismatchError, MissingKeyError):
    """A value asked for (a ``like=`` tree's key) is not in the checkpoint: a mismatch
    between the tree and the file, and a missing key (``except KeyError`` catches it)."""


class ShardLayoutError(CkptError, ValueError):
    """Slices of one logical variable do not fit together.

    Raised when boxes overlap, fall outside the full shape or leave part of it
    uncovered, when processes disagree on a variable's full shape or dtype, when
    replicas of a replicated value differ, or when a restore asks for a region that
    no stored slice covers (a restore never fills a gap).
    """


class DistributedError(CkptError):
    """A collective step failed on one or more processes.

    The message names each failing process as ``rank N``; :attr:`ranks` holds
    their numbers (empty when they are not knowable) and :attr:`failures` maps
    a rank to the message it reported.
    """

    def __init__(
        self,
        message: str,
        *,
        ranks: tuple[int, ...] = (),
        failures: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.failures = dict(failures or {})


class DistributedTimeoutError(DistributedError, TimeoutError):
    """A collective did not complete within its ``timeout``.

    :attr:`collective` and :attr:`tag` name the step; :attr:`ranks` are the
    processes that did not arrive, when this process can know them.
    """

    def __init__(
        self,
        message: str,
        *,
        collective: str = "",
        tag: str = "",
        timeout: float | None = None,
        ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message, ranks=ranks)
        self.collective = collective
        self.tag = tag
        self.timeout = timeout


class CheckpointExistsError(CkptError, FileExistsError):
    """A step is already committed: a create-only write (the commit marker) found it there."""
