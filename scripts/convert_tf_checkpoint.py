#!/usr/bin/env python
"""Convert a TensorFlow checkpoint (PREFIX.index + .data-*) to .h5/.zarr, .safetensors or .npz.

Needs no TensorFlow: the TensorBundle is parsed by ckptvar and every tensor's crc32c is
checked. Object-based keys lose their ``/.ATTRIBUTES/VARIABLE_VALUE`` suffix
(``model/dense/kernel``); partitioned variables come back whole.

    python scripts/convert_tf_checkpoint.py runs/tf/ckpt-1 model.h5

A thin front over ``ckpt convert`` (see ``_convert.py``), which
converts every format and adds ``--rename``, ``--filter`` and a progress bar.
"""

from __future__ import annotations

import sys

from _convert import run


def main(argv: list[str] | None = None) -> int:
    return run(__doc__, fmt="tf", kind="a TensorFlow checkpoint",
               src_help="the prefix (ckpt-1 for ckpt-1.index)", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
