"""The ``incremental`` workload: what ``CheckpointManager(incremental=True)`` writes per step.

Run ``python -m benchmarks.incremental [--quick] [--mib N] [--steps S] [--dir D] [--s3] [--json]
[--workloads frozen,...] [--max-patched-rows F] [--max-patches N] [--whole-every N]``
(the last three: the incremental manager's ``cv.IncrementalOptions``; default: its
defaults, ``incremental=True``).
In one run, for each format (h5, zarr) and each workload, it saves ``S`` steps with a
full manager and with an incremental one (durable saves, warm page cache) and gives per
step (medians): the bytes the process wrote (``wchar`` of ``/proc/self/io``: every
``write``/``pwrite``, the state file included), the bytes that changed, the save time,
the time to write only the changed bytes raw (the comparator of "time/raw", taken after
the manager's background work of the step before ended: one new
file written with ``pwrite`` from the arrays' buffers, then one ``fsync``, nothing
else — as the other durable rows compare with raw + fsync; no directory fsync, no
rename, no record: the floor of any durable write of those bytes), the save time with
the freeing of the step it pruned (``save()`` then ``wait_until_finished()``: the
manager frees a pruned step's bytes in the background), and the time ``cv.save`` takes to write only the changed values ("changed
alone": the same bytes as a ckptvar checkpoint, with its fixed cost). Then a step with nothing changed, against a save of a checkpoint holding only
the small values (the record's cost), and the restore of the last incremental step
against the last full one (median and fastest of 7, ``--restores`` rounds, in turn, and
the median CPU time of the process per restore; verified).

With ``--s3`` the steps go to a bucket on a moto S3 server started in its own process
(:mod:`benchmarks.cloud`, needs obstore and ``moto[server]``), through a TCP proxy that
counts the bytes sent to it: "written" is then the bytes uploaded (a Zarr step's
unchanged values are server-side copies: no byte through the client), "raw" is one
obstore ``put`` of the changed bytes, "changed alone" a ``cv.save`` of them to the bucket.

Workloads (``N`` MiB of float32 state, 64 by default, 8 with ``--quick``):

- ``frozen``: 20 tensors, 18 frozen (90%), 2 trained (``assign_add`` each step);
- ``embedding-1%`` / ``embedding-10%``: one table of 64-wide rows, 1% or 10% of the
  rows touched per step (Zipf-distributed row ids; a row touched twice counts once) by
  ``scatter_update``, so the variable knows the rows and an incremental step stores the
  table as a row delta (docs/FORMAT.md, "Row deltas");
- ``window-1%``: the same table, 1% of its rows touched in one contiguous run at a random
  place (rows being added or fine-tuned together).

"Changed chunks" counts, for the table workloads, the bytes of the 4 MiB chunks that hold
a touched row (what an incremental Zarr step, which stores a large value as chunks of
4 MiB, must write at the least); for ``frozen`` it is the changed tensors' bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import ckptvar as cv

ROW = 64  # floats per embedding row
PIECE = 4 << 20  # the chunk size of a value stored in chunks (incremental Zarr steps)
WORKLOADS = ("frozen", "embedding-1%", "embedding-10%", "window-1%")


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


class Workload:
    """A model and the change one training step makes to it."""

    def __init__(self, name: str, nbytes: int, seed: int = 0) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        n = nbytes // 4
        if name == "frozen":
            per = n // 20
            self.vars = [cv.Variable(self.rng.random(per, dtype=np.float32), name=f"t{i}",
                                     trainable=i >= 18) for i in range(20)]
            self.fraction = 0.0
        else:
            rows = n // ROW
            self.vars = [cv.Variable(self.rng.random((rows, ROW), dtype=np.float32),
                                     name="table")]
            self.fraction = float(name.split("-")[1].rstrip("%")) / 100
        #: bytes of the chunks the last step touched (see the module docstring)
        self.chunk_bytes = 0
        self.ckpt = cv.Checkpoint(**{v.name.split(":")[0]: v for v in self.vars})

    def step(self) -> list[np.ndarray]:
        """One training step; returns the changed bytes (what a perfect writer writes)."""
        if self.name == "frozen":
            for v in self.vars[18:]:
                v.assign_add(1.0)
            self.chunk_bytes = sum(v.numpy().nbytes for v in self.vars[18:])
            return [v.numpy() for v in self.vars[18:]]
        table = self.vars[0]
        rows = table.shape[0]
        n = max(1, int(rows * self.fraction))
        if self.name.startswith("window"):
            start = int(self.rng.integers(0, rows - n + 1))
            ids = np.arange(start, start + n)
        else:
            ids = np.unique((self.rng.zipf(1.2, n * 2) - 1) % rows)[:n]
        table.scatter_update(ids, table[ids] + 1.0)  # the variable notes the rows
        per = PIECE // (ROW * 4)
        chunks = np.unique(ids // per)
        self.chunk_bytes = int(sum(min(per, rows - c * per) for c in chunks.tolist())) * ROW * 4
        return [table.numpy()[ids]]


class Place:
    """Where the steps go: a local directory, or (``--s3``) a bucket behind a counting proxy."""

    def __init__(self, directory: Path, s3: Any = None) -> None:
        self.directory = directory
        self.s3 = s3  # (bucket, storage options, proxy, obstore store) or None
        self._n = 0

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return None if self.s3 is None else self.s3[1]

    def where(self, name: str) -> Any:
        return self.directory / name if self.s3 is None else f"s3://{self.s3[0]}/{name}"

    def fresh(self, stem: str, fmt: str) -> Any:
        """A new checkpoint path each call (an object-store step is written once)."""
        self._n += 1
        return self.where(f"{stem}-{self._n}.{fmt}")

    def written(self) -> int:
        """Bytes written so far: ``wchar`` locally, bytes sent to the server on S3."""
        return _wchar() if self.s3 is None else self.s3[2].bytes_up

    def raw_write(self, changed: list[np.ndarray]) -> float:
        if self.s3 is None:
            return _raw_write(self.directory / "raw.bin", changed)
        import obstore  # noqa: PLC0415 - the cloud extra, only with --s3

        data = b"".join(np.ascontiguousarray(a).tobytes() for a in changed)
        t0 = time.perf_counter()
        obstore.put(self.s3[3], "raw.bin", data)
        return time.perf_counter() - t0

    def remove(self, name: str) -> None:
        if self.s3 is None:
            shutil.rmtree(self.directory / name)


def _raw_write(path: Path, changed: list[np.ndarray]) -> float:
    """Seconds to write ``changed`` as a new file (pwrite, one fsync), as a step does;
    the previous one is removed first, untimed (truncating it would time the freeing)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pos = 0
        for a in changed:
            os.pwrite(fd, memoryview(np.ascontiguousarray(a)).cast("B"), pos)
            pos += a.nbytes
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _steps(work: Workload, manager: cv.CheckpointManager, steps: int, place: Place
           ) -> dict[str, Any]:
    manager.save()  # the first step is a full one either way
    written, changed, times, raws, alone, chunks = [], [], [], [], [], []
    freed: list[float] = []  # the save and the freeing of the step it pruned
    for _ in range(steps):
        manager.wait_until_finished()  # nothing of the last step overlaps the comparators
        delta = work.step()
        changed.append(sum(a.nbytes for a in delta))
        chunks.append(work.chunk_bytes)
        raws.append(place.raw_write(delta))
        target = (place.where(f"raw.{manager.format}") if place.s3 is None
                  else place.fresh("alone", manager.format))
        t0 = time.perf_counter()
        cv.save(target, {f"v{i}": a for i, a in enumerate(delta)},
                storage_options=place.storage_options)
        alone.append(time.perf_counter() - t0)
        w0, t0 = place.written(), time.perf_counter()
        manager.save()
        times.append(time.perf_counter() - t0)
        manager.wait_until_finished()  # the pruned step's bytes freed (in the background)
        freed.append(time.perf_counter() - t0)
        written.append(place.written() - w0)
    return {"written": statistics.median(written), "changed": statistics.median(changed),
            "written_total": sum(written), "changed_total": sum(changed),
            "changed_chunks": statistics.median(chunks),
            "time": statistics.median(times), "raw": statistics.median(raws),
            "time_freed": statistics.median(freed),
            "changed_alone": statistics.median(alone)}


def _no_change(manager: cv.CheckpointManager, place: Place) -> tuple[float, float]:
    """Median time of a step with nothing changed, and of saving a checkpoint that holds
    only the small values (its record and packed blob: the floor of any step)."""
    small = cv.Checkpoint(x=cv.Variable(np.zeros(3), name="x"))
    steps, floor = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        manager.save()
        steps.append(time.perf_counter() - t0)
        target = (place.where(f"record-only.{manager.format}") if place.s3 is None
                  else place.fresh("record-only", manager.format))
        t0 = time.perf_counter()
        small.write(target, storage_options=place.storage_options)
        floor.append(time.perf_counter() - t0)
    return statistics.median(steps), statistics.median(floor)


def _last_delta(manager: cv.CheckpointManager, place: Place) -> dict[str, Any] | None:
    """How the latest step stores the table: ``{"base", "patches", "rows"}`` (a row delta),
    or None (whole, or no table)."""
    with cv.open(manager.latest_checkpoint or "", storage_options=place.storage_options
                 ) as reader:
        assert isinstance(reader, cv.storage.SupportsDeltas)
        got: dict[str, Any] | None = reader.deltas().get("table")
        return got


def _restore_times(targets: dict[str, tuple[cv.Checkpoint, str]], place: Place,
                   rounds: int = 7) -> dict[str, tuple[float, float, float]]:
    """Median and fastest restore time of each mode's latest step over ``rounds``, and
    the median CPU time of the process (every thread) per restore, the modes taken in
    turn (the order effects of a shared machine fall on both alike; the CPU time is
    the steadier where other processes share the CPUs)."""
    times: dict[str, list[float]] = {mode: [] for mode in targets}
    cpu: dict[str, list[float]] = {mode: [] for mode in targets}
    if place.s3 is None:  # the steps just written are on their way to the disk: let them
        os.sync()         # land first, or the kernel's writeback shares the CPUs with the
        time.sleep(0.5)   # first restores (one mode's more than the other's)
    for _ in range(rounds):
        for mode, (ckpt, path) in targets.items():
            c0, t0 = time.process_time(), time.perf_counter()
            ckpt.restore(path, storage_options=place.storage_options)
            times[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
    return {mode: (statistics.median(ts), min(ts), statistics.median(cpu[mode]))
            for mode, ts in times.items()}


def run(directory: Path, nbytes: int, steps: int, s3: Any = None,
        workloads: tuple[str, ...] = WORKLOADS, *,
        options: cv.IncrementalOptions | None = None, restores: int = 7
        ) -> list[dict[str, Any]]:
    """The rows, locally or (``s3``: see :class:`Place`) on the S3 server (``options``:
    the incremental manager's; None: ``incremental=True``; ``restores``: rounds of
    restores timed)."""
    incremental = options or cv.IncrementalOptions()
    place = Place(directory, s3)
    rows = []
    for fmt in ("h5", "zarr"):
        for name in workloads:
            row: dict[str, Any] = {"format": fmt, "workload": name, "state": nbytes,
                                   "place": "local" if s3 is None else "s3",
                                   "options": dataclasses.asdict(incremental)}
            targets: dict[str, tuple[cv.Checkpoint, str]] = {}
            for mode in ("full", "incremental"):
                with cv.Graph().as_default():
                    work = Workload(name, nbytes)
                    manager = cv.CheckpointManager(
                        work.ckpt, place.where(f"{fmt}-{name}-{mode}"), max_to_keep=3,
                        format=fmt, incremental=mode == "incremental" and incremental,
                        storage_options=place.storage_options)
                    row[mode] = _steps(work, manager, steps, place)
                    if mode == "incremental":
                        row["no_change"], row["record_only"] = _no_change(manager, place)
                        row["last_delta"] = _last_delta(manager, place)
                    targets[mode] = (work.ckpt, manager.latest_checkpoint or "")
            restore = _restore_times(targets, place, restores)
            for mode in targets:
                (row[f"restore_{mode}"], row[f"restore_{mode}_min"],
                 row[f"restore_{mode}_cpu"]) = restore[mode]
                place.remove(f"{fmt}-{name}-{mode}")
            inc = row["incremental"]
            row["written_over_changed"] = inc["written"] / max(inc["changed"], 1)
            row["total_over_changed"] = inc["written_total"] / max(inc["changed_total"], 1)
            row["written_over_chunks"] = inc["written"] / max(inc["changed_chunks"], 1)
            row["time_over_raw"] = inc["time"] / max(inc["raw"], 1e-9)
            row["freed_over_raw"] = inc["time_freed"] / max(inc["raw"], 1e-9)
            row["restore_ratio"] = row["restore_incremental"] / row["restore_full"]
            row["restore_ratio_min"] = (row["restore_incremental_min"]
                                        / row["restore_full_min"])
            row["restore_ratio_cpu"] = (row["restore_incremental_cpu"]
                                        / row["restore_full_cpu"])
            rows.append(row)
    return rows


@contextlib.contextmanager
def _server(wanted: bool) -> Iterator[Any]:
    """``(bucket, storage options, counting proxy, obstore store)`` of a fresh bucket on a
    moto server started here (its own process), or ``None`` when not ``wanted``."""
    if not wanted:
        yield None
        return
    from obstore.store import from_url  # noqa: PLC0415 - the cloud extra, only with --s3

    from benchmarks.cloud import (  # noqa: PLC0415 - imports obstore
        CountingProxy,
        make_bucket,
        options_for,
        start_moto,
    )

    server, endpoint = start_moto()
    proxy = CountingProxy(endpoint)
    try:
        bucket, _ = make_bucket(endpoint)
        opts = options_for(proxy.endpoint)
        config: Any = {k: v for k, v in opts.items() if k not in ("allow_http", "timeout")}
        store = from_url(f"s3://{bucket}", config=config,
                         client_options={"allow_http": True, "timeout": "600s"})
        yield bucket, opts, proxy, store
    finally:
        proxy.close()
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 MiB of state, 3 steps")
    parser.add_argument("--mib", type=int, default=64, help="MiB of state per workload")
    parser.add_argument("--steps", type=int, default=10, help="steps after the first")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory")
    parser.add_argument("--s3", action="store_true",
                        help="save to a moto S3 server started here (needs obstore, moto)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS).replace('%', '%%')} (default: all)")
    default = cv.IncrementalOptions()
    parser.add_argument("--max-patched-rows", type=float, default=default.max_patched_rows,
                        help="IncrementalOptions.max_patched_rows (share of the rows)")
    parser.add_argument("--max-patches", type=int, default=default.max_patches,
                        help="IncrementalOptions.max_patches")
    parser.add_argument("--whole-every", type=int, default=None,
                        help="IncrementalOptions.whole_every (default: never)")
    parser.add_argument("--restores", type=int, default=7,
                        help="rounds of restores timed (default 7)")
    args = parser.parse_args(argv)
    try:
        options = cv.IncrementalOptions(args.max_patched_rows, args.max_patches,
                                        args.whole_every)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    workloads = tuple(w for w in args.workloads.split(",") if w)
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    nbytes, steps = (8 << 20, 3) if args.quick else (args.mib << 20, args.steps)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as d, _server(args.s3) as s3:
        rows = run(Path(d), nbytes, steps, s3, workloads, options=options,
                   restores=args.restores)
    if args.json:
        print(json.dumps(rows))
        return 0
    mib = 2.0**20
    where = "on a moto S3 server (MiB uploaded)" if args.s3 else "locally"
    print(f"incremental vs full, {nbytes / mib:.0f} MiB of state, median of {steps} steps, "
          f"{where}, {options}")
    print("| format | workload | full: MiB written, ms | incremental: MiB written, ms | "
          "changed MiB | raw ms | changed alone ms | written/changed | "
          "written/changed chunks | all steps written/changed | time/raw | "
          "time with the prune freed/raw | "
          "no change ms (record-only) | no change - record ms | restore incr/full | "
          "incremental: MiB written, all steps | latest step's table | restore ms, incr/full | "
          "restore incr/full, fastest | restore incr/full, CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, i = r["full"], r["incremental"]
        print(f"| {r['format']} | {r['workload']} | {f['written'] / mib:.1f}, "
              f"{f['time'] * 1e3:.0f} | {i['written'] / mib:.1f}, {i['time'] * 1e3:.0f} | "
              f"{i['changed'] / mib:.2f} | {i['raw'] * 1e3:.1f} | "
              f"{i['changed_alone'] * 1e3:.1f} | "
              f"{r['written_over_changed']:.2f} | {r['written_over_chunks']:.2f} | "
              f"{r['total_over_changed']:.2f} | "
              f"{r['time_over_raw']:.2f} | {r['freed_over_raw']:.2f} | "
              f"{r['no_change'] * 1e3:.1f} ({r['record_only'] * 1e3:.1f}) | "
              f"{(r['no_change'] - r['record_only']) * 1e3:.1f} | "
              f"{r['restore_ratio']:.2f} | {i['written_total'] / mib:.1f} | "
              f"{_table_layout(r)} | {r['restore_incremental'] * 1e3:.1f} / "
              f"{r['restore_full'] * 1e3:.1f} | {r['restore_ratio_min']:.2f} | "
              f"{r['restore_ratio_cpu']:.2f} |")
    return 0


def _table_layout(row: dict[str, Any]) -> str:
    """How the latest incremental step stores the table: its patches and the share of the
    rows they hold (with repeats), or "whole"."""
    d = row.get("last_delta")
    if not d:
        return "whole"
    nrows = row["state"] // (ROW * 4)
    return f"{d['patches']} patch(es), {100 * d['rows'] / nrows:.1f}% rows"


if __name__ == "__main__":
    sys.exit(main())
