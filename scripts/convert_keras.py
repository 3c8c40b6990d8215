#!/usr/bin/env python
"""Convert Keras weights (.weights.h5, legacy Keras HDF5) to .h5/.zarr, .safetensors or .npz.

Needs no Keras or TensorFlow; keys are the layer/weight paths stored in the file.

    python scripts/convert_keras.py model.weights.h5 model.h5

A thin front over ``ckpt convert`` (see ``_convert.py``), which
converts every format and adds ``--rename``, ``--filter`` and a progress bar.
"""

from __future__ import annotations

import sys

from _convert import run


def main(argv: list[str] | None = None) -> int:
    return run(__doc__, fmt="keras", kind="a Keras weights file",
               src_help="the .weights.h5 (or legacy Keras .h5) file", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
