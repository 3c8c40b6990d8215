"""Object-based restore on many processes: now, and when objects appear later.

:class:`CollectiveRestoreState` is a :class:`~._object_restore.RestoreState` whose
every step is a collective: each rank matches its objects, reads only its own boxes
(:func:`~._collective_restore.stage_reads`), and all ranks vote before any variable changes.
Values whose objects do not exist yet wait on their parent as in one process; when
the object is attached (on every rank: the processes run the same code), that step
is a collective too. A failure on any rank makes every rank raise
``DistributedError``; no variable changes anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import MissingValueError
from ..storage import paused_gc
from ..variables import PartitionedVariable, Variable
from ._collective_restore import Staged, restore_pairs, stage_reads
from ._object_restore import RestoreState
from ._serialize import decode_state
from ._walk import Node

__all__ = ["CollectiveRestoreState"]


class CollectiveRestoreState(RestoreState):
    """A restore run by every rank of ``coordinator`` together (all or nothing)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        coordinator: Any,
        root: Any = None,
        verify: bool = True,
        cast: bool = False,
        timeout: float | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(path, root=root, verify=verify, cast=cast,
                         storage_options=storage_options)
        self.coordinator = coordinator
        self.timeout = timeout

    def restore_nodes(self, nodes: list[Node]) -> None:
        """Restore everything under ``nodes`` on every rank (a vote first); defer the rest.

        Unlike one process, a variable that exists here but has no stored value is an
        error (it would keep its initial value on this rank only).
        """
        where = nodes[0].key if nodes else ""
        with self.lock, paused_gc():
            failure: BaseException | None = None
            staged = Staged()
            m: Any = None
            decoded: list[tuple[str, Any, Any]] = []
            try:
                m = self._match(nodes)
                self._check_all_matched(nodes, {id(obj) for _, _, obj in m.variables})
                decoded = [(k, t, decode_state(self.states[k], k, self.path,
                                               self.tuples.get(k)))
                           for k, t in m.states]
                staged = stage_reads(self.reader, restore_pairs(
                    (k, t) for k, t, _ in m.variables), self.path, verify=self.verify,
                    cast=self.cast)
            except BaseException as exc:  # noqa: BLE001 - reported through the vote
                failure = exc
            self.coordinator.vote(failure, tag=f"restore:{os.path.basename(str(self.path))}:{where}",
                                  timeout=self.timeout)
            staged.apply(self.path)
            self._settle(m, decoded)

    def _check_all_matched(self, nodes: list[Node], matched: set[int]) -> None:
        root = self._root() if self._root is not None else None
        missing = []
        for node in nodes:
            obj = node.obj
            if (isinstance(obj, Variable | PartitionedVariable) and id(obj) not in matched
                    and not self._own_counter(node, root)):
                missing.append(f"{node.key!r} (variable {obj.name!r})")
        if missing:
            raise MissingValueError(
                f"{str(self.path)!r} has no value for {', '.join(dict.fromkeys(missing))}."
            )
