"""A measured row (one operation of one subject), finding rows and comparing them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Row:
    workload: str
    op: str
    subject: str
    kind: str
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    extra: dict[str, list[float]] = field(default_factory=dict)
    nbytes: int = 0
    count: int = 0
    disk_bytes: int | None = None
    errors: list[str] = field(default_factory=list)
    anon: list[int] = field(default_factory=list)
    profile: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def stat(self, which: str) -> float:
        return min(self.times) if which == "min" else statistics.median(self.times)

    @property
    def peak(self) -> int | None:
        """Median growth of VmHWM (includes file pages mapped in)."""
        good = [p for p in self.peaks if p >= 0]
        return int(statistics.median(good)) if good else None

    @property
    def anon_peak(self) -> int | None:
        """Median growth of the sampled peak of RssAnon (private memory)."""
        return int(statistics.median(self.anon)) if self.anon else None

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload, "op": self.op, "subject": self.subject,
            "kind": self.kind, "median_s": self.median, "times_s": self.times,
            "peak_rss_bytes": self.peak, "peak_anon_bytes": self.anon_peak,
            "nbytes": self.nbytes, "count": self.count, "profile": self.profile,
            "disk_bytes": self.disk_bytes, "errors": self.errors,
            "extra": {k: statistics.median(v) for k, v in self.extra.items() if v},
            "extra_all": self.extra, "peaks_bytes": self.peaks, "anon_bytes": self.anon,
        }


def find(rows: list[Row], workload: str, op: str, subject: str) -> Row | None:
    for r in rows:
        if (r.workload, r.op, r.subject) == (workload, op, subject) and r.times:
            return r
    return None


def per_tensor_us(rows: list[Row], op: str, subject: str, stat: str = "median") -> float | None:
    """Cost per tensor above the raw file, in microseconds (small workload)."""
    r, raw = find(rows, "small", op, subject), find(rows, "small", op, "raw")
    if op == "save" and subject.startswith("ckptvar") and not subject.endswith(" nd"):
        raw = find(rows, "small", op, "raw+fsync") or raw
    if r is None or raw is None:
        return None
    return (r.stat(stat) / r.count - raw.stat(stat) / raw.count) * 1e6


def raw_for(rows: list[Row], r: Row) -> Row | None:
    """The raw row a subject compares with (durable ckptvar saves: raw+fsync)."""
    if r.op == "save" and r.kind == "ckptvar" and not r.subject.endswith(" nd"):
        return find(rows, r.workload, r.op, "raw+fsync") or find(rows, r.workload, r.op, "raw")
    return find(rows, r.workload, r.op, "raw")


def best_peer(rows: list[Row], workload: str, op: str) -> Row | None:
    peers = [r for r in rows if r.workload == workload and r.op == op and r.kind == "peer"
             and r.times]
    return min(peers, key=lambda r: r.median) if peers else None


def rows_from_json(data: dict[str, Any]) -> list[Row]:
    rows = []
    for d in data["rows"]:
        r = Row(d["workload"], d["op"], d["subject"], d["kind"], list(d["times_s"]),
                nbytes=d["nbytes"], count=d["count"], disk_bytes=d["disk_bytes"],
                errors=list(d["errors"]), profile=d.get("profile", ""))
        r.peaks = list(d.get("peaks_bytes") or ([d["peak_rss_bytes"]] if d["peak_rss_bytes"]
                                                is not None else []))
        r.anon = list(d.get("anon_bytes") or ([d["peak_anon_bytes"]] if d.get("peak_anon_bytes")
                                              is not None else []))
        r.extra = {k: list(v) if isinstance(v, list) else [v]
                   for k, v in (d.get("extra_all") or d.get("extra") or {}).items()}
        rows.append(r)
    return rows
