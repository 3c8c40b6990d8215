"""ckptvar in a multi-process job: coordinators and the pure planning of sharded saves.

- :class:`Coordinator` and its engines: :class:`SingleProcessCoordinator`,
  :class:`MPICoordinator` (mpi4py), :class:`TorchCoordinator` (torch.distributed),
  :class:`JaxCoordinator` (jax.distributed);
  :func:`from_env` picks one. Every collective has a tag and a timeout.
- The planner (no I/O): :class:`Box`, :class:`VariableLayout`, :func:`plan_save`,
  :func:`check_replicas`, :class:`PlanCache`, :func:`read_plan`; and
  :func:`gather_plan`, the collective that runs it on every process, and
  :func:`layout_message`, what each process sends in it.

The engine modules import mpi4py/torch only when their coordinator is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._boxes import Box, SavePlan, VariableLayout, VariablePlan, WriteItem
from ._coordinator import DEFAULT_TIMEOUT, Coordinator, SingleProcessCoordinator
from ._env import MPI_ENV_VARS, from_env
from ._gather import SupportsPlain, gather_plan
from ._plan import PlanCache, check_replicas, layout_digest, plan_save
from ._read_plan import ReadItem, read_plan
from ._wire import layout_message

if TYPE_CHECKING:
    from ._jax import JaxCoordinator
    from ._mpi import MPICoordinator
    from ._torch import TorchCoordinator

__all__ = [
    "DEFAULT_TIMEOUT",
    "MPI_ENV_VARS",
    "Box",
    "Coordinator",
    "JaxCoordinator",
    "MPICoordinator",
    "PlanCache",
    "ReadItem",
    "SavePlan",
    "SingleProcessCoordinator",
    "SupportsPlain",
    "TorchCoordinator",
    "VariableLayout",
    "VariablePlan",
    "WriteItem",
    "check_replicas",
    "from_env",
    "gather_plan",
    "layout_digest",
    "layout_message",
    "plan_save",
    "read_plan",
]


def __getattr__(name: str) -> Any:  # the engine coordinators load their engine lazily
    if name == "MPICoordinator":
        from ._mpi import MPICoordinator

        return MPICoordinator
    if name == "JaxCoordinator":
        from ._jax import JaxCoordinator

        return JaxCoordinator
    if name == "TorchCoordinator":
        from ._torch import TorchCoordinator

        return TorchCoordinator
    raise AttributeError(f"module 'ckptvar.distributed' has no attribute {name!r}")
