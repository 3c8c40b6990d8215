"""Framework arrays: a dict of PyTorch tensors saved and loaded as tensors.

``CkptVarTorch``: ``cv.save(path, tensors, **write_options)`` and
``cv.load(path, like="torch")``; ``SafetensorsTorch``: ``safetensors.torch.save_file`` /
``load_file``. The tensors share the NumPy inputs' memory (``torch.from_numpy``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.subjects.base import Subject
from benchmarks.workloads import Spec, make_arrays


class _TorchInputs(Subject):
    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import torch  # noqa: PLC0415 - imported when the subject is built

        self.torch = torch

    def prepare_save(self, spec: Spec) -> Any:
        return {k: self.torch.from_numpy(a) for k, a in make_arrays(spec).items()}


class CkptVarTorch(_TorchInputs):
    name = "ckptvar_torch"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import ckptvar as cv  # noqa: PLC0415 - imported when the subject is built

        self.cv = cv
        self.suffix = "." + options["format"]
        self.write_options = dict(options.get("write_options") or {})

    def save(self, path: str, tensors: Any) -> None:
        self.cv.save(path, tensors, **self.write_options)

    def load(self, path: str) -> dict[str, np.ndarray]:
        got = self.cv.load(path, like="torch")
        return {k: t.numpy() for k, t in got.items()}  # views: checked without a copy


class SafetensorsTorch(_TorchInputs):
    name = "safetensors_torch"
    suffix = ".safetensors"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import safetensors.torch as stt  # noqa: PLC0415 - imported when the subject is built

        self.st = stt

    def save(self, path: str, tensors: Any) -> None:
        self.st.save_file(tensors, path)

    def load(self, path: str) -> dict[str, np.ndarray]:
        return {k: t.numpy() for k, t in self.st.load_file(path).items()}
