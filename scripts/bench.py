#!/usr/bin/env python
"""Side-by-side checkpoint benchmark: ckptvar against the raw-file limit and every peer.

Each measurement runs in a fresh process (``scripts/_bench_worker.py``, forked from a
server per subject that has imported its library, or with ``--spawn`` a new
interpreter); each row is the median of ``--repeats`` measurements. Prints markdown
tables (times, ratios to the raw file and to the best peer, peak RSS growth), writes
JSON and, when matplotlib is installed, a PNG chart. Uses ckptvar's public API only.

Workloads (``--only``): ``big`` (~1 GiB in 149 float32 tensors: save, load warm/cold,
restore into existing arrays), ``small`` (20,000 tensors of 64-4096 elements),
``lazy`` (one 16 MiB tensor out of the 1 GiB checkpoint), ``init`` (restore as
initialization vs build-then-restore), ``bgsave`` (time blocked by a background save),
``verify`` (checksums on vs off), ``gpu`` (needs CuPy and a CUDA device); with their
own run and report, only when named: ``cloud`` (an S3 server: :mod:`benchmarks.cloud`)
and ``incremental`` (incremental against full steps: :mod:`benchmarks.incremental`).

Examples::

    python scripts/bench.py --quick                      # seconds; a test runs it
    python scripts/bench.py                              # full run, a few minutes
    python scripts/bench.py --only small --subjects raw,ckptvar-h5,h5py --repeats 1
    python scripts/bench.py --tf-python /work/bench-tf-venv/bin/python --png docs/benchmarks.png
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cli import main, parse_args  # noqa: E402 - after the path is set
from benchmarks.harness import Runner  # noqa: E402

__all__ = ["Runner", "main", "parse_args"]

if __name__ == "__main__":
    raise SystemExit(main())
