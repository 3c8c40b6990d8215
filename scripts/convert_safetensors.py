#!/usr/bin/env python
"""Convert a .safetensors file to a ckptvar checkpoint (.h5, .zarr) or to .npz.

The header (sizes, offsets, overlaps, dtypes) is validated before anything is read.

    python scripts/convert_safetensors.py model.safetensors model.zarr

A thin front over ``ckpt convert`` (see ``_convert.py``), which
converts every format and adds ``--rename``, ``--filter`` and a progress bar.
"""

from __future__ import annotations

import sys

from _convert import run


def main(argv: list[str] | None = None) -> int:
    return run(__doc__, fmt="safetensors", kind="a safetensors file",
               src_help="the .safetensors file", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
