"""safetensors: ``save_file`` / ``load_file`` / ``safe_open(...).get_tensor``."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.subjects.base import Subject


class Safetensors(Subject):
    name = "safetensors"
    suffix = ".safetensors"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import safetensors.numpy as stn

        self.st = stn

    def save(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        self.st.save_file(arrays, path)

    def load(self, path: str) -> dict[str, np.ndarray]:
        return self.st.load_file(path)

    def read_one(self, path: str, key: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(path, framework="np") as f:
            return f.get_tensor(key)

    def load_gpu(self, path: str) -> dict[str, Any]:
        """``safe_open(..., device="cuda:0")`` through torch (safetensors' GPU path)."""
        import torch
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cuda:0") as f:
            out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        torch.cuda.synchronize()
        return out
