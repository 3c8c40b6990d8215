"""Running measurements: each one in a fresh process, and the run's log and machine facts.

The ``Runner`` talks to ``scripts/_bench_worker.py``: by default one fork server per
(interpreter, subject) that imported the subject's library once; with ``--spawn`` a
new interpreter per measurement. A result is the worker's ``BENCHRESULT`` line; any
failure (timeout, a server that died, a job that raised) becomes ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.plan import SubjectDef

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "scripts" / "_bench_worker.py"
MARK = "BENCHRESULT "


class Runner:
    """Runs worker jobs: each measurement in its own fresh process.

    By default a measurement is forked from a per-(interpreter, subject) server that
    imported the subject's library once (``_bench_worker.py --serve``); ``--spawn``
    starts a new interpreter for every measurement instead (slower by the imports:
    ~4 s for TensorFlow, ~2 s for torch, ~0.3 s for ckptvar or zarr).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.servers: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self.logs: dict[tuple[str, str], Any] = {}  # each server's stderr
        self.env = dict(os.environ)
        self.env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        self.env.setdefault("OMP_NUM_THREADS", "1")

    def python_for(self, sd: SubjectDef) -> str:
        return self.args.tf_python if sd.tf and self.args.tf_python else sys.executable

    def call(self, python: str, job: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
        if self.args.spawn or "subject" not in job:
            return self._spawn(python, job, timeout)
        return self._serve(python, job, timeout)

    def _spawn(self, python: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            proc = subprocess.run([python, str(WORKER), json.dumps(job)], capture_output=True,
                                  text=True, timeout=timeout, env=self.env,
                                  cwd=str(ROOT))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        return {"error": f"worker exited {proc.returncode}: {proc.stderr.strip()[-800:]}"}

    def _server(self, python: str, subject: str) -> subprocess.Popen[bytes]:
        key = (python, subject)
        srv = self.servers.get(key)
        if srv is None or srv.poll() is not None:
            log = self.logs.get(key) or tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
            srv = subprocess.Popen(
                [python, str(WORKER), "--serve", subject], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=self.env,
                cwd=str(ROOT), start_new_session=True)
            self.servers[key], self.logs[key] = srv, log
        return srv

    def _serve(self, python: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        srv = self._server(python, job["subject"])
        assert srv.stdin is not None and srv.stdout is not None
        try:
            srv.stdin.write((json.dumps(job) + "\n").encode())
            srv.stdin.flush()
        except BrokenPipeError:
            return self._server_died(python, job["subject"])
        deadline = time.monotonic() + timeout
        fd, buf = srv.stdout.fileno(), b""
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.startswith(MARK.encode()):
                    return json.loads(line[len(MARK):])
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._stop(python, job["subject"], kill=True)
                return {"error": f"timed out after {timeout:.0f} s"}
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return self._server_died(python, job["subject"])
            buf += chunk

    def _server_died(self, python: str, subject: str) -> dict[str, Any]:
        srv = self.servers.pop((python, subject))
        self._reap(srv)
        log = self.logs[(python, subject)]
        log.seek(0)
        err = log.read()[-800:].decode(errors="replace").strip()
        log.seek(0)
        log.truncate()
        return {"error": f"worker server exited {srv.returncode}: {err}"}

    def _stop(self, python: str, subject: str, kill: bool = False) -> None:
        srv = self.servers.pop((python, subject), None)
        if srv is None:
            return
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(srv.pid, signal.SIGKILL)
        self._reap(srv)

    @staticmethod
    def _reap(srv: subprocess.Popen[bytes]) -> None:
        """Close the server's pipes (closing stdin stops a live one) and wait for it."""
        for pipe in (srv.stdin, srv.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()
        srv.wait()

    def close(self) -> None:
        """Stop every server (they exit when their stdin closes)."""
        for python, subject in list(self.servers):
            self._stop(python, subject)
        for log in self.logs.values():
            log.close()
        self.logs.clear()


LOG: list[str] = []


def say(msg: str) -> None:
    LOG.append(msg)
    print(msg, file=sys.stderr, flush=True)


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1.0


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        pass
    return info
