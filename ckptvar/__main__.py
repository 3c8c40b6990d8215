"""``python -m ckptvar`` runs the ``ckpt`` command (see :mod:`ckptvar.cli`)."""

from __future__ import annotations

import sys

from ckptvar.cli import main

if __name__ == "__main__":
    sys.exit(main())
