"""``python -m ckptvar.cli`` runs the ``ckpt`` command."""

from __future__ import annotations

import sys

from ckptvar.cli import main

if __name__ == "__main__":
    sys.exit(main())
