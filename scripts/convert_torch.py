#!/usr/bin/env python
"""Convert a PyTorch state dict (.pt, .pth, .bin) to .h5/.zarr, .safetensors or .npz.

Needs no PyTorch, and never runs pickle code: only tensors, storages and plain
containers are accepted, anything else is refused.

    python scripts/convert_torch.py pytorch_model.bin model.h5 --dtype bfloat16

A thin front over ``ckpt convert`` (see ``_convert.py``), which
converts every format and adds ``--rename``, ``--filter`` and a progress bar.
"""

from __future__ import annotations

import sys

from _convert import run


def main(argv: list[str] | None = None) -> int:
    return run(__doc__, fmt="torch", kind="a PyTorch file",
               src_help="the .pt/.pth/.bin file", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
