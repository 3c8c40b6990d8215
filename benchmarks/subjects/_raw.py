"""The raw-file limit: one file, a JSON index, one ``write()``/``readinto()`` per tensor."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from benchmarks.measure import sync_dir
from benchmarks.subjects.base import Subject


def _raw_index(spec_arrays: dict[str, np.ndarray]) -> bytes:
    index, off = {}, 0
    for k, a in spec_arrays.items():
        index[k] = [a.dtype.str, list(a.shape), off]
        off += a.nbytes
    body = json.dumps(index).encode()
    return len(body).to_bytes(8, "little") + body


class Raw(Subject):
    """The limit: one file, a JSON index, one write() per tensor / readinto() per tensor."""

    name = "raw"
    suffix = ".raw"

    def save(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        with open(path, "wb", buffering=0) as f:
            f.write(_raw_index(arrays))
            for a in arrays.values():
                f.write(memoryview(a).cast("B"))
            if self.options.get("fsync"):
                os.fsync(f.fileno())
        if self.options.get("fsync"):
            sync_dir(path)

    @staticmethod
    def _index(f: Any) -> tuple[dict[str, Any], int]:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n

    def _each(self, path: str) -> Iterator[tuple[str, np.ndarray]]:
        """Each tensor in file order, read with one ``readinto`` into a fresh array."""
        with open(path, "rb", buffering=0) as f:
            index, _ = self._index(f)
            for k, (dt, shape, _off) in index.items():
                a = np.empty(shape, dt)
                f.readinto(memoryview(a).cast("B"))
                yield k, a

    def load(self, path: str) -> dict[str, np.ndarray]:
        return dict(self._each(path))

    def restore(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        with open(path, "rb", buffering=0) as f:
            index, _ = self._index(f)
            for k in index:
                f.readinto(memoryview(arrays[k]).cast("B"))

    def load_gpu(self, path: str) -> dict[str, Any]:
        """Read a tensor into host memory, copy it to the device, then the next."""
        import cupy as cp

        out = {k: cp.asarray(a, blocking=True) for k, a in self._each(path)}
        cp.cuda.runtime.deviceSynchronize()
        return out

    def read_one(self, path: str, key: str) -> np.ndarray:
        with open(path, "rb", buffering=0) as f:
            index, base = self._index(f)
            dt, shape, off = index[key]
            a = np.empty(shape, dt)
            f.seek(base + off)
            f.readinto(memoryview(a).cast("B"))
        return a
