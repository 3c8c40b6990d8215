"""The performance goals: each one's target and the ratio this run measured."""

from __future__ import annotations

from typing import Any

from benchmarks import round3
from benchmarks.results import Row, find, per_tensor_us


def goals(rows: list[Row], stat: str = "median") -> list[dict[str, Any]]:
    """Every measurable goal of the issue with its measured ratio (of medians, or minima)."""
    out: list[dict[str, Any]] = []

    def add(goal: str, target: float, measured: float | None, le: bool = True,
            note: str = "") -> None:
        met = None if measured is None else (measured <= target if le else measured >= target)
        out.append({"goal": goal, "target": target, "measured": measured, "met": met,
                    "note": note})

    def ratio(wl: str, op: str, subj: str, base_subj: str = "raw") -> float | None:
        r, b = find(rows, wl, op, subj), find(rows, wl, op, base_subj)
        return r.stat(stat) / b.stat(stat) if r and b else None

    for fmt in ("h5", "zarr"):
        s = f"ckptvar-{fmt}"
        add(f"{fmt}: 1 GiB save (durable) ≤ 1.0× raw+fsync", 1.0, ratio("big", "save", s,
                                                                         "raw+fsync"))
        if find(rows, "big", "save", s + " nd"):
            add(f"{fmt}: 1 GiB save (durable=False) ≤ 1.0× raw", 1.0,
                ratio("big", "save", s + " nd"))
        # savers that do not fsync compare with ckptvar's durable=False variant when measured
        plain = s + " nd" if find(rows, "big", "save", s + " nd") else s
        add(f"{fmt}: 1 GiB save{' (durable=False)' if plain != s else ''} ≤ 1.0× safetensors",
            1.0, ratio("big", "save", plain, "safetensors"))
        add(f"{fmt}: 1 GiB load warm ≤ 1.5× raw", 1.5, ratio("big", "load_warm", s))
        add(f"{fmt}: 1 GiB load cold ≤ 1.15× raw", 1.15, ratio("big", "load_cold", s))
        add(f"{fmt}: 1 GiB restore warm ≤ 1.5× raw", 1.5, ratio("big", "restore_warm", s))
        add(f"{fmt}: 1 GiB restore cold ≤ 1.15× raw", 1.15, ratio("big", "restore_cold", s))
        add(f"{fmt}: small save ≤ 20 µs/tensor above raw", 20,
            per_tensor_us(rows, "save", s, stat))
        add(f"{fmt}: small load ≤ 20 µs/tensor above raw", 20,
            per_tensor_us(rows, "load_warm", s, stat))
        add(f"{fmt}: 16 MiB lazy warm ≤ 2.5× raw", 2.5, ratio("lazy", "lazy_warm", s))
        add(f"{fmt}: 16 MiB lazy cold ≤ 1.2× raw", 1.2, ratio("lazy", "lazy_cold", s))
        a, b = find(rows, "lazy", "lazy_warm", s), find(rows, "lazy", "lazy_warm_alone", s)
        add(f"{fmt}: lazy read independent of checkpoint size (1 GiB file / 1-tensor file, warm)",
            1.25, a.stat(stat) / b.stat(stat) if a and b else None)
        r = find(rows, "big", "save", s)
        add(f"{fmt}: peak extra memory on save ≤ 0.05× model", 0.05,
            r.anon_peak / r.nbytes if r and r.anon_peak is not None else None)
        r = find(rows, "big", "load_warm", s)
        add(f"{fmt}: peak memory on load ≤ 1.05× data", 1.05,
            r.anon_peak / r.nbytes if r and r.anon_peak is not None else None)
        r = find(rows, "big", "restore_warm", s)
        add(f"{fmt}: restore writes into the variables (peak ≤ 0.05× model)", 0.05,
            r.anon_peak / r.nbytes if r and r.anon_peak is not None else None)
        for op, what in (("save", "save"), ("load_warm", "load")):
            mine = plain if op == "save" else s
            tf, me = find(rows, "big", op, "tf"), find(rows, "big", op, mine)
            add(f"{fmt}: 1 GiB {what}{' (durable=False)' if mine != s else ''} ≥ 2× faster "
                "than tf.train.Checkpoint", 2.0,
                tf.stat(stat) / me.stat(stat) if tf and me else None, le=False)
            if op == "save" and mine != s:
                me = find(rows, "big", op, s)
                add(f"{fmt}: 1 GiB save (durable) ≥ 2× faster than tf.train.Checkpoint "
                    "(informative)", 2.0,
                    tf.stat(stat) / me.stat(stat) if tf and me else None, le=False)
            tf, me = find(rows, "small", op, "tf"), find(rows, "small", op, s)
            add(f"{fmt}: small {what} ≥ 20× faster than tf.train.Checkpoint", 20.0,
                (tf.stat(stat) / tf.count) / (me.stat(stat) / me.count) if tf and me else None,
                le=False, note="per tensor (tf runs on fewer tensors)")
        for wl in ("big", "small"):
            tf, me = find(rows, wl, "restore_warm", "tf"), find(rows, wl, "restore_warm", s)
            add(f"{fmt}: {'1 GiB' if wl == 'big' else 'small'} restore ≥ "
                f"{2 if wl == 'big' else 20}× faster than tf.train.Checkpoint.read",
                2.0 if wl == "big" else 20.0,
                (tf.stat(stat) / tf.count) / (me.stat(stat) / me.count) if tf and me else None,
                le=False, note="per tensor")
        a, b = find(rows, "init", "init_restore_first", s), find(rows, "big", "load_warm", s)
        add(f"{fmt}: restore-as-initialization ≤ 1.0× cv.load", 1.0,
            a.stat(stat) / b.stat(stat) if a and b else None)
        a, b = find(rows, "init", "init_restore_first", s), find(rows, "init",
                                                                   "init_build_restore", s)
        add(f"{fmt}: restore-as-initialization vs build-then-restore (informative)", 1.0,
            a.stat(stat) / b.stat(stat) if a and b else None)
        h2d = find(rows, "gpu", "gpu_h2d", "raw")
        for temp in ("warm", "cold"):
            # >= 90% of min(disk, host->device) bandwidth: time <= max of the two limits / 0.9
            me, disk = find(rows, "gpu", f"gpu_{temp}", s), find(rows, "big", f"load_{temp}",
                                                                 "raw")
            limit = max(disk.stat(stat), h2d.stat(stat)) if disk and h2d else None
            add(f"{fmt}: GPU load, {temp}, ≥ 90% of min(disk, host→device) bandwidth", 0.9,
                limit / me.stat(stat) if me and limit else None, le=False,
                note="limit: raw host load vs pinned copy, the slower")
        a = find(rows, "bgsave", "bg_background", s)
        b = next((r for r in rows if r.op == "bg_copy" and r.times), None)
        add(f"{fmt}: background save blocks ≤ 1 memory copy", 1.0,
            a.stat(stat) / b.stat(stat) if a and b else None)
        r = find(rows, "bgsave", "bg_background", s)
        add(f"{fmt}: background save holds ≤ 1 snapshot (peak ≤ 1.05× model)", 1.05,
            r.anon_peak / r.nbytes if r and r.anon_peak is not None else None)
    for goal, us in round3.goals(rows, stat):
        add(goal, round3.GOAL_US, us)
    return out


def goals_table(gl: list[dict[str, Any]]) -> list[str]:
    out = ["| goal | measured (medians) | met | on minima |", "|---|---|---|---|"]

    def show(m: float | None, goal: str) -> str:
        if m is None:
            return "not measured"
        return f"{m:,.1f} µs" if "µs" in goal else f"{m:.2f}×"

    for g in gl:
        met = {None: "—", True: "met", False: "**missed**"}[g["met"]]
        mn = show(g.get("measured_min"), g["goal"])
        if g.get("met_min") is not None and g["met_min"] != g["met"]:
            mn += " (met)" if g["met_min"] else " (missed)"
        out.append(f"| {g['goal']} | {show(g['measured'], g['goal'])} | {met} | {mn} |")
    return out


def all_goals(rows: list[Row]) -> list[dict[str, Any]]:
    """Goals on medians (what counts), with the same ratios on minima beside them."""
    gl = goals(rows)
    for g, m in zip(gl, goals(rows, "min"), strict=True):
        g["measured_min"], g["met_min"] = m["measured"], m["met"]
    return gl
