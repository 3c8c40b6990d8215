#!/usr/bin/env python
"""Convert Keras weights (.weights.h5, legacy Keras HDF5) to .h5/.zarr, .safetensors or .npz.

Needs no Keras or TensorFlow; keys are the layer/weight paths stored in the file.

    python scripts/convert_keras.py model.weights.h5 model.h5

Thin over the public API (``cv.open`` + ``cv.save``, see ``_convert.py``); ``ckpt convert``
does the same for every format and adds ``--rename``, ``--filter`` and a progress bar.
"""

from __future__ import annotations

import sys

from _convert import run


def main(argv: list[str] | None = None) -> int:
    return run(__doc__, fmt="keras", kind="a Keras weights file",
               src_help="the .weights.h5 (or legacy Keras .h5) file", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
