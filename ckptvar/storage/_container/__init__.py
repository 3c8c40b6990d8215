"""ckptvar's own checkpoint format, shared by its two containers (HDF5 and Zarr v3).

A checkpoint of this format is a container (one ``.h5`` file or one ``.zarr``
directory) holding every value's little-endian C-order bytes and a root record
(:mod:`.._record`) that says where each one is. The backends (``_h5.py``,
``_zarr.py``) only lay bytes out and find them again; what they share lives here:

- :mod:`.layout`: the packed blob, stored dtypes, byte-range checks;
- :mod:`.writer`: write planning, packing, hashing while writing, publishing;
- :mod:`.reader`: the reader base, single reads, verification, lazy slices;
- :mod:`.bulk`: windowed read-ahead, bulk verify, scatter reads into buffers;
- :mod:`.access`: the seam the reader offers its read engines (:class:`.access.ValueAccess`);
- :mod:`.transfer`: the parallel read-and-hash engine under both;
- :mod:`.blocks`: per-block checksums (format 1.2) and verified partial reads;
- :mod:`.delta`: row deltas (format 1.5): when a value is stored as its base plus a
  row patch, the patch's bytes, and reading patches back.
"""

from __future__ import annotations

from .layout import (
    ALIGN,
    DEFAULT_PACK_THRESHOLD,
    PACKED_PATH,
    PLAIN_DTYPES,
    PLAIN_MAX_VALUES,
    Source,
    ValueRanges,
    check_regions,
    pack_limit,
    storage_dtype,
)
from .reader import ContainerLazyArray, ContainerReader
from .writer import (
    ContainerWriter,
    ValueWrite,
    WritePlan,
    delta_attrs,
    hash_while_writing,
    scalar_attrs,
    write_hashing,
    write_packed,
)

__all__ = [
    "ALIGN",
    "DEFAULT_PACK_THRESHOLD",
    "PACKED_PATH",
    "PLAIN_DTYPES",
    "PLAIN_MAX_VALUES",
    "ContainerLazyArray",
    "ContainerReader",
    "ContainerWriter",
    "Source",
    "ValueRanges",
    "ValueWrite",
    "WritePlan",
    "check_regions",
    "delta_attrs",
    "hash_while_writing",
    "pack_limit",
    "scalar_attrs",
    "storage_dtype",
    "write_hashing",
    "write_packed",
]
