"""The ``ckpt`` command through real subprocesses: exit codes, output, ``--json``.

Checkpoints are written with ``cv.save``; the command runs as ``python -m ckptvar``
(and once as the installed ``ckpt`` entry point). The pure helpers (block
iteration, streaming stats, escaping) are also tested in-process.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.cli import Stats, escape, iter_blocks, main

PATTERN = np.full(256, 1234.5678, dtype=np.float64)  # easy to find in the file's bytes


def _cmd(args: tuple[str | Path, ...]) -> list[str]:
    return [sys.executable, "-m", "ckptvar", *map(str, args)]


_ENV = dict(os.environ, PYTHONWARNINGS="error", COLUMNS="100")


def ckpt(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run ``ckpt ARGS`` in a fresh interpreter."""
    return subprocess.run(_cmd(args), capture_output=True, text=True, timeout=120, env=_ENV)


def ckpt_many(*commands: tuple[str | Path, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Run several independent ``ckpt`` commands at once (start-up dominates their cost)."""
    procs = [
        subprocess.Popen(
            _cmd(c), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_ENV
        )
        for c in commands
    ]
    done = []
    for c, p in zip(commands, procs, strict=True):
        out, err = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(_cmd(c), p.returncode, out, err))
    return done


def run_main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """Run ``ckpt ARGS`` in this process (for the many small cases); (status, stdout, stderr)."""
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_usage_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckpt: error: ")
    for w in words:
        assert w in lines[0]


def values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "model/dense/kernel": rng.standard_normal((4, 3)).astype(np.float32),
        "model/dense/bias": np.array([0.5, -1.0, 2.0], dtype=np.float32),
        "model/embedding": np.array([[1.0, np.nan], [np.inf, -3.0]], dtype=np.float64),
        "model/pattern": PATTERN,
        "step": np.array(7, dtype=np.int64),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")
    a = values()
    cv.save(
        d / "a.h5",
        a,
        attrs={"step": {"trainable": False}},
        metadata={"note": "evil\x1b[2Jtext\x07"},
    )
    b = dict(a)
    b["model/dense/kernel"] = a["model/dense/kernel"] + np.float32(1e-3)
    del b["model/pattern"]
    b["model/extra"] = np.zeros(2, np.float32)
    cv.save(d / "b.h5", b)
    cv.save(d / "a_copy.zarr", a)
    return {"dir": d, "a": d / "a.h5", "b": d / "b.h5", "zarr": d / "a_copy.zarr"}


# ----------------------------------------------------------------------------- usage


def test_version_help_and_entry_point() -> None:
    exe = Path(sys.executable).with_name("ckpt")
    assert exe.exists(), "the ckpt console script is not installed (pip install -e .)"
    entry = subprocess.Popen(
        [str(exe), "convert", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    version, helped = ckpt_many(("--version",), ("--help",))
    out, _ = entry.communicate(timeout=120)
    assert version.returncode == 0
    assert version.stdout.strip() == f"ckpt (ckptvar) {cv.__version__}"
    assert helped.returncode == 0
    for word in ("inspect", "convert", "diff", "verify", "ls", "examples:", "exit status"):
        assert word in helped.stdout
    # The console script installed next to this interpreter is the same command.
    assert entry.returncode == 0
    assert "--rename FROM=TO" in out and "bfloat16" in out and "examples:" in out


def test_bad_usage_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    nothing, bogus = ckpt_many((), ("inspect", "x.h5", "--bogus"))
    assert_usage_error(nothing, "COMMAND")
    assert_usage_error(bogus, "--bogus", "ckpt inspect --help")
    cases = [
        (["inspect"], "PATH"),
        (["frobnicate"], "frobnicate"),
        (["convert", "a.h5", "b.h5", "--dtype", "int8"], "int8"),
        (["convert", "a.h5", "b.h5", "--rename", "noequals"], "FROM=TO"),
        (["convert", "a.h5", "b.h5", "--rename", "(=x"], "regex"),
        (["diff", "a.h5", "b.h5", "--atol", "-1"], "--atol"),
        (["diff", "a.h5"], "B"),
    ]
    for argv, word in cases:
        code, out, err = run_main(capsys, *argv)
        assert code == 2, argv
        assert out == ""
        assert err.count("\n") == 1 and err.startswith("ckpt: error: ") and word in err, err


def test_missing_and_unreadable_inputs_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(ckpt("inspect", tmp_path / "nothere.h5"), "nothere.h5")
    junk = tmp_path / "notes.txt"
    junk.write_text("hello\n")
    for argv in (
        ["verify", tmp_path / "nothere.h5"],
        ["inspect", junk],
        ["convert", junk, tmp_path / "out.h5"],
        ["diff", tmp_path / "nothere.h5", junk],
        ["ls", tmp_path / "nodir"],
        ["ls", junk],
    ):
        code, out, err = run_main(capsys, *argv)
        assert code == 2, (argv, out, err)
        assert err.count("\n") == 1 and err.startswith("ckpt: error: "), err
        assert Path(argv[1]).name in err


# ----------------------------------------------------------------------------- inspect


def test_inspect_table_json_tree_filter(files: dict[str, Path]) -> None:
    table, as_json, tree, filtered = ckpt_many(
        ("inspect", files["a"]),
        ("inspect", files["a"], "--json", "--stats"),
        ("inspect", files["zarr"], "--tree"),
        ("inspect", files["a"], "--json", "--filter", "model/dense/*"),
    )
    # The table: one row per value, a totals line, and the metadata with control
    # characters escaped (the file's note holds ESC and BEL).
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert "format: h5" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("KEY"))
    assert header.split() == ["KEY", "DTYPE", "SHAPE", "SIZE", "TRAINABLE"]
    kernel = next(line for line in lines if line.startswith("model/dense/kernel"))
    assert "float32" in kernel and "(4, 3)" in kernel and "48 B" in kernel
    step = next(line for line in lines if line.startswith("step "))
    assert "int64" in step and "()" in step and step.split()[-1] == "no"
    assert "5 variables, 276 elements" in out
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b[2Jtext\\x07" in out

    # --json --stats: exactly the documented object, stats computed over finite elements.
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert set(doc) == {"path", "format", "metadata", "variables", "skipped"}
    assert doc["skipped"] == []
    assert doc["format"] == "h5" and doc["path"] == str(files["a"])
    by_key = {v["key"]: v for v in doc["variables"]}
    a = values()
    assert set(by_key) == set(a)
    for key, rec in by_key.items():
        assert set(rec) == {
            "key",
            "name",
            "dtype",
            "shape",
            "nbytes",
            "trainable",
            "attrs",
            "min",
            "max",
            "mean",
            "std",
            "nan",
            "inf",
        }
        assert rec["name"] == key
        assert rec["dtype"] == a[key].dtype.name
        assert rec["shape"] == list(a[key].shape)
        assert rec["nbytes"] == a[key].nbytes
    assert by_key["step"]["trainable"] is False
    k = by_key["model/dense/kernel"]
    kernel = a["model/dense/kernel"].astype(np.float64)
    assert k["min"] == pytest.approx(kernel.min()) and k["max"] == pytest.approx(kernel.max())
    assert k["mean"] == pytest.approx(kernel.mean()) and k["std"] == pytest.approx(kernel.std())
    assert (k["nan"], k["inf"]) == (0, 0)
    e = by_key["model/embedding"]  # [[1, nan], [inf, -3]]
    assert (e["nan"], e["inf"], e["min"], e["max"], e["mean"]) == (1, 1, -3.0, 1.0, -1.0)

    # --tree: the object graph.
    assert tree.returncode == 0, tree.stderr
    assert "format: zarr" in tree.stdout
    tree_lines = tree.stdout.splitlines()
    assert any(line.startswith(("├── model", "└── model")) for line in tree_lines)
    dense = ("│   ├── dense", "│   └── dense", "    ├── dense", "    └── dense")
    assert any(line.startswith(dense) for line in tree_lines)
    kernel_line = next(line for line in tree_lines if "── kernel" in line)
    assert kernel_line.startswith(("│   │   ", "│       ", "    │   ", "        "))
    assert "[float32 (4, 3) 48 B]" in kernel_line

    # --filter: fnmatch on keys.
    keys = [v["key"] for v in json.loads(filtered.stdout)["variables"]]
    assert sorted(keys) == ["model/dense/bias", "model/dense/kernel"]


def test_inspect_escapes_hostile_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Control/format characters in keys, names and metadata never reach the terminal raw."""
    import unicodedata

    key = "a\x1b[31mred\x07/\u202eb"
    path = cv.save(
        tmp_path / "evil.h5",
        {key: np.zeros(2, np.float32), "ok": np.ones(1)},
        attrs={"ok": {"name": "n\x00ame\u2028x"}},
        metadata={"k\x1b": ["v\x9b", {"z": "q\r"}]},
    )
    table = ckpt("inspect", path)  # the bytes a terminal would get
    tree = run_main(capsys, "inspect", path, "--tree")
    as_json = run_main(capsys, "inspect", path, "--json")
    for code, out in ((table.returncode, table.stdout), tree[:2], as_json[:2]):
        assert code == 0
        bad = [c for c in out if c != "\n" and unicodedata.category(c)[0] in "CZ" and c != " "]
        assert bad == [], bad
    assert "a\\x1b[31mred\\x07/\\u202eb" in table.stdout
    assert "k\\x1b: [v\\x9b, {z: q\\x0d}]" in table.stdout
    assert "name 'n\\x00ame\\u2028x'" in tree[1]
    doc = json.loads(as_json[1])  # still valid JSON, and the key comes back exactly
    assert [v["key"] for v in doc["variables"]] == [key, "ok"]
    assert doc["variables"][1]["name"] == "n\x00ame\u2028x"


# ----------------------------------------------------------------------------- convert


def test_convert_round_trip_through_every_writable_format(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chain = [
        files["a"],
        tmp_path / "x.zarr",
        tmp_path / "x.safetensors",
        tmp_path / "x.npz",
        tmp_path / "back.h5",
    ]
    proc = ckpt("convert", chain[0], chain[1])  # one real process, the rest in-process
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no progress bar on a pipe unless asked
    assert "Wrote 5 values" in proc.stdout and "(h5)" in proc.stdout
    for src, dst in itertools.pairwise(chain[1:]):
        code, out, err = run_main(capsys, "convert", src, dst)
        assert code == 0, err
        assert "Wrote 5 values" in out and err == ""
    proc = ckpt("diff", files["a"], chain[-1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Equal: 5 values (5 identical" in proc.stdout
    back = cv.load(chain[-1])
    for key, value in values().items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape
        np.testing.assert_array_equal(back[key], value)


def test_convert_dtype_rename_progress(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "half.h5"
    proc = ckpt(
        "convert",
        files["a"],
        dst,
        "--dtype",
        "bfloat16",
        "--rename",
        "^model/=net/",
        "--rename",
        r"dense/(\w+)$=fc.\1",
        "--progress",
    )
    assert proc.returncode == 0, proc.stderr
    assert "100%" in proc.stderr and "\r" not in proc.stderr  # plain lines on a pipe
    with cv.open(dst) as reader:
        assert sorted(reader.keys()) == sorted(
            ["net/fc.kernel", "net/fc.bias", "net/embedding", "net/pattern", "step"]
        )
        assert reader.info("net/fc.kernel").dtype.name == "bfloat16"
        assert reader.info("net/fc.kernel").attrs["name"] == "model/dense/kernel"
        assert reader.info("step").dtype == np.int64  # integers are never cast
        assert reader.info("step").attrs["trainable"] is False
        kernel = reader.read("net/fc.kernel").astype(np.float32)
    np.testing.assert_allclose(kernel, values()["model/dense/kernel"], rtol=1e-2)
    # Refuses to overwrite without --force, a rename that merges keys, and an empty filter.
    before = dst.read_bytes()
    for argv, word in (
        (["convert", files["a"], dst], "--force"),
        (["convert", files["a"], tmp_path / "m.h5", "--rename", ".*=same"], "same"),
        (["convert", files["a"], tmp_path / "m.h5", "--filter", "nope*"], "nope"),
        (["convert", files["a"], files["a"], "--force"], "same path"),
        (["convert", files["a"], tmp_path / "m.h5", "--rename", r"(model)=\2"], "group"),
    ):
        code, _, err = run_main(capsys, *argv)
        assert code == 2 and word in err and err.count("\n") == 1, err
    assert dst.read_bytes() == before
    assert not (tmp_path / "m.h5").exists()
    # --force replaces; --filter picks values; --format overrides the suffix.
    code, _, err = run_main(
        capsys, "convert", files["a"], tmp_path / "w.bin", "--format", "npz", "--filter", "step"
    )
    assert code == 0, err
    with cv.open(tmp_path / "w.bin", format="npz") as reader:
        assert list(reader.keys()) == ["step"]
    code, _, err = run_main(capsys, "convert", files["b"], dst, "--force")
    assert code == 0, err
    assert "model/extra" in {k for k, _, _ in cv.list_variables(dst)}


# ----------------------------------------------------------------------------- diff


def test_diff_exit_codes_and_json(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    different, tolerant = ckpt_many(
        ("diff", files["a"], files["b"]),
        ("diff", files["a"], files["b"], "--atol", "0.01", "--json"),
    )
    code, out, err = run_main(capsys, "diff", files["a"], files["zarr"])
    assert code == 0, out + err
    assert out == "Equal: 5 values (5 identical, 0 within atol=0, rtol=0)\n"
    assert different.returncode == 1
    out = different.stdout
    assert "only in A  model/pattern" in out
    assert "only in B  model/extra" in out
    kernel_line = next(line for line in out.splitlines() if "model/dense/kernel" in line)
    assert kernel_line.startswith("different") and "12 of 12 elements" in kernel_line
    assert tolerant.returncode == 1  # the missing/extra keys still differ
    doc = json.loads(tolerant.stdout)
    assert doc["equal"] is False
    assert doc["only_in_a"] == ["model/pattern"] and doc["only_in_b"] == ["model/extra"]
    kernel = next(v for v in doc["values"] if v["key"] == "model/dense/kernel")
    assert kernel["status"] == "close" and kernel["beyond_tolerance"] == 0
    assert kernel["max_abs"] == pytest.approx(1e-3, rel=1e-2)
    emb = next(v for v in doc["values"] if v["key"] == "model/embedding")
    assert emb["status"] == "equal"  # NaN matches NaN, Inf matches Inf


def test_diff_shape_dtype_and_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cv.save(
        tmp_path / "p.h5",
        {
            "w": np.ones((2, 2), np.float32),
            "v": np.array([1.0, np.nan]),
            "i": np.array([2**53 + 1], np.int64),
        },
    )
    cv.save(
        tmp_path / "q.h5",
        {
            "w": np.ones((2, 3), np.float32),
            "v": np.array([1.0, 2.0]),
            "i": np.array([2**53], np.int64),
        },
    )
    cv.save(
        tmp_path / "r.npz",
        {
            "w": np.ones((2, 2), np.float64),
            "v": np.array([1.0, np.nan]),
            "i": np.array([2**53 + 1], np.int64),
        },
    )
    code, out, err = run_main(capsys, "diff", tmp_path / "p.h5", tmp_path / "q.h5", "--json")
    assert code == 1, err
    by_key = {v["key"]: v for v in json.loads(out)["values"]}
    assert by_key["w"]["status"] == "shape"
    assert by_key["w"]["shape_a"] == [2, 2] and by_key["w"]["shape_b"] == [2, 3]
    assert by_key["v"]["status"] == "different" and by_key["v"]["max_abs"] == "nan"  # NaN vs 2
    assert by_key["v"]["nan_mismatch"] == 1
    assert by_key["i"]["status"] == "different"  # exact for integers beyond float64's precision
    code, out, err = run_main(capsys, "diff", tmp_path / "p.h5", tmp_path / "r.npz")
    assert code == 1
    assert "dtype      w  float32 -> float64  max abs 0" in out


@pytest.mark.parametrize("tolerances", [(), ("--rtol", "0.5"), ("--atol", "1e300")])
def test_diff_a_number_against_an_infinity_in_b_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tolerances: tuple[str, ...]
) -> None:
    """B is the reference, ``rtol * |b|`` is NaN or inf when b is infinite: a finite value
    (or the other infinity) against it was "close" and the diff exited 0."""
    cv.save(tmp_path / "a.h5", {"v": np.array([1.0, 2.0, np.inf, np.inf], np.float16)})
    cv.save(tmp_path / "b.h5", {"v": np.array([1.0, np.inf, -np.inf, np.inf], np.float16)})
    code, out, err = run_main(capsys, "diff", tmp_path / "a.h5", tmp_path / "b.h5", "--json",
                              *tolerances)
    assert code == 1, out
    (v,) = json.loads(out)["values"]
    assert (v["status"], v["beyond_tolerance"]) == ("different", 2), v
    assert v["max_abs"] == v["max_rel"] == "inf", v
    code, out, _ = run_main(capsys, "diff", tmp_path / "b.h5", tmp_path / "b.h5")
    assert code == 0, out


# ----------------------------------------------------------------------------- verify


def _flip_byte_in_pattern(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(PATTERN.tobytes()[:64])
    assert at >= 0, "the test pattern is not stored contiguously in the file"
    data[at + 100] ^= 0x40
    path.write_bytes(bytes(data))


def test_verify_ok_damaged_and_truncated(files: dict[str, Path], tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.h5"
    damaged.write_bytes(files["a"].read_bytes())
    _flip_byte_in_pattern(damaged)
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(files["a"].read_bytes()[: files["a"].stat().st_size * 2 // 3])
    ok, bad, short = ckpt_many(("verify", files["a"]), ("verify", damaged), ("verify", truncated))

    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip() == "OK: 5 values verified"

    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "DAMAGED  model/pattern" in bad.stdout
    assert "FAILED: 1 of 5 values damaged" in bad.stdout
    assert "Traceback" not in bad.stderr

    assert short.returncode == 1, short.stdout + short.stderr
    assert "DAMAGED" in short.stdout and "Traceback" not in short.stderr


# ----------------------------------------------------------------------------- ls


def test_ls_manager_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    ckpt_obj = cv.Checkpoint(w=cv.Variable(np.zeros(3, np.float32), name="w"))
    manager = cv.CheckpointManager(ckpt_obj, runs, max_to_keep=3)
    for step in (1, 2, 3, 10):
        manager.save(checkpoint_number=step)
    (runs / "notes.txt").write_text("not a checkpoint")
    table = ckpt("ls", runs)
    assert table.returncode == 0, table.stderr
    last = next(line for line in table.stdout.splitlines() if "ckpt-10.h5" in line)
    assert last.split()[0] == "10" and last.endswith("(latest)")
    assert "3 checkpoints" in table.stdout
    code, out, err = run_main(capsys, "ls", runs, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [2, 3, 10]  # max_to_keep pruned step 1
    assert [c["latest"] for c in doc["checkpoints"]] == [False, False, True]
    assert doc["latest"] == manager.latest_checkpoint
    assert all(c["size"] > 0 for c in doc["checkpoints"])
    code, out, err = run_main(capsys, "ls", tmp_path)
    assert code == 0 and out == f"No checkpoints in {tmp_path}\n"


def test_ls_does_not_read_a_name_without_the_dash_as_a_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user's dup2.h5 beside a manager's steps was listed as step 2; a step is named
    PREFIX-N (the dash is the grammar's), so it is not one."""
    runs = tmp_path / "runs"
    manager = cv.CheckpointManager(
        cv.Checkpoint(w=cv.Variable(np.zeros(3, np.float32), name="w")), runs)
    manager.save(checkpoint_number=5)
    cv.save(runs / "dup2.h5", {"x": np.ones(2)})
    code, out, err = run_main(capsys, "ls", runs, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [5]
    assert cv.checkpoint.parse_step_name("dup2.h5") is None
    assert cv.checkpoint.parse_step_name("dup-2.h5") == ("dup", 2, ".h5")
    (runs / "checkpoint_state.json").unlink()  # no record: a step by name and time only
    assert cv.latest_checkpoint(runs) == manager.checkpoints[-1]


def test_ls_does_not_list_a_file_named_like_a_step_that_is_no_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user's text file ckpt-3.h5 was listed as step 3 (and marked latest); the manager
    does not list it, and now neither does ``ckpt ls``, which names it on a last line."""
    runs = tmp_path / "runs"
    manager = cv.CheckpointManager(cv.Checkpoint(w=cv.Variable(np.zeros(3))), runs)
    manager.save(checkpoint_number=1)
    (runs / "ckpt-3.h5").write_text("my notes")
    (runs / "ckpt-4.zarr").mkdir()
    code, out, err = run_main(capsys, "ls", runs, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [1] and manager.checkpoints == [
        doc["latest"]]
    assert doc["not_checkpoints"] == [str(runs / "ckpt-3.h5"), str(runs / "ckpt-4.zarr")]
    code, out, err = run_main(capsys, "ls", runs)
    assert code == 0, err
    assert "1 checkpoint," in out and "ckpt-1.h5" in out and "(latest)" in out
    assert out.splitlines()[-1] == (
        "not listed, named like a step but not a ckptvar checkpoint: ckpt-3.h5, ckpt-4.zarr")


def test_ls_skips_a_step_that_is_gone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A link to nothing (or a step a running manager prunes while ``ckpt ls`` looks) is
    not listed, as the manager does not list it; ``ckpt ls`` failed with '[Errno 2] No
    such file or directory' and listed nothing."""
    runs = tmp_path / "runs"
    manager = cv.CheckpointManager(cv.Checkpoint(w=cv.Variable(np.zeros(3))), runs)
    for step in (1, 2):
        manager.save(checkpoint_number=step)
    (runs / "ckpt-3.h5").symlink_to(tmp_path / "elsewhere" / "ckpt-3.h5")
    (runs / "ckpt-4.zarr").symlink_to(tmp_path / "elsewhere" / "ckpt-4.zarr")
    code, out, err = run_main(capsys, "ls", runs, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [1, 2]
    assert doc["latest"] == manager.latest_checkpoint
    code, out, err = run_main(capsys, "ls", runs)
    assert code == 0 and "2 checkpoints" in out, err


# ----------------------------------------------------------------------------- in-process helpers


@pytest.mark.parametrize(
    ("shape", "budget"),
    [((), 4), ((0, 3), 4), ((5,), 2), ((7, 3), 4), ((3, 5, 2), 3), ((2, 3, 4), 1), ((4, 4), 100)],
)
def test_iter_blocks_cover_every_element_once(shape: tuple[int, ...], budget: int) -> None:
    seen = np.zeros(shape, dtype=np.int64)
    for index in iter_blocks(shape, budget):
        block = seen[index]
        assert block.size <= max(budget, 1)
        seen[index] += 1
    assert (seen == 1).all()


def test_streaming_stats_match_numpy() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((50, 7)) * 3 + 1
    s = Stats()
    for index in iter_blocks(x.shape, 13):
        s.add(x[index])
    d = s.as_dict()
    assert d["mean"] == pytest.approx(x.mean()) and d["std"] == pytest.approx(x.std())
    assert (d["min"], d["max"]) == (x.min(), x.max())
    empty = Stats()
    empty.add(np.array([np.nan, np.inf]))
    assert empty.as_dict() == {
        "min": None,
        "max": None,
        "mean": None,
        "std": None,
        "nan": 1,
        "inf": 1,
    }
    assert not any(isinstance(v, float) and math.isnan(v) for v in d.values())


def test_escape_control_characters() -> None:
    assert escape("plain/key") == "plain/key"
    assert escape("a\x00b\x1b[0m\x7f\u202e\n") == "a\\x00b\\x1b[0m\\x7f\\u202e\\x0a"


def test_stats_and_diff_stream_large_values_in_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptvar.cli as cli

    rng = np.random.default_rng(2)
    big = rng.standard_normal((37, 11, 5)).astype(np.float32)
    big[3, 4, 2] = np.nan
    other = big.copy()
    other[30, 1, 1] += 0.5
    cv.save(tmp_path / "big.h5", {"big": big})
    cv.save(tmp_path / "other.zarr", {"big": other})
    monkeypatch.setattr(cli._blocks, "BLOCK_ELEMENTS", 16)  # every value is now "large": read in slices
    code, out, err = run_main(capsys, "inspect", tmp_path / "big.h5", "--stats", "--json")
    assert code == 0, err
    rec = json.loads(out)["variables"][0]
    finite = big[np.isfinite(big)].astype(np.float64)
    assert rec["mean"] == pytest.approx(finite.mean()) and rec["std"] == pytest.approx(finite.std())
    assert (rec["min"], rec["max"], rec["nan"]) == (float(finite.min()), float(finite.max()), 1)
    code, out, err = run_main(
        capsys, "diff", tmp_path / "big.h5", tmp_path / "other.zarr", "--json"
    )
    assert code == 1, err
    rec = json.loads(out)["values"][0]
    assert rec["beyond_tolerance"] == 1
    assert rec["max_abs"] == pytest.approx(0.5, rel=1e-5)


def test_converted_checkpoint_still_restores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class Dense(cv.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kernel = cv.Variable(np.arange(6.0).reshape(2, 3), name="kernel")
            self.bias = cv.Variable(np.ones(3), name="bias", trainable=False)

    saved = cv.Checkpoint(model=Dense()).save(tmp_path / "ckpt")
    code, _out, err = run_main(capsys, "convert", saved, tmp_path / "copy.zarr")
    assert code == 0, err
    fresh = Dense()
    fresh.kernel.assign(np.zeros((2, 3)))
    cv.Checkpoint(model=fresh).restore(tmp_path / "copy.zarr").assert_consumed()
    np.testing.assert_array_equal(fresh.kernel.numpy(), np.arange(6.0).reshape(2, 3))
    with cv.open(tmp_path / "copy.zarr") as reader:
        assert reader.info("model/bias").attrs["trainable"] is False
        with cv.open(saved) as source:
            assert reader.metadata() == source.metadata()


@pytest.mark.slow
def test_inspect_stats_memory_stays_flat(tmp_path: Path) -> None:
    """A 256 MiB value: ``inspect --stats`` and ``diff`` never hold it in memory whole.

    (``verify`` hashes through a memory map, whose file-backed pages count in the
    resident size but are page cache, not allocations; it is left out here.)
    """
    cv.save(tmp_path / "big.h5", {"big": np.ones(64 * 2**20, dtype=np.float32)})
    # VmHWM (the peak resident size of this process image) is reset by exec, unlike ru_maxrss.
    code = (
        "import sys; from ckptvar.cli import main; rc = main(sys.argv[1:]); "
        "print([s for s in open('/proc/self/status') if s.startswith('VmHWM')][0], "
        "file=sys.stderr);"
        " sys.exit(rc)"
    )
    big = str(tmp_path / "big.h5")
    for argv in (["inspect", big, "--stats", "--json"], ["diff", big, big]):
        proc = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
        peak_mib = int(proc.stderr.split()[-2]) / 1024
        assert peak_mib < 160, f"ckpt {argv[0]}: peak RSS {peak_mib:.0f} MiB for a 256 MiB value"


def test_progress_bar_modes() -> None:
    import io

    from ckptvar.cli._progress import Progress

    tty = io.StringIO()
    with Progress(300, stream=tty, enabled=True, tty=True, width=10) as bar:
        for _ in range(3):
            bar.update(100, "model/w")
    text = tty.getvalue()
    assert text.startswith("\r[###-------]  33% 100 B / 300 B (1 value) model/w")
    assert text.endswith("\n")  # the last redraw clears the label and ends the line
    assert text.rsplit("\r", 1)[1].rstrip() == "[##########] 100% 300 B / 300 B (3 values)"
    piped = io.StringIO()
    with Progress(1000, stream=piped, enabled=True, tty=False) as bar:
        for _ in range(100):
            bar.update(10)
    lines = piped.getvalue().splitlines()
    assert len(lines) == 11 and "\r" not in piped.getvalue()  # 0%, 10%, ..., 100%
    assert lines[-1] == "100% 1000 B / 1000 B (100 values)"
    quiet = io.StringIO()
    with Progress(10, stream=quiet, enabled=False) as bar:
        bar.update(10)
    assert quiet.getvalue() == ""


def test_inspect_directory_and_damaged_manager_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    manager = cv.CheckpointManager(cv.Checkpoint(v=cv.Variable([1.0, 2.0])), runs)
    manager.save()
    manager.save()
    code, out, err = run_main(capsys, "inspect", runs)  # a manager's directory: its latest
    assert code == 0, err
    assert out.splitlines()[0] == f"(inspecting the latest checkpoint of {str(runs)!r})"
    assert out.splitlines()[1] == f"path: {runs / 'ckpt-2.h5'}"
    (tmp_path / "plain").mkdir()
    code, out, err = run_main(capsys, "inspect", tmp_path / "plain")
    assert code == 2 and "'ckpt ls " in err and err.count("\n") == 1
    (runs / "checkpoint_state.json").write_text("garbage")
    code, out, err = run_main(capsys, "ls", runs)
    assert code == 0 and err.startswith("ckpt: warning: ")
    assert out.splitlines()[2].endswith("ckpt-2.h5   (latest)")


def test_tree_splits_dotted_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    arrays = {
        "enc.layers.0.weight": np.ones((2, 2)),
        "enc.layers.0.bias": np.ones(2),
        "head.weight": np.ones(1),
    }
    cv.save(tmp_path / "m.safetensors", arrays)
    code, out, err = run_main(capsys, "inspect", tmp_path / "m.safetensors", "--tree")
    assert code == 0, err
    tree = [line for line in out.splitlines() if "──" in line]
    assert tree == [
        "├── enc",
        "│   └── layers",
        "│       └── 0",
        "│           ├── bias  [float64 (2,) 16 B]",
        "│           └── weight  [float64 (2, 2) 32 B]",
        "└── head",
        "    └── weight  [float64 (1,) 8 B]",
    ]


def test_ls_lists_tensorflow_prefixes(capsys: pytest.CaptureFixture[str]) -> None:
    tf_dir = Path(__file__).resolve().parents[1] / "fixtures" / "tf2_object"
    code, out, err = run_main(capsys, "ls", tf_dir, "--json")
    assert code == 0, err
    (entry,) = json.loads(out)["checkpoints"]
    assert entry["path"] == str(tf_dir / "ckpt-1") and entry["step"] == 1 and entry["latest"]
    assert entry["size"] == sum(p.stat().st_size for p in tf_dir.glob("ckpt-1.*"))


def test_verify_names_a_lost_zarr_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = cv.save(tmp_path / "c.zarr", {"big": np.arange(300_000, dtype=np.float32)})
    chunks = [p for p in (path / "big").rglob("c*") if p.is_file()]
    assert chunks, "expected the value stored as its own Zarr array"
    for chunk in chunks:
        chunk.unlink()
    code, out, err = run_main(capsys, "verify", path)
    assert code == 1, err
    assert out.startswith("DAMAGED  big: ") and "FAILED: 1 of 1 values damaged" in out


_SHARDED_SAVE = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ckptvar as cv
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("x", "y")))
cv.save(sys.argv[1], {"w": w, "b": np.ones(3, np.float32)})
"""


def test_inspect_shows_the_stored_boxes_of_a_sharded_checkpoint(tmp_path: Path) -> None:
    """One logical value per array, with its boxes (API 13): a BOXES column, --boxes, --json."""
    path = tmp_path / "s.h5"
    subprocess.run([sys.executable, "-c", _SHARDED_SAVE, str(path)], check=True, timeout=120,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    shown = subprocess.run([sys.executable, "-m", "ckptvar.cli", "inspect", str(path), "--boxes"],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {line.split()[0]: line.split() for line in shown.splitlines() if line[:2] in ("w ", "b ")}
    assert rows["w"][-1] == "8" and rows["b"][-1] == "1", shown
    assert "at (4, 6) shape (4, 2)" in shown and "w: 8 boxes" in shown, shown
    doc = json.loads(subprocess.run(
        [sys.executable, "-m", "ckptvar.cli", "inspect", str(path), "--json"],
        capture_output=True, text=True, timeout=120, check=True).stdout)
    w = next(v for v in doc["variables"] if v["key"] == "w")
    assert w["shape"] == [8, 8] and len(w["boxes"]) == 8
    assert {"offset": [4, 6], "shape": [4, 2]} in w["boxes"]
    plain = subprocess.run([sys.executable, "-m", "ckptvar.cli", "inspect",
                            str(tmp_path / "s.h5"), "--boxes", "--filter", "b"],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert "b: 1 box" in plain
