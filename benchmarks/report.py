"""The report: markdown tables (stdout and ``--md``), the JSON and the PNG chart."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks import round2, round3, scale, simulate
from benchmarks.goals import all_goals, goals_table
from benchmarks.harness import LOG, say
from benchmarks.results import Row, best_peer, find, per_tensor_us, raw_for
from benchmarks.workloads import QUICK_SMALL_COUNT


def fmt_t(t: float | None) -> str:
    if t is None:
        return "—"
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} µs"


def mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:,.0f} MiB"


def fmt_x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


OP_TITLES = {
    ("big", "save"): "1 GiB model: save",
    ("big", "load_warm"): "1 GiB model: load, warm cache",
    ("big", "load_cold"): "1 GiB model: load, cold cache",
    ("big", "restore_warm"): "1 GiB model: restore into existing arrays, warm",
    ("big", "restore_cold"): "1 GiB model: restore into existing arrays, cold",
    ("gpu", "gpu_h2d"): "1 GiB host→device copy from pinned memory (the PCIe limit)",
    ("gpu", "gpu_warm"): "1 GiB model: load onto the GPU, warm cache",
    ("gpu", "gpu_cold"): "1 GiB model: load onto the GPU, cold cache",
    ("lazy", "lazy_warm"): "one 16 MiB tensor of the 1 GiB file, warm",
    ("lazy", "lazy_cold"): "one 16 MiB tensor of the 1 GiB file, cold",
    ("lazy", "lazy_warm_alone"): "the same tensor from a 1-tensor checkpoint, warm",
    ("lazy", "lazy_cold_alone"): "the same tensor from a 1-tensor checkpoint, cold",
}


def summary_table(rows: list[Row], labels: list[str]) -> list[str]:
    """The issue-style wide table: rows are operations, columns subjects, cells ratios."""
    cols = [lab for lab in labels if any(r.subject == lab and r.times for r in rows)]
    out = ["| workload | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for (wl, op), title in OP_TITLES.items():
        raw = find(rows, wl, op, "raw")
        if raw is None:
            continue
        cells = []
        for lab in cols:
            r = find(rows, wl, op, lab)
            if r is None:
                cells.append("")
            elif lab == "raw":
                cells.append(fmt_t(r.median))
            else:
                base = raw_for(rows, r)
                cells.append(fmt_x(r.median / base.median) if base else fmt_t(r.median))
        out.append(f"| {title} | " + " | ".join(cells) + " |")
    for op, title in (("save", "save"), ("load_warm", "load"),
                      ("restore_warm", "restore into existing")):
        if find(rows, "small", op, "raw") is None:
            continue
        cells = []
        for lab in cols:
            r = find(rows, "small", op, lab)
            if r is None:
                cells.append("")
            elif lab == "raw":
                cells.append(fmt_t(r.median))
            else:
                us = per_tensor_us(rows, op, lab)
                cells.append("—" if us is None else f"{us:,.0f} µs")
        n = find(rows, "small", op, "raw").count
        out.append(f"| {n:,} small tensors: {title}, raw time / cost per tensor above raw | "
                   + " | ".join(cells) + " |")
    for op, title in (("save", "peak private memory growth on save (× data)"),
                      ("load_warm", "peak private memory growth on load (× data)"),
                      ("restore_warm", "peak private memory growth on restore (× data)")):
        if find(rows, "big", op, "raw") is None:
            continue
        cells = []
        for lab in cols:
            r = find(rows, "big", op, lab)
            cells.append("" if r is None or r.anon_peak is None
                         else f"{r.anon_peak / r.nbytes:.2f}")
        out.append(f"| 1 GiB model: {title} | " + " | ".join(cells) + " |")
    return out


def detail_table(rows: list[Row], workload: str) -> list[str]:
    sel = [r for r in rows if r.workload == workload]
    if not sel:
        return []
    out = ["| op | subject | median | min – max | × raw | × best peer | peak memory growth: "
           "private / RSS (private × data) | on disk |", "|---|---|---|---|---|---|---|---|"]
    for r in sel:
        if not r.times:
            out.append(f"| {r.op} | {r.subject} | error: {r.errors[0][:120] if r.errors else '?'}"
                       " | | | | | |")
            continue
        base = raw_for(rows, r)
        bp = best_peer(rows, r.workload, r.op)
        xr = r.median / base.median if base else None
        xp = r.median / bp.median if bp else None
        peak = "—" if r.peak is None else (
            f"{mib(r.anon_peak)} / {mib(r.peak)} ({(r.anon_peak or 0) / r.nbytes:.2f}×)")
        disk = "" if r.disk_bytes is None else f"{r.disk_bytes / 2**20:,.1f} MiB"
        extra = ""
        if "total_s" in r.extra:
            extra = f" (done after {fmt_t(statistics.median(r.extra['total_s']))})"
        out.append(f"| {r.op} | {r.subject} | {fmt_t(r.median)}{extra} | "
                   f"{fmt_t(min(r.times))} – {fmt_t(max(r.times))} | {fmt_x(xr)} | {fmt_x(xp)} "
                   f"| {peak} | {disk} |")
    return out


def ckptvar_tables(rows: list[Row]) -> list[str]:
    """Restore as initialization, background save and checksums, per format."""
    fmts = [f for f in ("h5", "zarr") if any(r.subject == f"ckptvar-{f}" for r in rows)]
    copy = next((r for r in rows if r.op == "bg_copy" and r.times), None)
    out: list[str] = []

    def cell(r: Row | None, total: bool = False) -> str:
        if r is None:
            return "—"
        t = fmt_t(r.median)
        if total and "total_s" in r.extra:
            t += f" (written after {fmt_t(statistics.median(r.extra['total_s']))})"
        return t + ("" if r.anon_peak is None else f", +{mib(r.anon_peak)}")

    sections = [
        ("restore as initialization (time, peak private memory growth)",
         ["build with initializers, then restore", "restore first, then build",
          "cv.load (reference)"],
         lambda s: [find(rows, "init", "init_build_restore", s),
                    find(rows, "init", "init_restore_first", s),
                    find(rows, "big", "load_warm", s)]),
        ("background save: time the caller is blocked",
         ["one copy of the model (reference)", "blocking save (durable)",
          "save(blocking=False): blocked"],
         lambda s: [copy, find(rows, "big", "save", s), find(rows, "bgsave", "bg_background", s)]),
        ("checksums on vs off (warm cache)",
         ["cv.load, verify on", "cv.load, verify=False", "restore, verify on",
          "restore, verify=False"],
         lambda s: [find(rows, "big", "load_warm", s), find(rows, "verify", "verify_off", s),
                    find(rows, "big", "restore_warm", s),
                    find(rows, "verify", "verify_restore_off", s)]),
    ]
    for title, names, pick in sections:
        cols = {f: pick(f"ckptvar-{f}") for f in fmts}
        if not any(r is not None for c in cols.values() for r in c[1:]):
            continue
        out += [f"## ckptvar: {title}", "", "| | " + " | ".join(fmts) + " |",
                "|---" * (len(fmts) + 1) + "|"]
        for i, name in enumerate(names):
            out.append(f"| {name} | " + " | ".join(cell(cols[f][i], total=True) for f in fmts)
                       + " |")
        out.append("")
    return out


def chart(rows: list[Row], labels: list[str], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart"
    cols = [lab for lab in labels if lab != "raw" and any(r.subject == lab and r.times
                                                          for r in rows)]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5))
    big_ops = [("save", "save"), ("load_warm", "load warm"), ("load_cold", "load cold")]
    width = 0.8 / max(1, len(big_ops))
    ax = axes[0]
    for j, (op, name) in enumerate(big_ops):
        vals = []
        for lab in cols:
            r = find(rows, "big", op, lab)
            base = raw_for(rows, r) if r else None
            vals.append(r.median / base.median if r and base else 0)
        ax.bar([i + j * width for i in range(len(cols))], vals, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks([i + width for i in range(len(cols))], cols, rotation=60, ha="right")
    ax.set_ylabel("time / raw file (log)")
    ax.set_title("~1 GiB, 149 tensors")
    ax.legend()
    ax = axes[1]
    for j, (op, name) in enumerate([("save", "save"), ("load_warm", "load")]):
        vals = [max(per_tensor_us(rows, op, lab) or 0, 0.1) for lab in cols]
        ax.bar([i + j * 0.4 for i in range(len(cols))], vals, 0.4, label=name)
    ax.axhline(20, color="r", lw=0.8, ls="--", label="goal 20 µs")
    ax.set_yscale("log")
    ax.set_xticks([i + 0.2 for i in range(len(cols))], cols, rotation=60, ha="right")
    ax.set_ylabel("µs per tensor above raw (log; ≤ 0 drawn at 0.1)")
    ax.set_title("small tensors")
    ax.legend()
    ax = axes[2]
    lcols = ["raw", *cols]
    for j, (op, name) in enumerate([("lazy_warm", "warm"), ("lazy_cold", "cold")]):
        vals = []
        for lab in lcols:
            r = find(rows, "lazy", op, lab)
            vals.append(r.median * 1e3 if r else 0)
        ax.bar([i + j * 0.4 for i in range(len(lcols))], vals, 0.4, label=name)
    ax.set_xticks([i + 0.2 for i in range(len(lcols))], lcols, rotation=60, ha="right")
    ax.set_ylabel("ms")
    ax.set_title("one 16 MiB tensor out of the 1 GiB file")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def write_outputs(args: argparse.Namespace, meta: dict[str, Any], rows: list[Row]) -> None:
    """Markdown (stdout and --md), JSON (--json) and the chart (--png) for measured rows.

    The measurements are written first (JSON without goals), so a run is never lost to a
    report that fails: ``--report-from`` rebuilds the rest from that file.
    """
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(
        {"meta": meta, "rows": [r.to_json() for r in rows], "goals": [], "log": LOG}, indent=1))
    labels = meta.get("labels") or list(dict.fromkeys(r.subject for r in rows))
    gl = all_goals(rows)
    cold = [r for r in rows if "cached_before" in r.extra]
    raw_w, raw_c = find(rows, "big", "load_warm", "raw"), find(rows, "big", "load_cold", "raw")
    cold_note = ""
    if cold:
        resident = max(max(r.extra["cached_before"]) for r in cold)
        cold_note = (f"after os.sync() + posix_fadvise(DONTNEED) at most {resident:.1%} of a "
                     f"checkpoint's pages stayed in the page cache (mincore)")
        if raw_w and raw_c:
            cold_note += (f"; raw load warm {fmt_t(raw_w.median)} vs cold "
                          f"{fmt_t(raw_c.median)} ({raw_c.median / raw_w.median:.1f}×)")
    loads = [x for r in rows for x in r.extra.get("loadavg", []) if x >= 0]
    load_note = (f"1-minute load average before each measurement: median "
                 f"{statistics.median(loads):.1f}, max {max(loads):.1f} "
                 f"(on {meta['machine'].get('cpus')} CPUs)") if loads else ""
    meta = {**meta, "cold_cache": cold_note, "load": load_note}
    reps = f"medians of {meta['repeats']}"
    if meta.get("peer_repeats") and meta["peer_repeats"] != meta["repeats"]:
        reps += (f" (peers {meta['peer_repeats']}, ckptvar-only extras "
                 f"{meta.get('extra_repeats')})")
    md = [f"# ckptvar benchmark ({meta['date']})", "",
          f"Machine: {meta['machine'].get('cpu', '?')}, {meta['machine']['cpus']} CPUs, "
          f"{meta['machine'].get('mem_gib', '?')} GiB; {meta['machine']['platform']}.",
          f"Command: `{meta['command']}`; {reps}, each in a fresh process "
          + ("(a new interpreter)" if meta.get("spawn") else
             "(forked from a server that has imported the subject's library)")
          + "; "
          f"run took {meta['elapsed_s']:.0f} s.", ""]
    v = meta.get("versions") or {}
    tv = meta.get("tf_versions") or {}
    vers = [f"{k} {v[k]}" for k in ("python", "numpy", "ckptvar", "h5py", "zarr", "safetensors",
                                    "torch") if v.get(k)]
    if tv.get("tensorflow"):
        vers.append(f"tensorflow {tv['tensorflow']} (own venv)")
    md += ["Versions: " + ", ".join(vers) + ".", ""]
    if meta["quick"]:
        md += ["Quick mode: tiny sizes (the 149-tensor model holds ~1 MiB, the small workload "
               f"{QUICK_SMALL_COUNT} tensors), one repeat: this run only shows that the "
               "benchmark works; its ratios mean nothing.", ""]
    if meta["skipped"]:
        md += ["Skipped: " + "; ".join(f"{k} ({w})" for k, w in meta["skipped"].items()) + ".",
               ""]
    if meta["gpu"]:
        md += [f"GPU loading: {meta['gpu']}.", ""]
    if cold_note:
        md += [f"Cold cache: {cold_note}.", ""]
    if load_note:
        md += [f"Machine load: {load_note}.", ""]
    walls: dict[str, float] = {}
    for r in rows:
        walls[r.subject] = walls.get(r.subject, 0.0) + sum(r.extra.get("wall_s", []))
    if walls:
        runs = sum(len(r.extra.get("wall_s", [])) for r in rows)
        md += [f"Where the run's time went: wall seconds per subject over {runs} "
               "measurements, set-up included: " + ", ".join(
                   f"{k} {v:.0f}" for k, v in sorted(walls.items(), key=lambda kv: -kv[1]))
               + ".", ""]
    md += ["## Summary (× = time / raw file in this run; durable ckptvar saves compare with "
           "raw+fsync)", "", *summary_table(rows, labels), ""]
    titles = {"big": "~1 GiB model, 149 tensors", "small": "small tensors",
              "lazy": "one 16 MiB tensor", "gpu": "loading onto the GPU"}
    for wl, title in titles.items():
        t = detail_table(rows, wl)
        if t:
            md += [f"## {title}", "", *t, ""]
    md += ckptvar_tables(rows)
    md += round2.tables(rows)
    md += round3.tables(rows)
    md += scale.tables(rows)
    sim = simulate.from_rows(rows)
    if sim is not None:
        md += ["## The protocol at scale (simulated ranks, benchmarks/simulate.py)", "",
               *simulate.tables(sim), ""]
    if gl and any(g["measured"] is not None for g in gl):
        md += ["## Goals", "", *goals_table([g for g in gl if g["measured"] is not None]), ""]
    profiled = [r for r in rows if r.profile]
    if profiled:
        md += ["## Profiles (cProfile of one extra run, sorted by own time)", ""]
        for r in profiled:
            md += [f"### {r.workload} / {r.op} / {r.subject}", "", "```text",
                   r.profile.rstrip(), "```", ""]
    text = "\n".join(md)
    print(text)
    result = {"meta": meta, "rows": [r.to_json() for r in rows], "goals": gl, "log": LOG}
    for out in (args.json, args.md):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.md).write_text(text + "\n")
    if args.png:
        why = chart(rows, labels, Path(args.png))
        if why:
            say(why)
