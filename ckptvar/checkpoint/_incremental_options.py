"""The user's choice between bytes written and restore time for incremental steps.

Owns :class:`IncrementalOptions`, what ``CheckpointManager(..., incremental=...)``
takes beside ``True``/``False``: how far a row delta may grow before its patches are
merged or the value written whole (the rule of ``storage/_container/delta``, whose
defaults these are), and how often a step is written whole, standalone
(docs/checkpoints.md, "Choosing the trade-off").

>>> IncrementalOptions() == IncrementalOptions(max_patched_rows=0.25, max_patches=16)
True
>>> IncrementalOptions(whole_every=0)
Traceback (most recent call last):
...
ValueError: IncrementalOptions(whole_every=0): a whole step every N saves needs N >= 1 (1: every step whole), or None (never).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..storage import DeltaLimits

__all__ = ["IncrementalOptions", "incremental_options"]

_DEFAULT = DeltaLimits()


@dataclass(frozen=True)
class IncrementalOptions:
    """How an incremental manager trades bytes written for restore time.

    Args:
        max_patched_rows: the share of a value's rows (0 to 1, counted with repeats) that
            its row patches may hold before they are merged into one or the value is
            written whole. It bounds what a restore reads beyond the value (at most
            ``1 + max_patched_rows`` times its bytes); ``0``: no row deltas (a changed
            value is written whole). Default 0.25.
        max_patches: how many patches a row delta may refer to (its own included)
            before they are merged. Default 16.
        whole_every: every N-th save since the last whole step writes every value
            whole (a standalone step: it refers to no other step, so restoring it reads
            nothing but its own values, and pruning may free everything before it);
            ``None`` (default): only when nothing can be shared. A manager that does not
            know when the last whole step was (a new one, e.g. after a restart, on a
            directory holding steps) writes its first step whole.
    """

    max_patched_rows: float = _DEFAULT.rows
    max_patches: int = _DEFAULT.patches
    whole_every: int | None = None

    def __post_init__(self) -> None:
        share: object = self.max_patched_rows
        if isinstance(share, bool) or not isinstance(share, numbers.Real):
            raise TypeError(f"IncrementalOptions(max_patched_rows={share!r}): a share of "
                            "the rows is a number from 0 to 1.")
        if not (math.isfinite(float(share)) and 0 <= float(share) <= 1):
            raise ValueError(f"IncrementalOptions(max_patched_rows={share!r}): a share of "
                             "the rows is a number from 0 to 1 (0: no row deltas).")
        _check_count("max_patches", self.max_patches,
                     "a row delta refers to at least its own patch")
        if self.whole_every is not None:
            _check_count("whole_every", self.whole_every,
                         "a whole step every N saves needs N >= 1 (1: every step whole), "
                         "or None (never)")

    def limits(self) -> DeltaLimits:
        """The row delta rule's limits these options set."""
        return DeltaLimits(float(self.max_patched_rows), int(self.max_patches))


def _check_count(name: str, value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"IncrementalOptions({name}={value!r}): expected a whole number "
                        f"({what}).")
    if int(value) < 1:
        raise ValueError(f"IncrementalOptions({name}={value!r}): {what}.")


def incremental_options(incremental: object) -> IncrementalOptions | None:
    """What ``CheckpointManager(incremental=...)`` was given, as options (``False``: None).

    >>> incremental_options(True) == IncrementalOptions(), incremental_options(False)
    (True, None)
    """
    if isinstance(incremental, IncrementalOptions):
        return incremental
    if incremental is None or isinstance(incremental, bool | np.bool_):
        return IncrementalOptions() if incremental else None
    raise TypeError(f"CheckpointManager(incremental={incremental!r}): expected True, False "
                    "or a cv.IncrementalOptions.")
