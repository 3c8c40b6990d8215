"""Formats other tools write, read without those tools; safetensors (also sharded) and npz written.

Owns the registration of the foreign backends:

============== ================================================ ===== ================
name           files                                            write needs at run time
============== ================================================ ===== ================
tf             ``prefix.index`` + ``prefix.data-*``             no    numpy, crc32c
torch          ``.pt``, ``.pth``, ``.bin``                      no    numpy (no torch)
dcp            a folder: ``.metadata`` + ``*.distcp``           no    numpy (no torch)
orbax          a step folder (``_CHECKPOINT_METADATA``)         no    numcodecs;
                                                                      tensorstore for
                                                                      OCDBT
safetensors    ``.safetensors``                                 yes   numpy
hf-safetensors ``model.safetensors.index.json`` + shards        yes   numpy
npz            ``.npz``                                         yes   numpy
keras          ``.weights.h5``, ``.keras``, legacy              no    h5py
hdf5           any other HDF5 file (by sniffing)                no    h5py
============== ================================================ ===== ================

Every reader is a ``ckptvar.storage.Reader`` with ``skipped`` (``{key: reason}``
for user values it cannot return) and ``verify_all()``; every parser checks
sizes before allocating and raises ``CorruptCheckpointError`` for damaged or
hostile input. Shared pieces: ``_common`` (byte ranges, lazy arrays, the
mapping reader), ``_zip`` (checked zip archives), ``_json`` (JSON metadata).
h5py is imported only when an HDF5 file is opened.
docs/formats.md describes key naming and limits per format.
"""

from __future__ import annotations

from ..storage.registry import register_backend
from ._dcp import DcpBackend
from ._hf_sharded import HFShardedBackend, parse_shard_size
from ._keras import HDF5Backend, KerasBackend
from ._npz import NpzBackend
from ._orbax import OrbaxBackend
from ._safetensors import SafetensorsBackend
from ._tf_bundle import TFBackend
from ._torch import TorchBackend

__all__ = [
    "DcpBackend",
    "HDF5Backend",
    "HFShardedBackend",
    "KerasBackend",
    "NpzBackend",
    "OrbaxBackend",
    "SafetensorsBackend",
    "TFBackend",
    "TorchBackend",
    "parse_shard_size",
]

# Sniffing order is declared by each backend (``sniff_priority``), not by this loop.
for _backend in (
    TFBackend,
    TorchBackend,
    DcpBackend,
    OrbaxBackend,
    SafetensorsBackend,
    HFShardedBackend,
    NpzBackend,
    KerasBackend,
    HDF5Backend,
):
    register_backend(_backend)
