"""The adapter every subject implements: the verbs a measurement times."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.workloads import Spec, make_arrays


class Subject:
    """One way of storing tensors. ``save`` / ``load`` / ``read_one`` are what gets timed."""

    name = "?"
    suffix = ""
    ops: tuple[str, ...] = ()

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def prepare_save(self, spec: Spec) -> Any:
        """The object ``save`` takes, holding the workload's values (built, not timed)."""
        return make_arrays(spec)

    def save(self, path: str, prepared: Any) -> Any:
        raise NotImplementedError

    def load(self, path: str) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def prepare_restore(self, spec: Spec) -> Any:
        """Existing arrays of the right shapes for ``restore`` to overwrite (all ones)."""
        return {k: np.ones(shape, np.float32) for k, shape in spec}

    def restore(self, path: str, prepared: Any) -> Any:
        raise NotImplementedError

    def restored_arrays(self, prepared: Any) -> dict[str, np.ndarray]:
        return prepared

    def read_one(self, path: str, key: str) -> np.ndarray:
        raise NotImplementedError

    def load_gpu(self, path: str) -> dict[str, Any]:
        """Every tensor on the first CUDA device, copies finished (``gpu`` workload)."""
        raise NotImplementedError(f"{self.name} has no GPU load")
