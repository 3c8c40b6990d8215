"""The save and restore protocol at scale, simulated in one process (no I/O, no MPI).

``N`` simulated ranks each hold one box of every sharded variable (ragged row slabs:
cut points drawn at random, so no two ranks hold the same number of rows). The real
planning code runs on them, through the public API:

- save planning: :func:`ckptvar.distributed.gather_plan` called as one rank, with a
  :class:`SimCoordinator` whose ``allgather`` answers with every simulated rank's
  contribution and counts the pickled bytes this rank sends and receives; first with
  an empty :class:`~ckptvar.distributed.PlanCache` (uncached: the layouts are
  gathered and planned), then again (cached: only the digests travel). Every rank
  runs the same deterministic planning, so one rank's time is each rank's time;
- the metadata: the step index's ``variables`` map as the writer packs it (msgpack of
  each variable's full shape, dtype and ``[offset, shape, writer, box key]`` per box,
  docs/FORMAT.md), its bytes against the number of boxes;
- read amplification of an ``N -> M`` restore: every one of ``M`` readers (ragged
  slabs with other cut points) maps its box onto the stored boxes with
  :func:`ckptvar.distributed.read_plan`, and each part is charged two ways, as the
  sharded reader reads it: the bytes read from storage (the whole stored box when
  the part is all of it or the box is one 64 KiB checksum block or less, verified
  whole; else the part's run of rows and the rest of the first and last checksum
  blocks it touches, which are hashed from the file to verify the run) and the bytes
  that land in the reader's memory (the whole box, or only the run: the edge blocks
  go through a small scratch buffer). Amplification is each over the bytes wanted.

Run ``python -m benchmarks.simulate [--quick] [--ranks 64,256,...] [--png P]``;
``scripts/bench.py --only scale`` includes it. The numbers are what the docs'
"At scale" section shows.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ckptvar.distributed import (
    Box,
    Coordinator,
    PlanCache,
    SavePlan,
    VariableLayout,
    gather_plan,
    layout_digest,
    layout_message,
    read_plan,
)

#: The checksum block ckptvar's own format is written with (64 KiB; 256 KiB before
#: 2026-11-27); a stored box of at most one block has no block checksums and is read
#: whole (and verified whole).
BLOCK = 64 << 10
DTYPE = "<f4"
ITEMSIZE = 4


class SimCoordinator(Coordinator):
    """Rank ``rank`` of ``size`` simulated ranks, in this process.

    ``contributions[tag]`` holds every rank's object for the collective of that tag
    (the part after the last ``:``); this rank's own is the one it passes. Bytes are
    counted as pickled sizes, taken from ``sizes[tag]`` (each rank's, measured once).
    """

    def __init__(self, rank: int, size: int, contributions: dict[str, list[Any]],
                 sizes: dict[str, list[int]]) -> None:
        super().__init__(timeout=60.0)
        self._rank, self._size = rank, size
        self.contributions, self.sizes = contributions, sizes
        self.sent = 0
        self.received = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allgather(self, obj: Any, *, tag: str, timeout: float | None = None) -> list[Any]:
        name = tag.rsplit(":", 1)[-1]
        got = list(self.contributions[name])
        got[self._rank] = obj
        sizes = self.sizes[name]
        self.sent += sizes[self._rank]
        self.received += sum(sizes) - sizes[self._rank]
        return got

    def broadcast(self, obj: Any, root: int = 0, *, tag: str, timeout: float | None = None) -> Any:
        raise NotImplementedError("planning needs no broadcast")

    def barrier(self, *, tag: str, timeout: float | None = None) -> None:
        return None

    def background(self) -> Coordinator:
        return self


def ragged_cuts(rows: int, parts: int, seed: int) -> list[int]:
    """``parts + 1`` increasing cut points from 0 to ``rows``, slabs of unequal sizes."""
    rng = np.random.default_rng(seed)
    if parts == 1:
        return [0, rows]
    inner = np.sort(rng.choice(np.arange(1, rows), size=parts - 1, replace=False))
    return [0, *(int(c) for c in inner), rows]


@dataclass
class SaveFigures:
    """One simulated save: ``ranks`` x ``variables``."""

    ranks: int
    variables: int
    boxes: int
    uncached_s: float
    cached_s: float
    uncached_cpu_s: float  # process CPU time: what a loaded machine inflates least
    sent_uncached: int
    received_uncached: int
    sent_cached: int
    received_cached: int
    index_bytes: int
    unpickle_s: float
    maxrss_mib: float
    extra: dict[str, Any] = field(default_factory=dict)


def _rank_layouts(ranks: int, variables: int, rows: int, cols: int
                  ) -> tuple[list[dict[str, Any]], list[dict[str, VariableLayout]]]:
    """Every rank's plain layout (shared tuples: ~150 bytes a box) and rank 0's own."""
    keys = [f"layer_{i // 100}/w{i % 100}" for i in range(variables)]
    cuts = ragged_cuts(rows, ranks, seed=ranks)
    full = (rows, cols)
    plains = []
    for r in range(ranks):
        value = (full, DTYPE, [((cuts[r], 0), (cuts[r + 1] - cuts[r], cols))])
        plains.append(dict.fromkeys(keys, value))  # one value object shared by the keys
    own = [{k: VariableLayout(full, DTYPE, (Box(*plains[0][k][2][0]),)) for k in keys}]
    return plains, own


def simulate_save(ranks: int, variables: int, *, rows: int | None = None, cols: int = 64,
                  repeats: int = 3) -> SaveFigures:
    """Plan one save of ``variables`` row-sharded variables over ``ranks`` ranks."""
    rows = rows or max(4 * ranks, 1024)
    plains, own = _rank_layouts(ranks, variables, rows, cols)
    # rank 0's real digest; the others' differ from it and from each other
    digests = [layout_digest(own[0]), *(f"{r:032x}" for r in range(1, ranks))]
    # what each rank sends in the layout gather (rank 0 with the spec of keys, shapes, dtypes)
    messages = [layout_message(p, r) for r, p in enumerate(plains)]
    sizes_layouts = _pickled_sizes(messages)
    cache = PlanCache()

    def contributions(known: frozenset[str]) -> tuple[dict[str, list[Any]],
                                                      dict[str, list[int]]]:
        first = [(d, {}, known) for d in digests]
        one = len(pickle.dumps(first[0], pickle.HIGHEST_PROTOCOL))
        return ({"digests": first, "layouts": messages},
                {"digests": [one] * ranks, "layouts": sizes_layouts})

    gc.collect()
    # uncached: a fresh cache each time; the digest is passed in, as the save does
    times, cpu = [], []
    plan: SavePlan | None = None
    for _ in range(repeats):
        cache = PlanCache()
        c, s = contributions(frozenset())
        coord = SimCoordinator(0, ranks, c, s)
        t0, c0 = time.perf_counter(), time.process_time()
        plan = gather_plan(coord, own[0], cache=cache, digest=digests[0])
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert plan is not None
    sent_u, recv_u = coord.sent, coord.received
    # cached: every rank knows the plan of these digests; the digest of the own layout
    # is computed in the timed call (a pass over it), as a caller that kept none pays
    c, s = contributions(cache.keys())
    ctimes = []
    for _ in range(max(repeats, 5)):
        coord = SimCoordinator(0, ranks, c, s)
        t0 = time.perf_counter()
        again = gather_plan(coord, own[0], cache=cache)
        ctimes.append(time.perf_counter() - t0)
    assert again is plan
    # what a real receiver also pays: unpickling every rank's message (informative)
    blob = pickle.dumps(messages[: min(ranks, 64)], pickle.HIGHEST_PROTOCOL)
    t0 = time.perf_counter()
    pickle.loads(blob)
    unpickle = (time.perf_counter() - t0) * ranks / min(ranks, 64)
    boxes = sum(vp.n_boxes for vp in plan.variables.values())
    figures = SaveFigures(
        ranks, variables, boxes, min(times), min(ctimes), min(cpu), sent_u, recv_u, coord.sent,
        coord.received, index_bytes(plan), unpickle,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    del plan, again, cache, plains, own
    gc.collect()
    return figures


def _pickled_sizes(messages: Sequence[Any]) -> list[int]:
    """Each rank's pickled layout message: rank 0's (with the spec), the others' measured
    on a sample of ranks (the same structure)."""
    def size(m: Any) -> int:
        return len(pickle.dumps(m, pickle.HIGHEST_PROTOCOL))

    step = max(1, len(messages) // 16)
    sample = {r: size(messages[r]) for r in range(1, len(messages), step)}
    return [size(messages[0]), *(sample[r - (r - 1) % step] for r in range(1, len(messages)))]


def index_bytes(plan: SavePlan) -> int:
    """Bytes of the step index's ``variables`` map for ``plan`` (as the writer packs it)."""
    variables = {}
    for key, vp in plan.variables.items():
        offsets, shapes, writers = vp.plain_boxes()
        variables[key] = {
            "shape": list(vp.full_shape), "dtype": vp.dtype, "attrs": {},
            "boxes": [[o, s, w, f"{key}@{j}"]
                      for j, (o, s, w) in enumerate(zip(offsets, shapes, writers, strict=True))]}
    return len(msgpack.packb(variables, use_bin_type=True))


def fetched(part: Box, stored: Box, cols: int, block: int = BLOCK) -> int:
    """Bytes the sharded reader reads from storage for ``part`` of the row slab ``stored``
    (``block``: the checksum block of the file)."""
    whole = stored.size * ITEMSIZE
    if part == stored or whole <= block:
        return whole
    row = cols * ITEMSIZE  # a run of rows, verified by the blocks it touches
    start = (part.offset[0] - stored.offset[0]) * row
    end = start + part.shape[0] * row
    return min(whole, (end + block - 1) // block * block) - start // block * block


def delivered(part: Box, stored: Box, cols: int, block: int = BLOCK) -> int:
    """Bytes that land in the reader's memory for ``part`` of ``stored`` (the whole box
    when it is read whole, else the run; edge blocks are hashed through a small buffer)."""
    whole = stored.size * ITEMSIZE
    return whole if part == stored or whole <= block else part.size * ITEMSIZE


#: The variables of the resharding model: (rows, cols) float32, large and small.
RESHARD_SHAPES = ((65_536, 1024), (16_384, 4096), (4096, 1024), (1000, 64))


def amplification(n: int, m: int, shapes: Sequence[tuple[int, int]] = RESHARD_SHAPES,
                  block: int = BLOCK) -> tuple[float, float]:
    """``(from storage, into memory)``: bytes read over bytes wanted when ``m`` readers
    restore what ``n`` wrote."""
    want = got = kept = 0
    for v, (rows, cols) in enumerate(shapes):
        wc = ragged_cuts(rows, n, seed=1000 * v + n)
        rc = ragged_cuts(rows, m, seed=1000 * v + m + 7919)
        stored = [Box((wc[i], 0), (wc[i + 1] - wc[i], cols)) for i in range(n)]
        for j in range(m):
            target = Box((rc[j], 0), (rc[j + 1] - rc[j], cols))
            want += target.size * ITEMSIZE
            for item in read_plan(f"v{v}", target, stored, (rows, cols)):
                got += fetched(item.box, stored[item.source], cols, block)
                kept += delivered(item.box, stored[item.source], cols, block)
    return got / want, kept / want


def amplification_matrix(top: int = 64, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``(storage, memory)``: ``[n - 1, m - 1]`` is the amplification of ``n -> m``, for
    every ``n`` and ``m`` in 1..``top``."""
    storage, memory = np.ones((top, top)), np.ones((top, top))
    for n in range(1, top + 1):
        for m in range(1, top + 1):
            storage[n - 1, m - 1], memory[n - 1, m - 1] = amplification(n, m, block=block)
    return storage, memory


def edge_bound(m: int, shapes: Sequence[tuple[int, int]] = RESHARD_SHAPES,
               block: int = BLOCK) -> float:
    """The most the edge blocks can add for ``m`` readers, over the bytes wanted: each of
    the ``m - 1`` cuts of each variable makes the two readers beside it hash up to one
    block between them (the parts of the block each lacks) -- a bound, for the docs."""
    total = sum(r * c * ITEMSIZE for r, c in shapes)
    return 1 + sum(min(m - 1, r - 1) * min(block, r * c * ITEMSIZE) for r, c in shapes) / total


def run(ranks: Sequence[int], variables: int, top: int, repeats: int) -> dict[str, Any]:
    """Every figure of the simulation, as plain data (JSON)."""
    saves = [simulate_save(r, variables, repeats=repeats).__dict__ for r in ranks]
    amp, mem = amplification_matrix(top)
    worst = np.unravel_index(int(np.argmax(amp)), amp.shape)
    mworst = np.unravel_index(int(np.argmax(mem)), mem.shape)
    return {"saves": saves, "amplification": {
        "top": top, "max": float(amp.max()), "worst": [int(worst[0]) + 1, int(worst[1]) + 1],
        "mean": float(amp.mean()), "matrix": amp.round(4).tolist(),
        "bound": edge_bound(top),
        "memory_max": float(mem.max()), "memory_mean": float(mem.mean()),
        "memory_worst": [int(mworst[0]) + 1, int(mworst[1]) + 1]}}


#: The scales ``scripts/bench.py`` simulates, to keep its full run near ten minutes (the
#: 1,024- and 4,096-rank rows take minutes and GiBs, the 64 x 64 amplification matrix
#: minutes: ``python -m benchmarks.simulate`` runs them).
BENCH_RANKS, BENCH_TOP = (64, 256), 16
QUICK_RANKS, QUICK_VARIABLES, QUICK_TOP = (16, 64), 100, 8


def to_rows(result: dict[str, Any], make_row: Any) -> list[Any]:
    """The bench's rows (``atscale``): one per scale (op ``plan<N>``: the uncached
    planning time, every figure in ``extra``) and ``amplification`` (its worst in ``extra``)."""
    def extra(figures: dict[str, Any]) -> dict[str, list[Any]]:  # a Row's: lists of values
        return {k: [v] for k, v in figures.items() if k not in ("extra", "matrix")}

    rows = [make_row(f"plan{s['ranks']}", [s["uncached_s"]], extra(s)) for s in result["saves"]]
    a = result["amplification"]
    rows.append(make_row("amplification", [a["max"]], extra(a)))
    return rows


def from_rows(rows: Sequence[Any]) -> dict[str, Any] | None:
    """The result :func:`tables` shows, back from the bench's ``atscale`` rows."""
    def figures(r: Any) -> dict[str, Any]:
        return {k: v[0] for k, v in r.extra.items() if v}

    saves = [figures(r) for r in rows if r.workload == "atscale" and r.op.startswith("plan")]
    amp = next((figures(r) for r in rows if r.workload == "atscale"
                and r.op == "amplification"), None)
    if not saves or amp is None:
        return None
    return {"saves": saves, "amplification": amp}


def tables(result: dict[str, Any]) -> list[str]:
    """Markdown: the save planning per scale, and the read amplification."""
    out = ["| ranks × variables | boxes | plan uncached (CPU) | plan cached (per rank) | "
           "index bytes (per box) | sent / received per rank, uncached | "
           "sent / received per rank, cached |", "|---|---|---|---|---|---|---|"]
    for s in result["saves"]:
        out.append(
            f"| {s['ranks']:,} × {s['variables']:,} | {s['boxes']:,} | "
            f"{s['uncached_s'] * 1e3:,.0f} ms ({_cpu(s)}) | "
            f"{s['cached_s'] * 1e3:,.2f} ms | "
            f"{s['index_bytes'] / 2**20:,.1f} MiB ({s['index_bytes'] / s['boxes']:.1f}) | "
            f"{_b(s['sent_uncached'])} / {_b(s['received_uncached'])} | "
            f"{_b(s['sent_cached'])} / {_b(s['received_cached'])} |")
    a = result["amplification"]
    out += ["", f"Read amplification, every N → M in 1..{a['top']} (ragged slabs), bytes read "
            f"from storage (the edge blocks hashed to verify a run included) over bytes "
            f"wanted: worst {a['max']:.3f} (at {a['worst'][0]} → {a['worst'][1]}), mean "
            f"{a['mean']:.3f}; the edge blocks' bound at {a['top']} readers "
            f"{a.get('bound', float('nan')):.3f}."]
    if "memory_max" in a:
        out += ["", f"Bytes that land in the readers' memory over bytes wanted: worst "
                f"{a['memory_max']:.3f} (at {a['memory_worst'][0]} → "
                f"{a['memory_worst'][1]}), mean {a['memory_mean']:.3f}."]
    return out


def _cpu(s: dict[str, Any]) -> str:
    cpu = s.get("uncached_cpu_s")
    return "—" if cpu is None else f"{cpu * 1e3:,.0f}"


def _b(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def chart(result: dict[str, Any], path: str) -> str | None:
    """The curves (planning time, index bytes, bytes received, by ranks) and the
    amplification matrix, as one PNG; the reason when matplotlib is missing."""
    try:
        import matplotlib as mpl  # noqa: PLC0415 - optional (the bench extra)

        mpl.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "no chart: matplotlib is not installed (pip install -e '.[bench]')"
    s = result["saves"]
    r = [x["ranks"] for x in s]
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    ax[0].loglog(r, [x["uncached_s"] for x in s], "o-", label="uncached")
    ax[0].loglog(r, [x["cached_s"] for x in s], "s-", label="cached (per rank)")
    ax[0].axhline(1.0, ls=":", c="grey")
    ax[0].axhline(0.01, ls=":", c="grey")
    ax[0].set(title=f"save planning, {s[0]['variables']:,} variables", xlabel="ranks",
              ylabel="seconds")
    ax[0].legend()
    ax[1].loglog([x["boxes"] for x in s], [x["index_bytes"] for x in s], "o-")
    ax[1].set(title="index size vs boxes", xlabel="boxes", ylabel="bytes")
    ax[2].loglog(r, [x["received_uncached"] for x in s], "o-", label="received, uncached")
    ax[2].loglog(r, [x["sent_uncached"] for x in s], "^-", label="sent, uncached")
    ax[2].loglog(r, [x["received_cached"] for x in s], "s-", label="received, cached")
    ax[2].set(title="bytes per rank per save (planning)", xlabel="ranks", ylabel="bytes")
    ax[2].legend()
    a = result["amplification"]
    im = ax[3].imshow(np.array(a["matrix"]), origin="lower", cmap="viridis",
                      extent=(0.5, a["top"] + 0.5, 0.5, a["top"] + 0.5))
    ax[3].set(title="read amplification N → M (from storage)", xlabel="M (readers)",
              ylabel="N (writers)")
    fig.colorbar(im, ax=ax[3])
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small scales (seconds)")
    p.add_argument("--ranks", default="", help="comma list of rank counts")
    p.add_argument("--variables", type=int, default=1000)
    p.add_argument("--top", type=int, default=0, help="amplification for N, M in 1..top")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="", help="write the figures here")
    p.add_argument("--png", default="", help="write the chart here")
    args = p.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",") if x] or (
        [16, 64] if args.quick else [64, 256, 1024, 4096])
    top = args.top or (8 if args.quick else 64)
    result = run(ranks, args.variables if not args.quick else 100, top, args.repeats)
    print("\n".join(tables(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    if args.png:
        why = chart(result, args.png)
        if why:
            print(why)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
