"""NumPy's own ``np.savez`` / ``np.load``."""

from __future__ import annotations

import numpy as np

from benchmarks.subjects.base import Subject


class Npz(Subject):
    name = "npz"
    suffix = ".npz"

    def save(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        np.savez(path, **arrays)

    def load(self, path: str) -> dict[str, np.ndarray]:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}

    def read_one(self, path: str, key: str) -> np.ndarray:
        with np.load(path) as z:
            return z[key]
