"""The ``cloud`` workload: checkpoints on an S3 server against obstore's own calls.

Run ``python -m benchmarks.cloud [--quick] [--repeats N] [--json]`` (or
``python scripts/bench.py --only cloud``); needs the ``cloud`` extra (obstore) and
``moto[server]``. It starts moto's S3 server in its own process on 127.0.0.1 and,
for the ``big`` model of :mod:`benchmarks.workloads` (149 float32 tensors, ~1 GiB;
~1 MiB with ``--quick``), measures in one run:

- ``save``: ``cv.save("s3://...")`` against obstore's multipart ``put`` of as many
  bytes (8 MiB parts, 8 in flight);
- ``load``: ``cv.load("s3://...")`` against obstore's ``get_ranges`` of the whole
  committed data object (8 MiB ranges; obstore merges adjacent ones);
- ``lazy``: ``cv.open(url)[key][:]`` of one 16 MiB tensor: the bytes that crossed the
  socket and the GET requests, counted by a TCP proxy in front of the server (the
  open itself counted apart);
- the peak resident memory of each call above the process's own before it (VmHWM
  after ``/proc/self/clear_refs``), as a ratio to the checkpoint's bytes.

Every call runs in a fresh process; ckptvar's and obstore's runs alternate; each
figure is the median of ``--repeats``. Uses ckptvar's public API only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from typing import Any

import numpy as np
import obstore
from obstore.store import from_url

import ckptvar as cv
from benchmarks.workloads import LAZY_KEY, MiB, make_arrays, model_spec, spec_nbytes

PART = 8 * MiB
CONCURRENCY = 8


# --- the server and a counting proxy ------------------------------------------------------
def start_moto(timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m moto.server`` on a free loopback port: the process and its endpoint."""
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


def make_bucket(endpoint: str) -> tuple[str, dict[str, Any]]:
    """A new bucket on the server: its name and the storage options that reach it."""
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    req = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
    return bucket, options_for(endpoint)


def options_for(endpoint: str) -> dict[str, Any]:
    return {
        "endpoint": endpoint,
        "access_key_id": "bench",
        "secret_access_key": "bench",
        "region": "us-east-1",
        "allow_http": True,
        "timeout": "600s",
    }


class CountingProxy:
    """A TCP proxy on 127.0.0.1: bytes each way, and requests by their verb (a new
    HTTP/1.1 request on a connection starts a new chunk from the client: GETs have no body
    and the client waits for each response)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._lock = threading.Lock()
        self.bytes_down = self.bytes_up = 0
        self.requests: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def reset(self) -> None:
        with self._lock:
            self.bytes_down, self.bytes_up, self.requests = 0, 0, {}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                continue
            server = socket.create_connection(self._upstream, timeout=60)
            for src, dst, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    if up:
                        self.bytes_up += len(data)
                        verb = data.split(b" ", 1)[0].decode("latin-1")
                        if verb in ("GET", "HEAD", "PUT", "POST", "DELETE"):
                            self.requests[verb] = self.requests.get(verb, 0) + 1
                    else:
                        self.bytes_down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()


# --- one measured call, in a fresh process ------------------------------------------------
def _rss(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field))


def child(job: dict[str, Any]) -> dict[str, float]:
    """Run one call of ``job`` here; its time and peak memory above the resident set before."""
    op, opts, url = job["op"], job["options"], job["url"]
    spec = model_spec(job["quick"])
    arrays = make_arrays(spec) if op == "save" else None
    store = _store(job["bucket"], opts)
    raw = np.ones(spec_nbytes(spec), np.uint8) if op == "put" else None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    base = _rss("VmRSS")
    t0 = time.perf_counter()
    if op == "save":
        cv.save(url, arrays or {}, storage_options=opts)
    elif op == "load":
        out = cv.load(url, storage_options=opts)
        assert len(out) == len(spec)
    elif op == "put":
        assert raw is not None
        obstore.put(store, job["key"], memoryview(raw.data), chunk_size=PART,
                    max_concurrency=CONCURRENCY)
    elif op == "get_ranges":
        size = int(obstore.head(store, job["key"])["size"])
        starts = list(range(0, size, PART))
        got = obstore.get_ranges(store, job["key"], starts=starts,
                                 lengths=[min(PART, size - s) for s in starts])
        assert sum(len(g) for g in got) == size
    else:
        raise ValueError(f"unknown op {op!r}")
    return {"s": time.perf_counter() - t0, "peak_extra_mib": _rss("VmHWM") - base}


def _run_child(job: dict[str, Any]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.cloud", "--child", json.dumps(job)],
        capture_output=True, text=True, timeout=1800, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{job['op']} failed: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# --- the workload -------------------------------------------------------------------------
def _store(bucket: str, opts: dict[str, Any]) -> Any:
    config = {k: v for k, v in opts.items() if k not in ("allow_http", "timeout")}
    # Generous timeouts: the machine may be busy, and a timed-out part fails the baseline.
    return from_url(f"s3://{bucket}", config=config,
                    client_options={"allow_http": True, "timeout": "600s"})


def _data_key(bucket: str, opts: dict[str, Any], step: str) -> str:
    """The object a committed step's marker names (its data, a key beside the step)."""
    marker = obstore.get(_store(bucket, opts), f"{step}.commit").bytes()
    parent = step.rpartition("/")[0]
    return f"{parent}/{json.loads(bytes(marker))['data']}".lstrip("/")


def _lazy(endpoint: str, bucket: str, opts: dict[str, Any], step: str) -> dict[str, float]:
    proxy = CountingProxy(endpoint)
    try:
        url = f"s3://{bucket}/{step}"
        with cv.open(url, storage_options={**opts, "endpoint": proxy.endpoint}) as reader:
            opened = dict(proxy.requests)
            open_bytes = proxy.bytes_down
            proxy.reset()
            value = reader[LAZY_KEY][:]
            time.sleep(0.05)  # let the proxy's threads count the last bytes
            return {
                "lazy_value_mib": value.nbytes / MiB,
                "lazy_read_mib": proxy.bytes_down / MiB,
                "lazy_read_gets": proxy.requests.get("GET", 0),
                "lazy_read_other": sum(proxy.requests.values()) - proxy.requests.get("GET", 0),
                "open_requests": sum(opened.values()),
                "open_kib": open_bytes / 1024,
            }
    finally:
        proxy.close()


def run(quick: bool, repeats: int, endpoint: str | None = None) -> dict[str, Any]:
    """Every figure of the workload (medians of ``repeats``), as a dict."""
    server = None
    if endpoint is None:  # moto in its own process, so the server does not share our GIL
        server, endpoint = start_moto()
    try:
        bucket, opts = make_bucket(endpoint)
        nbytes = spec_nbytes(model_spec(quick))
        times: dict[str, list[float]] = {}
        peaks: dict[str, list[float]] = {}
        job = {"quick": quick, "options": opts, "bucket": bucket, "url": "", "key": ""}

        def measure(op: str, **extra: Any) -> None:
            got = _run_child({**job, "op": op, **extra})
            times.setdefault(op, []).append(got["s"])
            peaks.setdefault(op, []).append(got["peak_extra_mib"])

        for rep in range(repeats):
            step = f"run/ckpt-{rep}.h5"
            measure("save", url=f"s3://{bucket}/{step}")
            measure("put", key=f"raw-{rep}.bin")
            data = _data_key(bucket, opts, step)
            measure("load", url=f"s3://{bucket}/{step}")
            measure("get_ranges", key=data)
        lazy = _lazy(endpoint, bucket, opts, "run/ckpt-0.h5")
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    med = {op: statistics.median(v) for op, v in times.items()}
    gib = nbytes / 2**30
    data_mib = nbytes / MiB
    return {
        "data_mib": data_mib,
        "repeats": repeats,
        "save_s": med["save"], "put_s": med["put"],
        "save_gib_s": gib / med["save"], "put_gib_s": gib / med["put"],
        "save_ratio": med["put"] / med["save"],
        "load_s": med["load"], "get_ranges_s": med["get_ranges"],
        "load_gib_s": gib / med["load"], "get_ranges_gib_s": gib / med["get_ranges"],
        "load_ratio": med["get_ranges"] / med["load"],
        "save_peak_extra_mib": statistics.median(peaks["save"]),
        "load_peak_extra_mib": statistics.median(peaks["load"]),
        "put_peak_extra_mib": statistics.median(peaks["put"]),
        "get_ranges_peak_extra_mib": statistics.median(peaks["get_ranges"]),
        "save_peak_x_data": 1 + statistics.median(peaks["save"]) / data_mib,
        "load_peak_x_data": statistics.median(peaks["load"]) / data_mib,
        "times": times,
        **lazy,
    }


def report(f: dict[str, Any]) -> str:
    return "\n".join([
        f"cloud: {f['data_mib']:.0f} MiB model against moto on loopback, median of "
        f"{f['repeats']}",
        f"{'op':<8}{'ckptvar s':>11}{'obstore s':>11}{'GiB/s':>8}{'ratio':>8}"
        f"{'peak +MiB':>11}",
        f"{'save':<8}{f['save_s']:>11.2f}{f['put_s']:>11.2f}{f['save_gib_s']:>8.3f}"
        f"{f['save_ratio']:>8.2f}{f['save_peak_extra_mib']:>11.0f}   (obstore multipart put)",
        f"{'load':<8}{f['load_s']:>11.2f}{f['get_ranges_s']:>11.2f}{f['load_gib_s']:>8.3f}"
        f"{f['load_ratio']:>8.2f}{f['load_peak_extra_mib']:>11.0f}   (obstore get_ranges; "
        f"{f['load_peak_x_data']:.3f}x data)",
        f"lazy    {f['lazy_value_mib']:.1f} MiB value: {f['lazy_read_mib']:.2f} MiB over the "
        f"socket in {f['lazy_read_gets']} GET(s) (+{f['lazy_read_other']} other); the open: "
        f"{f['open_requests']} requests, {f['open_kib']:.0f} KiB",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~1 MiB model, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--endpoint", help="an S3 endpoint (default: start moto here)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    repeats = args.repeats or (1 if args.quick else 3)
    figures = run(args.quick, repeats, args.endpoint)
    print(json.dumps(figures) if args.json else report(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
