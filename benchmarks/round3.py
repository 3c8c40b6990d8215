"""The third performance round's rows: the per-value cost of every public save/restore path.

One workload, ``paths``: 20,000 and 100,000 variables of 16 float32 each (so the bytes
are few and the per-value cost shows), saved, loaded and restored through each public
path, subjects interleaved within each repeat (the machine is shared):

- ``ckptvar-h5``: ``cv.Checkpoint(model=...).write`` / ``cv.load`` / ``Checkpoint.restore``;
- ``ckptvar-h5 saver``: ``cv.Saver(var_list=[...]).save`` / ``cv.load`` / ``Saver.restore``;
- ``ckptvar-h5 save``: ``cv.save(path, arrays)`` / ``cv.load`` (no variables to restore);

against the raw file (``raw``; durable saves against ``raw+fsync``). Rows ``paths<N>``;
the table gives µs per value above raw, the goal being ≤ 5 µs for every path and count.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.results import find
from benchmarks.workloads import Spec

if TYPE_CHECKING:
    from benchmarks.plan import SubjectDef
    from benchmarks.results import Row

WORKLOADS = ("paths",)
FULL_COUNTS = (20_000, 100_000)
QUICK_COUNTS = (200,)
#: The goal: every path's per-value cost above raw, at every count.
GOAL_US = 5.0

#: Which subjects run the workload (labels of plan.subject_defs), in table order.
PATH_SUBJECTS = ("raw", "raw+fsync", "ckptvar-h5", "ckptvar-h5 saver", "ckptvar-h5 save")
#: The subjects that exist for this workload alone.
OWN_SUBJECTS = ("ckptvar-h5 saver", "ckptvar-h5 save")
OPS = ("save", "load_warm", "restore_warm")


def path_spec(count: int) -> Spec:
    """``count`` float32 tensors of 16 elements, 1,000 to a group."""
    return [(f"p/{i // 1000}/v{i % 1000}", (16,)) for i in range(count)]


def spec_for(job: dict[str, Any]) -> Spec | None:
    """The spec of a ``paths`` job, or None for another workload."""
    return path_spec(job["count"]) if job["workload"] == "paths" else None


def ops_for(sd: SubjectDef, workload: str) -> list[str]:
    """The operations ``sd`` runs in ``workload`` (one of :data:`WORKLOADS`)."""
    if workload != "paths" or sd.label not in PATH_SUBJECTS:
        return []
    if sd.save_only:
        return ["save"]
    return ["save", "load_warm"] + (["restore_warm"] if sd.restore else [])


Measure = Callable[..., "Row"]


def run(defs: list[SubjectDef], workloads: list[str], *, quick: bool, repeats: int,  # noqa: PLR0913
        data: Path, suffix: Callable[[SubjectDef], str], measure: Measure,
        rm: Callable[[Path], None]) -> None:
    """Measure ``paths`` at each count, subjects interleaved within each repeat."""
    if "paths" not in workloads:
        return
    sel = [sd for sd in defs if ops_for(sd, "paths")]
    for n in QUICK_COUNTS if quick else FULL_COUNTS:
        paths = {sd.label: data / f"paths{n}-{_slug(sd.label)}{suffix(sd)}" for sd in sel}
        for _ in range(repeats):
            for sd in sel:
                for op in ops_for(sd, "paths"):
                    row = measure(sd, "paths", op, paths[sd.label], 1, {"count": n})
                    row.workload = f"paths{n}"
        for p in paths.values():
            rm(p)


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label)


def us_above_raw(rows: list[Row], wl: str, op: str, subj: str, stat: str = "median"
                 ) -> float | None:
    """µs per value of ``subj`` above the raw file (durable saves: above raw+fsync)."""
    r, raw = find(rows, wl, op, subj), find(rows, wl, op, "raw")
    if op == "save" and subj.startswith("ckptvar"):
        raw = find(rows, wl, op, "raw+fsync") or raw
    if r is None or raw is None or not r.count:
        return None
    return (r.stat(stat) / r.count - raw.stat(stat) / raw.count) * 1e6


def counts_of(rows: list[Row]) -> list[str]:
    """The ``paths<N>`` workloads present, by count."""
    return sorted({r.workload for r in rows if r.workload.startswith("paths")
                   and r.workload[5:].isdigit()}, key=lambda w: int(w[5:]))


def goals(rows: list[Row], stat: str = "median") -> list[tuple[str, float | None]]:
    """``(goal, µs above raw)`` for every path, operation and count measured."""
    out = []
    names = {"ckptvar-h5": "Checkpoint", "ckptvar-h5 saver": "Saver",
             "ckptvar-h5 save": "cv.save/cv.load"}
    for wl in counts_of(rows):
        for subj, name in names.items():
            for op in OPS:
                if find(rows, wl, op, subj) is None:
                    continue
                what = {"save": "save", "load_warm": "load", "restore_warm": "restore"}[op]
                out.append((f"h5 {name}: {what} of {int(wl[5:]):,} values ≤ {GOAL_US:g} "
                            "µs/value above raw", us_above_raw(rows, wl, op, subj, stat)))
    return out


def tables(rows: list[Row]) -> list[str]:
    """Markdown: µs per value above raw for each path, operation and count."""
    wls = counts_of(rows)
    subs = [s for s in PATH_SUBJECTS if s not in ("raw", "raw+fsync")
            and any(r.subject == s for r in rows if r.workload in wls)]
    if not wls:
        return []
    out = ["## Per-value cost of each public path, 16-float32 values (µs above raw; "
           "durable saves compare with raw+fsync)", "",
           "| count | op | raw (µs/value) | " + " | ".join(subs) + " |",
           "|---" * (len(subs) + 3) + "|"]
    for wl in wls:
        for op in OPS:
            raw = find(rows, wl, op, "raw")
            if raw is None:
                continue
            cells = []
            for s in subs:
                us = us_above_raw(rows, wl, op, s)
                cells.append("—" if us is None else f"{us:,.1f}")
            out.append(f"| {int(wl[5:]):,} | {op} | {raw.stat('median') / raw.count * 1e6:,.1f}"
                       " | " + " | ".join(cells) + " |")
    return [*out, ""]
