"""``from_env()``: the coordinator for the engine this process runs under."""

from __future__ import annotations

import os
import sys

from ._coordinator import DEFAULT_TIMEOUT, Coordinator, SingleProcessCoordinator

__all__ = ["MPI_ENV_VARS", "from_env"]

#: Variables an MPI launcher sets in each process it starts (MPICH/Hydra, Open MPI,
#: PMIx launchers, MVAPICH).
MPI_ENV_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def _mpi_initialized() -> bool:
    mpi_mod = sys.modules.get("mpi4py.MPI")
    return mpi_mod is not None and bool(mpi_mod.Is_initialized()) and not mpi_mod.Is_finalized()


def _torch_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _jax_initialized() -> bool:
    if "jax" not in sys.modules:
        return False
    from ._jax import jax_client

    return jax_client() is not None


def from_env(*, timeout: float = DEFAULT_TIMEOUT) -> Coordinator:
    """The coordinator for this process's engine, in this order:

    1. MPI, when mpi4py has already initialised MPI;
    2. torch.distributed, when its default process group is initialised;
    3. jax.distributed, when ``jax.distributed.initialize`` has run;
    4. MPI, when an MPI launcher started this process (``PMI_RANK``,
       ``OMPI_COMM_WORLD_RANK``, ... are set; see :data:`MPI_ENV_VARS`);
    5. otherwise one process (:class:`SingleProcessCoordinator`).

    ``timeout`` is the default for every collective of the returned coordinator.
    Every process of a job must call it (creating an MPI coordinator is collective).
    """
    if _mpi_initialized():
        from ._mpi import MPICoordinator

        return MPICoordinator(timeout=timeout)
    if _torch_initialized():
        from ._torch import TorchCoordinator

        return TorchCoordinator(timeout=timeout)
    if _jax_initialized():
        from ._jax import JaxCoordinator

        return JaxCoordinator(timeout=timeout)
    if any(os.environ.get(name) for name in MPI_ENV_VARS):
        from ._mpi import MPICoordinator

        return MPICoordinator(timeout=timeout)
    return SingleProcessCoordinator(timeout=timeout)
