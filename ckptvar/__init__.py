"""ckptvar: NumPy-first variables and names-preserved, crash-safe checkpoints.

>>> import ckptvar as cv
>>> v = cv.Variable([1.0, 2.0], name="v")
>>> v.assign_add([1.0, 1.0]).numpy()
array([2., 3.], dtype=float32)
"""

from __future__ import annotations

__version__ = "0.1.0"

# Each area of the library adds its public names in its own section below.
# The sorted ``__all__`` at the end is the public contract (tests/test_public_api.py).

# --- errors -----------------------------------------------------------------
from .errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    DeviceError,
    RestoreAssertionError,
    UninitializedVariableError,
    UnsupportedFormatError,
)

# --- core: devices, graph, variables, initializers ---------------------------

# --- trackable objects and checkpoints ----------------------------------------

# --- loading and inspection ---------------------------------------------------

__all__ = sorted(name for name in dir() if not name.startswith("_") and name != "annotations")
