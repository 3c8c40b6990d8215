"""One benchmark measurement process, started by ``scripts/bench.py`` (see ``benchmarks.worker``).

``_bench_worker.py JOB_JSON`` runs one job; ``_bench_worker.py --serve SUBJECT`` is a
fork server. It puts the repository on ``sys.path`` itself, so that any interpreter
(e.g. a separate venv holding TensorFlow) can run it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.worker import main  # noqa: E402 - after the path is set

if __name__ == "__main__":
    raise SystemExit(main())
