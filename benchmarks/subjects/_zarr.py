"""Plain zarr-python 3 arrays in one group."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.subjects.base import Subject


class Zarr(Subject):
    """Plain zarr-python 3: default codecs and chunks, or (``one_chunk``) raw single chunks."""

    name = "zarr"
    suffix = ".zarr"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import zarr

        self.zarr = zarr

    def save(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        g = self.zarr.open_group(path, mode="w")
        for k, a in arrays.items():
            if self.options.get("one_chunk"):
                g.create_array(k, data=a, chunks=a.shape, compressors=None)
            else:
                g.create_array(k, data=a)

    def load(self, path: str) -> dict[str, np.ndarray]:
        g = self.zarr.open_group(path, mode="r")
        members = g.members(max_depth=None)
        return {k: m[...] for k, m in members if isinstance(m, self.zarr.Array)}

    def read_one(self, path: str, key: str) -> np.ndarray:
        return self.zarr.open_array(path, path=key, mode="r")[...]
