"""The subjects: one adapter per way of storing tensors, all with the same verbs.

Each module imports its library only when its adapter is built, so this registry
imports nothing heavy; a job names its subject by the keys of ``SUBJECT_CLASSES``.
"""

from __future__ import annotations

from benchmarks.subjects.base import Subject
from benchmarks.subjects.ckptvar import CkptVar
from benchmarks.subjects.h5py import H5py
from benchmarks.subjects.npz import Npz
from benchmarks.subjects.raw import Raw
from benchmarks.subjects.safetensors import Safetensors
from benchmarks.subjects.tf import TF
from benchmarks.subjects.torch import Torch
from benchmarks.subjects.zarr import Zarr

SUBJECT_CLASSES: dict[str, type[Subject]] = {
    "raw": Raw,
    "safetensors": Safetensors,
    "torch": Torch,
    "npz": Npz,
    "h5py": H5py,
    "zarr": Zarr,
    "tf": TF,
    "ckptvar": CkptVar,
}

__all__ = ["SUBJECT_CLASSES", "CkptVar", "Subject"]
