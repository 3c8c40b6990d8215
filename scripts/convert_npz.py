#!/usr/bin/env python
"""Convert a NumPy .npz archive to a ckptvar checkpoint (.h5, .zarr) or to .safetensors.

Object arrays are refused (loading them would run pickle code).

    python scripts/convert_npz.py weights.npz weights.h5

A thin front over ``ckpt convert`` (see ``_convert.py``), which
converts every format and adds ``--rename``, ``--filter`` and a progress bar.
"""

from __future__ import annotations

import sys

from _convert import run


def main(argv: list[str] | None = None) -> int:
    return run(__doc__, fmt="npz", kind="an .npz archive",
               src_help="the .npz file", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
