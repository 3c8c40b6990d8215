#!/usr/bin/env python
"""Convert a .safetensors file to a ckptvar checkpoint (.h5, .zarr) or to .npz.

The header (sizes, offsets, overlaps, dtypes) is validated before anything is read.

    python scripts/convert_safetensors.py model.safetensors model.zarr

Thin over the public API (``cv.open`` + ``cv.save``, see ``_convert.py``); ``ckpt convert``
does the same for every format and adds ``--rename``, ``--filter`` and a progress bar.
"""

from __future__ import annotations

import sys

from _convert import run


def main(argv: list[str] | None = None) -> int:
    return run(__doc__, fmt="safetensors", kind="a safetensors file",
               src_help="the .safetensors file", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
