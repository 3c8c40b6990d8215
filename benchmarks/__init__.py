"""ckptvar's side-by-side checkpoint benchmark (run it with ``python scripts/bench.py``).

Driver side: ``cli`` (arguments, the run), ``plan`` (subjects and their operations),
``harness`` (one fresh process per measurement), ``results`` (rows), ``report``
(tables, JSON, chart) and ``goals``. Measurement side, run by
``scripts/_bench_worker.py`` in a fresh process: ``worker`` (jobs in, results out),
``ops`` (one function per operation, a dispatch table), ``measure`` (page cache,
memory, the clock), ``workloads`` (the tensors) and ``subjects`` (one adapter per
library). Only the public API of ckptvar is used; nothing here is imported at package
import, so the measurement side also runs under an interpreter without ckptvar.
"""
