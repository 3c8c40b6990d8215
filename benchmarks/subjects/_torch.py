"""torch: ``torch.save`` of tensors sharing the NumPy inputs, ``torch.load(weights_only)``."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.subjects.base import Subject
from benchmarks.workloads import Spec, make_arrays


class Torch(Subject):
    name = "torch"
    suffix = ".pt"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import torch

        self.torch = torch

    def prepare_save(self, spec: Spec) -> Any:
        return {k: self.torch.from_numpy(a) for k, a in make_arrays(spec).items()}

    def save(self, path: str, tensors: Any) -> None:
        self.torch.save(tensors, path)

    def load(self, path: str) -> dict[str, np.ndarray]:
        sd = self.torch.load(path, map_location="cpu", weights_only=True)
        return {k: t.numpy() for k, t in sd.items()}

    def read_one(self, path: str, key: str) -> np.ndarray:
        sd = self.torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return np.array(sd[key].numpy())
