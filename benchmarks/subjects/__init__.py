"""The subjects: one adapter per way of storing tensors, all with the same verbs.

One private module per peer (``_torch.py``, never ``torch.py``, so that no name shadows
the library it measures).

Each module imports its library only when its adapter is built, so this registry
imports nothing heavy; a job names its subject by the keys of ``SUBJECT_CLASSES``.
"""

from __future__ import annotations

from benchmarks.subjects._ckptvar import CkptVar, Model, cv_segment, materialize
from benchmarks.subjects._frameworks import CkptVarTorch, SafetensorsTorch
from benchmarks.subjects._h5py import H5py
from benchmarks.subjects._npz import Npz
from benchmarks.subjects._raw import Raw
from benchmarks.subjects._safetensors import Safetensors
from benchmarks.subjects._tf import TF
from benchmarks.subjects._torch import Torch
from benchmarks.subjects._zarr import Zarr
from benchmarks.subjects.base import Subject

SUBJECT_CLASSES: dict[str, type[Subject]] = {
    "raw": Raw,
    "safetensors": Safetensors,
    "torch": Torch,
    "npz": Npz,
    "h5py": H5py,
    "zarr": Zarr,
    "tf": TF,
    "ckptvar": CkptVar,
    "ckptvar_torch": CkptVarTorch,
    "safetensors_torch": SafetensorsTorch,
}

__all__ = ["SUBJECT_CLASSES", "CkptVar", "Model", "Subject", "cv_segment", "materialize"]
