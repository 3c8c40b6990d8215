"""The ``gpu_save`` benchmark: a model's CUDA tensors saved and loaded back onto the GPU.

Run ``python -m benchmarks.gpu_save [--gib G] [--repeats N] [--dir D] [--json F]`` on a
machine with a CUDA device, torch with CUDA and CuPy. The model: ``--gib`` GiB of CUDA
tensors, 64 MiB each, one in eight bfloat16. Measured in one run, best of ``--repeats``:

- ``d2h pinned``: every tensor copied into one reused pinned buffer (the PCIe limit);
- ``raw``: each tensor copied to the host (``.cpu()``) and written to one file with
  ``os.write``, then ``fsync`` (what a hand-written save does);
- ``ckptvar h5`` / ``ckptvar zarr``: ``cv.save(path, tensors)`` (checksums, fsync, atomic
  publish), staged through the pinned buffer;
- ``torch.save`` and ``safetensors`` (``safetensors.torch.save_file``), the peers;
- loads onto the GPU: ``cv.load(path, like="torch", device="cuda:0")``, against
  ``safe_open(path, framework="pt", device="cuda:0")`` and ``torch.load(map_location=
  "cuda:0")``, page cache warm.

For each save the growth of the process's resident host memory is reported too: the
staging buffer is two halves of ``CKPTVAR_STAGING_BYTES`` (64 MiB each).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Best seconds of ``repeats`` calls, and the largest RSS growth seen during one."""
    best, grew = float("inf"), 0.0
    for _ in range(repeats):
        stop = threading.Event()
        base = _rss()
        peak = [base]

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.002)

        w = threading.Thread(target=watch)
        w.start()
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            dt = time.perf_counter() - t0
            stop.set()
            w.join()
        best = min(best, dt)
        grew = max(grew, (peak[0] - base) / 2**20)
    return best, grew


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    import ckptvar as cv

    n = max(1, int(args.gib * 16))
    torch.manual_seed(0)
    tensors: dict[str, Any] = {}
    for i in range(n):
        t = torch.randn(16 << 20, device="cuda")  # 64 MiB
        tensors[f"layer{i}/w"] = t.to(torch.bfloat16) if i % 8 == 7 else t
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    root = Path(args.dir or tempfile.mkdtemp(prefix="gpu-save-"))
    root.mkdir(parents=True, exist_ok=True)
    pinned = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    cv.save(root / "warm.h5", {"x": torch.ones(4, device="cuda")})  # pinned halves made
    rows: dict[str, dict[str, float]] = {}

    def d2h() -> None:
        for t in tensors.values():
            flat = t.reshape(-1).view(torch.uint8)
            for s in range(0, flat.numel(), pinned.numel()):
                m = min(pinned.numel(), flat.numel() - s)
                pinned[:m].copy_(flat[s : s + m], non_blocking=True)
            torch.cuda.synchronize()

    def raw() -> None:
        p = root / "raw.bin"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in tensors.values():
                host = t.cpu()
                os.write(fd, host.view(torch.uint8).numpy().data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def ck(fmt: str) -> Callable[[], None]:
        def run() -> None:
            p = root / f"m.{fmt}"
            shutil.rmtree(p, ignore_errors=True)
            if p.exists():
                p.unlink()
            cv.save(p, tensors)
        return run

    def tsave() -> None:
        torch.save(tensors, root / "m.pt")

    def st() -> None:
        from safetensors.torch import save_file
        save_file(tensors, str(root / "m.safetensors"))

    subjects: list[tuple[str, Callable[[], None]]] = [
        ("d2h pinned", d2h), ("raw", raw), ("ckptvar h5", ck("h5")),
        ("ckptvar zarr", ck("zarr")), ("torch.save", tsave), ("safetensors", st)]
    for name, fn in subjects:
        try:
            sec, grew = _timed(fn, args.repeats)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
            print(f"{name}: failed: {exc}")
            continue
        rows[f"save {name}"] = {"s": sec, "GBps": nbytes / sec / 1e9, "rss_mib": grew}

    def cv_load(fmt: str) -> Callable[[], None]:
        def run() -> None:
            out = cv.load(root / f"m.{fmt}", like="torch", device="cuda:0")
            torch.cuda.synchronize()
            del out
        return run

    def st_load() -> None:
        from safetensors import safe_open
        with safe_open(str(root / "m.safetensors"), framework="pt", device="cuda:0") as f:
            out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        torch.cuda.synchronize()
        del out

    def t_load() -> None:
        out = torch.load(root / "m.pt", map_location="cuda:0")
        torch.cuda.synchronize()
        del out

    for name, fn in [("ckptvar h5", cv_load("h5")), ("ckptvar zarr", cv_load("zarr")),
                     ("safetensors", st_load), ("torch.load", t_load)]:
        try:
            fn()  # the page cache warm
            sec, grew = _timed(fn, args.repeats)
        except Exception as exc:  # noqa: BLE001
            print(f"load {name}: failed: {exc}")
            continue
        rows[f"load {name}"] = {"s": sec, "GBps": nbytes / sec / 1e9, "rss_mib": grew}
    # the loaded values are the saved ones
    back = cv.load(root / "m.h5", keys=["layer0/w", "layer7/w"], like="torch", device="cuda:0")
    assert all(torch.equal(back[k], tensors[k]) for k in back)
    np.testing.assert_array_equal(cv.load(root / "m.zarr", keys=["layer7/w"])["layer7/w"]
                                  .view(np.int16),
                                  tensors["layer7/w"].cpu().view(torch.int16).numpy())
    print(f"{nbytes / 2**30:.2f} GiB of CUDA tensors, {torch.cuda.get_device_name()}; "
          f"best of {args.repeats}")
    print(f"| {'row':<22} | {'s':>6} | {'GB/s':>6} | {'x raw':>6} | {'RSS +MiB':>8} |")
    base = rows.get("save raw", {}).get("s")
    for name, r in rows.items():
        ratio = f"{r['s'] / base:6.2f}" if base and name.startswith("save") else "     -"
        print(f"| {name:<22} | {r['s']:6.3f} | {r['GBps']:6.2f} | {ratio} | "
              f"{r['rss_mib']:8.0f} |")
    out = {"nbytes": nbytes, "device": torch.cuda.get_device_name(), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
