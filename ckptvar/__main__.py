"""``python -m ckptvar`` runs the ``ckpt`` command (see :mod:`ckptvar.cli`)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    try:  # Ctrl-C while the command's modules load: said, like one later (exit 130)
        from ckptvar.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("ckpt: error: interrupted\n")
        sys.exit(130)
    sys.exit(main())
