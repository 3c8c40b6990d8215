"""The second performance round's rows: variable counts, open-one-of-100k, framework arrays.

Three workloads, each run after the others with the subjects interleaved (for every
repeat, every subject in turn), because the machine is shared and its load drifts:

- ``counts``: 1,000 / 10,000 / 100,000 tiny float32 tensors (16-256 elements, so the
  bytes are few and the per-variable cost shows): save, load, restore; reported as the
  cost per variable above the raw file at each count (rows ``count<N>``);
- ``open``: open the 100,000-variable checkpoint and read one value (the middle key),
  warm and cold, against safetensors' ``safe_open`` + one ``get_tensor`` (row ``open100k``);
- ``frameworks``: a dict of PyTorch tensors (blocks 0-5 of the model, ~290 MiB): ckptvar's
  ``cv.save`` of the tensors themselves and ``cv.load(like="torch")``, against
  ``torch.save``/``torch.load`` and ``safetensors.torch.save_file``/``load_file``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.measure import check_arrays, prepare_cache, timed
from benchmarks.results import find
from benchmarks.workloads import Spec, model_spec

if TYPE_CHECKING:
    from benchmarks.ops import Job, Timing
    from benchmarks.plan import SubjectDef
    from benchmarks.results import Row

WORKLOADS = ("counts", "open", "frameworks")
FULL_COUNTS = (1_000, 10_000, 100_000)
QUICK_COUNTS = (50, 100, 200)

#: Which subjects run which of these workloads (labels of plan.subject_defs).
COUNT_SUBJECTS = ("raw", "raw+fsync", "ckptvar-h5", "ckptvar-h5 nd", "ckptvar-zarr",
                  "ckptvar-zarr nd", "safetensors")
OPEN_SUBJECTS = ("raw", "ckptvar-h5", "ckptvar-zarr", "safetensors")
FRAMEWORK_SUBJECTS = ("raw", "torch", "safetensors torch", "ckptvar-h5 torch nd",
                      "ckptvar-zarr torch nd")


def count_spec(count: int) -> Spec:
    """``count`` float32 tensors of 16-256 elements (~544 B each on average)."""
    sizes = np.random.default_rng(4321).integers(16, 257, size=count)
    return [(f"blocks/{i // 100}/v{i % 100}", (int(n),)) for i, n in enumerate(sizes)]


def framework_spec(quick: bool) -> Spec:
    """The model's first six blocks and its small tensors (~290 MiB; ~0.2 MiB quick)."""
    return [(k, s) for k, s in model_spec(quick)
            if not k.startswith(("wte", "lm_head")) and not
            (k.startswith("h/") and int(k.split("/")[1]) >= 6)]


def spec_for(job: dict[str, Any]) -> Spec | None:
    """The spec of a job of these workloads, or None for another workload."""
    wl = job["workload"]
    if wl in ("counts", "open"):
        return count_spec(job["count"])
    if wl == "frameworks":
        return framework_spec(job["quick"])
    return None


def ops_for(sd: SubjectDef, workload: str) -> list[str]:
    """The operations ``sd`` runs in ``workload`` (one of :data:`WORKLOADS`)."""
    if workload == "counts" and sd.label in COUNT_SUBJECTS:
        if sd.save_only:
            return ["save"]
        return ["save", "load_warm"] + (["restore_warm"] if sd.restore else [])
    if workload == "open" and sd.label in OPEN_SUBJECTS:
        return ["open_one_warm", "open_one_cold"]
    if workload == "frameworks" and sd.label in FRAMEWORK_SUBJECTS:
        return ["save", "load_warm"]
    return []


def op_open_one(job: Job) -> Timing:
    """Open the checkpoint and read one value (the middle one), warm or cold."""
    key, shape = job.spec[len(job.spec) // 2]
    prepare_cache(job.path, job.op == "open_one_cold", 1 << 24, job.out)
    t, peak, got = timed(lambda: job.subject.read_one(job.path, key), job.peak_ok)
    check_arrays({key: got}, [(key, shape)], job.quick)
    return t, peak


OPS: dict[str, Callable[[Job], Timing | None]] = {
    "open_one_warm": op_open_one,
    "open_one_cold": op_open_one,
}

Measure = Callable[..., "Row"]
Setup = Callable[..., bool]


def run(defs: list[SubjectDef], workloads: list[str], *, quick: bool, repeats: int,  # noqa: PLR0913
        data: Path, suffix: Callable[[SubjectDef], str], measure: Measure, setup: Setup,
        rm: Callable[[Path], None]) -> None:
    """Measure these workloads, subjects interleaved within each repeat."""
    counts = QUICK_COUNTS if quick else FULL_COUNTS
    if "counts" in workloads or "open" in workloads:
        for n in counts:
            paths = {sd.label: data / f"count{n}-{_slug(sd.label)}{suffix(sd)}" for sd in defs}
            if "counts" in workloads:
                sel = [sd for sd in defs if ops_for(sd, "counts")]
                _interleaved(sel, "counts", f"count{n}", paths, repeats, measure, {"count": n})
            if "open" in workloads and n == counts[-1]:
                ready = [sd for sd in defs if ops_for(sd, "open") and (
                    paths[sd.label].exists() or setup(sd, "counts", paths[sd.label], count=n))]
                name = f"open{n // 1000}k" if n >= 1000 else f"open{n}"
                _interleaved(ready, "open", name, paths, repeats, measure, {"count": n})
            for p in paths.values():
                rm(p)
    if "frameworks" in workloads:
        fsel = [sd for sd in defs if ops_for(sd, "frameworks")]
        paths = {sd.label: data / f"fw-{_slug(sd.label)}{suffix(sd)}" for sd in fsel}
        _interleaved(fsel, "frameworks", "frameworks", paths, repeats, measure, {})
        for p in paths.values():
            rm(p)


def _interleaved(sel: list[SubjectDef], workload: str, row_name: str, paths: dict[str, Path],  # noqa: PLR0913, PLR0917 - the loop's whole context
                 repeats: int, measure: Measure, extra: dict[str, Any]) -> None:
    """``repeats`` rounds; in each, every subject's operations once (rows merged later)."""
    for _ in range(repeats):
        for sd in sel:
            for op in ops_for(sd, workload):
                row = measure(sd, workload, op, paths[sd.label], 1, extra)
                row.workload = row_name


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label)


def merge(rows: list[Row]) -> list[Row]:
    """One row per (workload, op, subject): interleaved single measurements joined."""
    out: dict[tuple[str, str, str], Row] = {}
    for r in rows:
        k = (r.workload, r.op, r.subject)
        if k not in out:
            out[k] = r
            continue
        m = out[k]
        m.times += r.times
        m.peaks += r.peaks
        m.anon += r.anon
        m.errors += r.errors
        for name, vals in r.extra.items():
            m.extra.setdefault(name, []).extend(vals)
        m.nbytes, m.count = m.nbytes or r.nbytes, m.count or r.count
        m.disk_bytes = m.disk_bytes or r.disk_bytes
        m.profile = m.profile or r.profile
    return list(out.values())


def tables(rows: list[Row]) -> list[str]:
    """Markdown: µs per variable above raw at each count, open-one at 100k, frameworks."""
    return [*_count_table(rows), *_open_tables(rows), *_framework_table(rows)]


def _us(rows: list[Row], wl: str, op: str, subj: str) -> str:
    r, raw = find(rows, wl, op, subj), find(rows, wl, op, "raw")
    if op == "save" and subj.startswith("ckptvar") and not subj.endswith(" nd"):
        raw = find(rows, wl, op, "raw+fsync") or raw
    if r is None or raw is None or not r.count:
        return "—"
    return f"{(r.stat('median') / r.count - raw.stat('median') / raw.count) * 1e6:,.1f}"


def _count_table(rows: list[Row]) -> list[str]:
    # count1000, count10000, ... (rows of the "counts" workload itself are not counts)
    cwl = sorted({r.workload for r in rows if r.workload[5:].isdigit()
                  and r.workload.startswith("count")}, key=lambda w: int(w[5:]))
    subs = [s for s in COUNT_SUBJECTS if s not in ("raw", "raw+fsync")
            and any(r.subject == s for r in rows if r.workload in cwl)]
    if not cwl:
        return []
    out = ["## Cost per variable above the raw file, by count (µs; durable saves "
           "compare with raw+fsync)", "",
           "| count | op | raw (µs/var) | " + " | ".join(subs) + " |",
           "|---" * (len(subs) + 3) + "|"]
    for wl in cwl:
        for op in ("save", "load_warm", "restore_warm"):
            raw = find(rows, wl, op, "raw")
            if raw is not None:
                out.append(f"| {int(wl[5:]):,} | {op} | "
                           f"{raw.stat('median') / raw.count * 1e6:,.1f} | "
                           + " | ".join(_us(rows, wl, op, s) for s in subs) + " |")
    return [*out, ""]


def _ms(r: Row | None, base: Row | None = None) -> str:
    if r is None:
        return "—"
    t = f"{r.stat('median') * 1e3:,.1f} ms"
    return t if base is None else f"{t} ({r.stat('median') / base.stat('median'):.2f}×)"


def _open_tables(rows: list[Row]) -> list[str]:
    out: list[str] = []
    ops = ("open_one_warm", "open_one_cold")
    # open1k, open100k, ... (rows of the "open" workload itself name no count)
    for wl in [w for w in dict.fromkeys(r.workload for r in rows)
               if w.startswith("open") and w[4:]]:
        out += [f"## Open a {wl[4:]}-variable checkpoint and read one value "
                "(× safetensors)", "", "| subject | warm | cold |", "|---|---|---|"]
        st = [find(rows, wl, op, "safetensors") for op in ops]
        for s in OPEN_SUBJECTS:
            cells = [find(rows, wl, op, s) for op in ops]
            if any(cells):
                out.append(f"| {s} | " + " | ".join(_ms(c, b) for c, b in zip(
                    cells, st, strict=True)) + " |")
        out.append("")
    return out


def _framework_table(rows: list[Row]) -> list[str]:
    if not any(r.workload == "frameworks" for r in rows):
        return []
    out = ["## Framework arrays: a dict of PyTorch tensors (× raw; no subject fsyncs)", "",
           "| subject | save | load |", "|---|---|---|"]
    raws = [find(rows, "frameworks", op, "raw") for op in ("save", "load_warm")]
    for s in FRAMEWORK_SUBJECTS:
        cells = [find(rows, "frameworks", op, s) for op in ("save", "load_warm")]
        out.append(f"| {s} | " + " | ".join(_ms(c, b) for c, b in zip(cells, raws, strict=True))
                   + " |")
    return [*out, ""]
