"""The ``ckpt`` command at its edges, run as real processes: Ctrl-C at any moment,
``--json`` that always parses, paths that look like options, every subcommand taking a
manager's directory as its latest checkpoint, a stderr that is gone.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.cli import main

ROOT = Path(__file__).resolve().parents[1]

#: A ``sitecustomize`` that sends this process a real SIGINT the first time the module
#: named by ``CKPT_INTERRUPT_AT`` is imported: Ctrl-C at a known moment of the start-up.
_SITE = """\
import importlib.abc, os, signal, sys

class _Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("CKPT_INTERRUPT_AT"):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, _Interrupt())
"""


def ckpt(
    *args: object, env: dict[str, str] | None = None, unset: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``python -m ckptvar ARGS`` in a fresh interpreter, with SIGINT's default action, the
    variables ``env`` set and those named in ``unset`` removed."""
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(
        [sys.executable, "-m", "ckptvar", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, "PYTHONPATH": str(ROOT), **(env or {})},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        check=False,
    )


def one_error(proc: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), proc.stderr
    return lines[0].removeprefix("ckpt: error: ")


@pytest.mark.parametrize(
    ("module", "extra"),
    [
        ("ckptvar.cli", ()),  # the command's own modules, at start-up
        ("ckptvar.storage", ("--format", "hf-safetensors")),  # parsing: --format's choices
        ("numpy._core.multiarray", ()),  # NumPy's first import swallows KeyboardInterrupt
    ],
)
def test_ctrl_c_while_starting_or_importing_exits_130_without_a_traceback(
    tmp_path: Path, module: str, extra: tuple[str, ...]
) -> None:
    (tmp_path / "sitecustomize.py").write_text(_SITE)
    src = cv.save(tmp_path / "src.h5", {"w": np.ones(3, np.float32)})
    proc = subprocess.run(
        [sys.executable, "-m", "ckptvar", "convert", src, tmp_path / "out", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
             "CKPT_INTERRUPT_AT": module},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        check=False,
    )
    assert one_error(proc, 130) == "interrupted"
    assert {p.name for p in tmp_path.iterdir()} <= {"sitecustomize.py", "__pycache__", "src.h5"}


def test_show_json_of_several_keys_is_one_json_list(tmp_path: Path) -> None:
    src = cv.save(tmp_path / "m.h5", {"w": np.arange(6.0).reshape(2, 3), "n": np.array(7)})
    proc = ckpt("show", src, "w[1]", "n", "--json")
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)  # one JSON text, not two objects one after the other
    assert [(d["key"], d["index"], d["value"]) for d in docs] == [
        ("w", "[1]", [3.0, 4.0, 5.0]), ("n", None, 7)]


def test_every_command_takes_a_manager_directory_as_its_latest_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    step = cv.Variable(np.zeros(3, np.float32), name="w")
    manager = cv.CheckpointManager(cv.Checkpoint(w=step), runs, max_to_keep=2)
    for n in (1, 2):
        step.assign(np.full(3, n, np.float32))
        manager.save(checkpoint_number=n)
    latest = runs / "ckpt-2.h5"
    said = f"ckpt: reading {latest}, the latest checkpoint of {str(runs)!r}\n"
    proc = ckpt("verify", runs)  # as `ckpt inspect runs` does: it said "is a directory"
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "OK: 2 values verified\n", said)
    assert main(["show", str(runs), "w", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["value"] == [2.0, 2.0, 2.0] and err == said
    assert main(["diff", str(runs), str(latest)]) == 0
    assert capsys.readouterr().err == said
    assert main(["convert", str(runs), str(tmp_path / "out.npz")]) == 0
    assert capsys.readouterr().err == said
    assert np.load(tmp_path / "out.npz")["w"].tolist() == [2.0, 2.0, 2.0]
    assert main(["verify", str(tmp_path)]) == 2  # no manager's directory: the error says so
    assert "is a directory, not a checkpoint" in capsys.readouterr().err


def test_a_path_that_starts_with_a_dash_gets_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    cv.save("-w.h5", {"w": np.ones(2)})
    assert main(["verify", "-w.h5"]) == 2  # argparse takes it for an option
    assert capsys.readouterr().err == (
        "ckpt: error: the following arguments are required: PATH ('-w.h5' is taken for an "
        "option: put -- before a path that starts with '-')\n")
    assert main(["verify", "--", "-w.h5"]) == 0
    assert main(["verify", "-w"]) == 2  # no such file: the usual hint
    assert capsys.readouterr().err.endswith("(see 'ckpt verify --help')\n")


def test_an_object_store_that_never_answers_times_out_and_says_so(tmp_path: Path) -> None:
    with socket.socket() as server:  # accepts connections, never answers a request
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        proc = ckpt(
            "inspect", "s3://bucket/run/ckpt-1.h5",
            "--storage-option", f"endpoint={endpoint}", "--storage-option", "allow_http=true",
            "--storage-option", "timeout=500ms", "--storage-option", "max_retries=0",
            env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "r"},
        )
    message = one_error(proc)  # within the timeout, not hanging
    assert message.startswith("GET s3://bucket/run/ckpt-1.h5.commit failed")
    assert message.endswith("the server did not answer within the request's timeout "
                            "(storage_options timeout: 500ms)")


class _Refusing(http.server.BaseHTTPRequestHandler):
    """An instance metadata service that refuses every request (as off EC2)."""

    def do_PUT(self) -> None:
        self.send_response(403)
        self.send_header("content-length", "0")
        self.end_headers()

    do_GET = do_PUT

    def log_message(self, *args: object) -> None:
        pass


def test_an_object_store_read_without_credentials_says_how_to_give_them() -> None:
    imds = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=imds.serve_forever, daemon=True).start()
    try:
        proc = ckpt(
            "ls", "s3://bucket/run", "--storage-option", "endpoint=http://127.0.0.1:1",
            "--storage-option", "allow_http=true", "--storage-option",
            f"metadata_endpoint=http://127.0.0.1:{imds.server_address[1]}",
            unset=tuple(k for k in os.environ if k.startswith("AWS_") and k != "AWS_CA_BUNDLE"),
        )
    finally:
        imds.shutdown()
        imds.server_close()
    assert one_error(proc).endswith(
        "no credentials were found (the client asked the EC2 instance metadata service): give "
        "access_key_id and secret_access_key in storage_options, or set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY")


@pytest.mark.slow  # a value of 1 GiB, written and verified
def test_verify_moves_the_bar_within_a_large_value(tmp_path: Path) -> None:
    src = cv.save(tmp_path / "one.h5", {"w": np.ones(1 << 27, np.float64)})  # 1 GiB
    code = ("import sys, ckptvar.cli._common as c; c.PROGRESS_DELAY = 0; "
            "from ckptvar.cli import main; sys.exit(main(sys.argv[1:]))")
    leader, follower = pty.openpty()  # stderr is a terminal: the bar is drawn
    with subprocess.Popen([sys.executable, "-c", code, "verify", str(src)],
                          stdout=subprocess.PIPE, stderr=follower,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        os.close(follower)
        drawn = b""
        with contextlib.suppress(OSError):  # EIO once the command has ended
            while chunk := os.read(leader, 1 << 16):
                drawn += chunk
        assert proc.wait(timeout=300) == 0
        assert proc.stdout is not None and proc.stdout.read() == b"OK: 1 value verified\n"
    os.close(leader)
    within = [int(m) for m in re.findall(rb"\] +(\d+)% [^\r]*\(0 values\) w", drawn)]
    assert any(0 < p < 100 for p in within), drawn[-300:]


def test_help_imports_no_framework() -> None:
    """``ckpt --help`` (and convert's, which lists the writable formats) loads no
    PyTorch, JAX or TensorFlow: they take seconds to import, and no help needs them."""
    for args in (("--help",), ("convert", "--help")):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptvar", *args],
                              capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0 and "usage: ckpt" in proc.stdout, proc.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                    for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert "ckptvar" in imported
        assert not imported & {"torch", "jax", "jaxlib", "tensorflow", "cupy", "mpi4py"}, args


def test_ls_of_a_checkpoint_folder_says_what_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    run = ROOT / "fixtures" / "orbax" / "run"  # an Orbax run: steps 2 and 10, no manager's
    assert main(["ls", str(run)]) == 0
    assert capsys.readouterr().out == (
        f"No checkpoints in {run}\n"
        f"{run} is itself a checkpoint (orbax): 'ckpt inspect {run}' reads it\n")
    assert main(["ls", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint_format"] == "orbax"


def test_an_error_with_stderr_closed_still_exits_2(tmp_path: Path) -> None:
    """``ckpt verify x 2>&-``: the message has nowhere to go, the status still tells."""
    proc = subprocess.run([sys.executable, "-m", "ckptvar", "verify", str(tmp_path / "no.h5")],
                          stdout=subprocess.PIPE, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)},
                          preexec_fn=lambda: os.close(2))
    assert (proc.returncode, proc.stdout) == (2, b"")


def test_verify_json_names_each_damaged_value(tmp_path: Path) -> None:
    src = cv.save(tmp_path / "m.h5", {"w": np.full(64, 1234.5678), "n": np.arange(3)})
    data = bytearray(src.read_bytes())
    data[data.find(np.full(64, 1234.5678).tobytes()) + 9] ^= 1  # one bit of w
    src.write_bytes(data)
    proc = ckpt("verify", src, "--json")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert {k: doc[k] for k in ("path", "format", "status", "values", "unchecked")} == {
        "path": str(src), "format": "h5", "status": "damaged", "values": 2, "unchecked": 0}
    assert [d["key"] for d in doc["damaged"]] == ["w"] and "checksum" in doc["damaged"][0]["reason"]


def test_gc_json_says_what_it_removed_and_what_a_step_keeps(
        tmp_path: Path, fresh_graph: cv.Graph, capsys: pytest.CaptureFixture[str]) -> None:
    """``ckpt gc --json``: one JSON object on stdout (what it removed or, with --dry-run,
    would remove, the bytes freed, and the steps kept because a later step refers to
    their bytes); nothing else on stdout."""
    rng = np.random.default_rng(0)
    frozen = cv.Variable(rng.random(20_000, dtype=np.float32), name="frozen")
    head = cv.Variable(np.zeros(20_000, np.float32), name="head")
    run = tmp_path / "run"
    manager = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, head=head), run,
                                   max_to_keep=1, incremental=True)
    manager.save()
    head.assign_add(1)
    manager.save()
    manager.wait_until_finished()
    leftover = run / ".ckpt-3.h5.0123456789abcdef0123456789abcdef.partial"
    leftover.write_bytes(b"x" * 10)
    for dry in (True, False):
        if dry:  # the command itself: stdout is the JSON object alone
            proc = ckpt("gc", run, "--json", "--dry-run")
            assert proc.returncode == 0, proc.stderr
            got = json.loads(proc.stdout)
        else:
            assert main(["gc", str(run), "--json"]) == 0
            got = json.loads(capsys.readouterr().out)
        mine = [r for r in got["removed"] if r["path"].startswith(str(run))]
        assert mine == [{"path": str(leftover), "what": "temporary", "bytes": 10}], got
        assert got["dry_run"] is dry and got["path"] == str(run)
        assert got["bytes_freed"] == sum(r["bytes"] for r in got["removed"])
        assert got["kept"] == [{"path": str(run / "ckpt-1.h5"),
                                "referred_by": ["ckpt-2.h5"]}], got
        assert leftover.exists() is dry


def test_every_subcommand_takes_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``-q``/``--quiet`` means the same in every subcommand: no progress bar, no note on
    stderr (which checkpoint a manager's directory stands for); errors still said."""
    run = tmp_path / "run"
    cv.CheckpointManager(cv.Checkpoint(w=cv.Variable(np.arange(4.0), name="w")), run).save()
    step = str(run / "ckpt-1.h5")
    proc = ckpt("show", run, "w", "--quiet")  # the command itself: nothing on stderr
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert "0." in proc.stdout
    assert main(["show", str(run), "w"]) == 0
    assert "ckpt: reading" in capsys.readouterr().err
    for args in (["inspect", str(run)], ["show", str(run), "w"], ["verify", str(run)],
                 ["diff", str(run), step], ["ls", str(run)], ["gc", str(run)],
                 ["convert", str(run), str(tmp_path / "w.npz")]):
        assert main([*args, "-q"]) == 0, (args, capsys.readouterr())
        assert capsys.readouterr().err == "", args
    assert main(["show", str(tmp_path / "none.h5"), "w", "-q"]) == 2
    assert capsys.readouterr().err.startswith("ckpt: error: ")


def test_convert_help_loads_no_format_module() -> None:
    """``ckpt convert --help`` names the writable formats without loading the storage
    registry (h5py, zarr, the format modules): it printed in 0.85 s, ``ckpt --help`` in 0.1."""
    code = ("import sys\nfrom ckptvar.cli import main\n"
            "assert main(['convert', '--help']) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'zarr', 'h5py', 'torch', 'safetensors'} or m.startswith('ckptvar.storage') "
            "or m.startswith('ckptvar.formats')), file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == "[]\n"
    assert "output format (h5, zarr, safetensors, hf-safetensors, npz)" in " ".join(
        proc.stdout.split())


def test_convert_help_lists_every_writable_format() -> None:
    """The writable formats ``ckpt convert --help`` names without the registry are the
    registry's."""
    from ckptvar.cli.convert import WRITABLE_FORMATS

    assert list(WRITABLE_FORMATS) == cv.storage.writable_formats()
