"""Plain h5py: one dataset per tensor."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.subjects.base import Subject


class H5py(Subject):
    """Plain h5py, one dataset per tensor (groups follow the key's ``/``)."""

    name = "h5py"
    suffix = ".h5"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import h5py

        self.h5py = h5py

    def save(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        with self.h5py.File(path, "w") as f:
            for k, a in arrays.items():
                f.create_dataset(k, data=a)

    def _datasets(self, f: Any) -> list[tuple[str, Any]]:
        found: list[tuple[str, Any]] = []
        f.visititems(lambda n, o: found.append((n, o)) if isinstance(o, self.h5py.Dataset)
                     else None)
        return found

    def load(self, path: str) -> dict[str, np.ndarray]:
        with self.h5py.File(path, "r") as f:
            return {k: ds[()] for k, ds in self._datasets(f)}

    def restore(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        with self.h5py.File(path, "r") as f:
            for k, ds in self._datasets(f):
                ds.read_direct(arrays[k])

    def read_one(self, path: str, key: str) -> np.ndarray:
        with self.h5py.File(path, "r") as f:
            return f[key][()]
