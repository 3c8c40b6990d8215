"""Old name of :mod:`ckptvar.storage.formats` (kept so existing imports keep working)."""

from __future__ import annotations

from ..formats import (
    HDF5Backend,
    KerasBackend,
    NpzBackend,
    SafetensorsBackend,
    TFBackend,
    TorchBackend,
)

__all__ = [
    "HDF5Backend",
    "KerasBackend",
    "NpzBackend",
    "SafetensorsBackend",
    "TFBackend",
    "TorchBackend",
]
