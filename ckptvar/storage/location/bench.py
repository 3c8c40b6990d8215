"""Benchmark: this layer's parallel ranged read and streaming upload vs obstore's own calls.

Against an S3 server on loopback (moto's, started here unless ``--endpoint`` is
given), for the same bytes: obstore's ``get_ranges`` (8 MiB ranges, no
coalescing) vs :meth:`ObjectStoreLocation.read_into` into one buffer, and
obstore's multipart ``put`` vs :meth:`ObjectStoreLocation.open_writer`. Prints
GiB/s and the ratio layer/obstore (best of ``--repeat`` runs each)::

    python -m ckptvar.storage.location.bench --size-mib 256

With ``--checkpoints``, the checkpoint level instead (:func:`bench_checkpoints`):
``cv.save``/``cv.load`` of a ``--size-mib`` HDF5 model of 64 values to and from
``s3://`` vs obstore's multipart ``put`` and ``get_ranges`` of as many bytes, and
the peak resident memory of each call, measured in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from ._base import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE
from ._object import ObjectStoreLocation

__all__ = ["bench_checkpoints", "bench_cloud", "main"]

GiB = 1024**3


def _best(fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _new_bucket(endpoint: str) -> tuple[str, dict[str, Any]]:
    """Create a fresh bucket on the S3 server at ``endpoint``; its name and storage options."""
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    req = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
    opts: dict[str, Any] = {
        "endpoint": endpoint,
        "access_key_id": "bench",
        "secret_access_key": "bench",
        "region": "us-east-1",
        "allow_http": True,
    }
    return bucket, opts


def bench_cloud(
    endpoint: str, *, size_mib: int = 256, repeat: int = 2, split_reads: bool = True
) -> dict[str, float]:
    """Throughputs (GiB/s) and ratios for ``size_mib`` MiB against the server at ``endpoint``.

    ``read_*`` is the layer with one streamed GET per range (``read_part_size=0``);
    ``read_split_*`` (with ``split_reads``) the default, 8 MiB ranged GETs in parallel.
    """
    import obstore

    bucket, opts = _new_bucket(endpoint)
    loc = ObjectStoreLocation(f"s3://{bucket}", storage_options={**opts, "read_part_size": 0})
    split = ObjectStoreLocation(f"s3://{bucket}", storage_options=opts)
    nbytes = size_mib * 1024 * 1024
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    view = memoryview(data.data)
    part = DEFAULT_PART_SIZE

    def obstore_put() -> None:
        obstore.put(
            loc.store, "base.bin", view, chunk_size=part, max_concurrency=DEFAULT_CONCURRENCY
        )

    def layer_put() -> None:
        with loc.open_writer("layer.bin", part_size=part) as w:
            for start in range(0, nbytes, part):
                w.write(view[start : start + part])

    t_put_base = _best(obstore_put, repeat)
    t_put_layer = _best(layer_put, repeat)
    starts = list(range(0, nbytes, part))
    lengths = [min(part, nbytes - s) for s in starts]
    out = np.empty(nbytes, dtype=np.uint8)

    def obstore_get() -> None:
        obstore.get_ranges(loc.store, "base.bin", starts=starts, lengths=lengths, coalesce=0)

    def layer_get() -> None:
        loc.read_into("layer.bin", 0, memoryview(out.data))

    t_get_base = _best(obstore_get, repeat)
    t_get_layer = _best(layer_get, repeat)
    if not np.array_equal(out, data):
        raise RuntimeError("the layer read back other bytes than it uploaded")
    extra: dict[str, float] = {}
    if split_reads:
        out[:] = 0
        t_split = _best(lambda: split.read_into("layer.bin", 0, memoryview(out.data)), 1)
        if not np.array_equal(out, data):
            raise RuntimeError("the layer read back other bytes than it uploaded")
        extra = {
            "read_split_gib_s": nbytes / GiB / t_split,
            "read_split_ratio": t_get_base / t_split,
        }
    loc.delete(["base.bin", "layer.bin"])
    gib = nbytes / GiB
    return {
        "size_mib": float(size_mib),
        "read_layer_gib_s": gib / t_get_layer,
        "read_obstore_gib_s": gib / t_get_base,
        "read_ratio": t_get_base / t_get_layer,
        "upload_layer_gib_s": gib / t_put_layer,
        "upload_obstore_gib_s": gib / t_put_base,
        "upload_ratio": t_put_base / t_put_layer,
        **extra,
    }


def start_moto_process(timeout: float = 30.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m moto.server`` on a free loopback port; returns it and its endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                return proc, endpoint
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the moto server did not start on {endpoint} within {timeout} s")


_CHILD = r"""
import json, sys, time, numpy as np, ckptvar as cv
mode, url, size_mib, opts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
def rss(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024 for l in f if l.startswith(field))
if mode == "save":
    arrays = {f"layer{i}/w": np.full(size_mib << 14, i, np.float32) for i in range(64)}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
base = rss("VmRSS")
t0 = time.perf_counter()
if mode == "save":
    cv.save(url, arrays, storage_options=opts)
else:
    cv.load(url, storage_options=opts)
print(json.dumps({"s": time.perf_counter() - t0, "peak_extra_mib": rss("VmHWM") - base}))
"""


def bench_checkpoints(endpoint: str, *, size_mib: int = 256, repeat: int = 2) -> dict[str, float]:
    """``cv.save``/``cv.load`` on ``s3://`` vs obstore's own calls for as many bytes.

    Each ckptvar call runs in a fresh process (its peak memory above its resident
    set before the call is reported); obstore's run here.
    """
    import obstore

    bucket, opts = _new_bucket(endpoint)
    loc = ObjectStoreLocation(f"s3://{bucket}", storage_options=opts)
    nbytes = size_mib << 20
    data = np.ones(nbytes, np.uint8)
    starts = list(range(0, nbytes, DEFAULT_PART_SIZE))
    lengths = [min(DEFAULT_PART_SIZE, nbytes - s) for s in starts]

    def child(mode: str, url: str) -> dict[str, float]:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, mode, url, str(size_mib), json.dumps(opts)],
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
        )
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    best: dict[str, float] = {}
    peaks: dict[str, float] = {}
    for rep in range(repeat):
        url = f"s3://{bucket}/run/ckpt-{rep}.h5"
        for mode in ("save", "load"):
            got = child(mode, url)
            best[mode] = min(best.get(mode, float("inf")), got["s"])
            peaks[mode] = max(peaks.get(mode, 0.0), got["peak_extra_mib"])
        key = f"raw{rep}.bin"

        def put(key: str = key) -> None:
            obstore.put(
                loc.store,
                key,
                memoryview(data.data),
                chunk_size=DEFAULT_PART_SIZE,
                max_concurrency=DEFAULT_CONCURRENCY,
            )

        def get(key: str = key) -> None:
            obstore.get_ranges(loc.store, key, starts=starts, lengths=lengths)

        best["put"] = min(best.get("put", float("inf")), _best(put, 1))
        best["get"] = min(best.get("get", float("inf")), _best(get, 1))
    gib = nbytes / GiB
    return {
        "size_mib": size_mib,
        "save_gib_s": gib / best["save"],
        "put_obstore_gib_s": gib / best["put"],
        "save_ratio": best["put"] / best["save"],
        "load_gib_s": gib / best["load"],
        "get_ranges_obstore_gib_s": gib / best["get"],
        "load_ratio": best["get"] / best["load"],
        "save_peak_extra_mib": peaks["save"],
        "load_peak_extra_mib": peaks["load"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--endpoint", help="an S3 endpoint (default: start moto on 127.0.0.1)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--no-split", action="store_true", help="skip the default (8 MiB parallel) read"
    )
    parser.add_argument(
        "--checkpoints", action="store_true", help="cv.save/cv.load vs obstore (and peak memory)"
    )
    args = parser.parse_args(argv)
    server = None
    endpoint = args.endpoint
    if endpoint is None:  # moto in its own process, so the server does not share our GIL
        server, endpoint = start_moto_process()
    try:
        if args.checkpoints:
            figures = bench_checkpoints(endpoint, size_mib=args.size_mib, repeat=args.repeat)
            print(json.dumps(figures, indent=1))
            return 0
        figures = bench_cloud(
            endpoint, size_mib=args.size_mib, repeat=args.repeat, split_reads=not args.no_split
        )
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    if args.json:
        print(json.dumps(figures))
    else:
        f = figures
        print(
            f"read   layer {f['read_layer_gib_s']:.2f} GiB/s   obstore get_ranges "
            f"{f['read_obstore_gib_s']:.2f} GiB/s   ratio {f['read_ratio']:.2f}"
            "   (read_part_size=0: one streamed GET)"
        )
        if "read_split_ratio" in f:
            print(
                f"read   layer {f['read_split_gib_s']:.2f} GiB/s   (default: 8 MiB GETs in "
                f"parallel)   ratio {f['read_split_ratio']:.2f}"
            )
        print(
            f"upload layer {f['upload_layer_gib_s']:.2f} GiB/s   obstore put        "
            f"{f['upload_obstore_gib_s']:.2f} GiB/s   ratio {f['upload_ratio']:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
