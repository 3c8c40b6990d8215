"""The ``ckpt`` command never does less than asked, run as real processes.

Selections (--filter/--exclude) are unions in every subcommand, unreadable values
are named, conversions create parents and name every dtype they cannot store,
``show`` prints slices, ``diff`` handles dtypes, huge integers and NaN, ``inspect``
carries metadata in natural order, and progress appears only on a terminal.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import ckptvar as cv

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TF = FIXTURES / "tf2_object" / "ckpt-1"


def ckpt(*args: object, code: str = "pass") -> subprocess.CompletedProcess[str]:
    """``python -m ckptvar ARGS`` (after running ``code``), stdout and stderr captured."""
    prog = f"{code}; import sys; from ckptvar.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", prog, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_filter_and_exclude_are_unions_in_every_subcommand(tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    with cv.open(TF) as reader:
        keys = list(reader)
    wanted = sorted(k for k in keys if k.startswith(("model/layers/", "optimizer/")))
    sel = ["--filter", "model/layers/*", "--filter", "optimizer/*"]
    proc = ckpt("convert", TF, out, *sel)
    assert proc.returncode == 0, proc.stderr
    with cv.open(out) as reader:
        assert sorted(reader) == wanted  # both patterns, not only the last
    proc = ckpt("inspect", TF, *sel, "--exclude", "*/1/*", "--json")
    assert proc.returncode == 0, proc.stderr
    listed = [v["key"] for v in json.loads(proc.stdout)["variables"]]
    assert listed == [k for k in wanted if "/1/" not in k]  # exclude wins
    proc = ckpt("verify", TF, *sel)
    assert proc.returncode == 0 and f"OK: {len(wanted)} values verified" in proc.stdout
    other = tmp_path / "y.h5"
    assert ckpt("convert", TF, other, "--exclude", "model/z128").returncode == 0
    proc = ckpt("diff", TF, other, *sel, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(v["key"] for v in json.loads(proc.stdout)["values"]) == wanted
    # A selection that matches nothing is a usage error everywhere.
    none = ["--filter", "nothing/*"]
    for argv in (
        ["inspect", TF, *none],
        ["convert", TF, tmp_path / "z.h5", *none],
        ["diff", TF, other, *none],
        ["verify", TF, *none],
        ["inspect", TF, "--exclude", "*"],
    ):
        proc = ckpt(*argv)
        assert proc.returncode == 2, (argv, proc.stdout)
        assert (proc.stderr.startswith("ckpt: error: no key") and "nothing/*" in proc.stderr) or (
            "--exclude '*'" in proc.stderr
        )
    assert not (tmp_path / "z.h5").exists()


def _strings_file(path: Path) -> None:
    with h5py.File(path, "w") as f:
        f["w"] = np.arange(6.0).reshape(2, 3)
        f["names"] = np.array([b"a", b"b"])
        f["rec"] = np.zeros(3, dtype=[("a", "i4"), ("b", "f8")])


def test_unreadable_values_are_listed_and_never_dropped(tmp_path: Path) -> None:
    src = tmp_path / "plain.h5"
    _strings_file(src)
    proc = ckpt("inspect", src)
    assert proc.returncode == 0, proc.stderr
    assert "skipped (cannot be read as numbers): 2" in proc.stdout
    assert "names  HDF5 dtype |S1" in proc.stdout and "\n  rec    HDF5 dtype" in proc.stdout
    assert "1 value, 6 elements, 48 B; 2 skipped" in proc.stdout
    doc = json.loads(ckpt("inspect", src, "--json").stdout)
    assert [s["key"] for s in doc["skipped"]] == ["names", "rec"]

    dst = tmp_path / "out.h5"
    proc = ckpt("convert", src, dst)
    assert proc.returncode == 2
    assert "2 values" in proc.stderr and "'names'" in proc.stderr and "'rec'" in proc.stderr
    assert "--skip-unreadable" in proc.stderr and not dst.exists()
    proc = ckpt("convert", src, dst, "--skip-unreadable")
    assert proc.returncode == 0, proc.stderr
    assert "Left out 2 unreadable values (--skip-unreadable): 'names', 'rec'" in proc.stdout
    assert list(cv.load(dst)) == ["w"]
    # Excluding them is a choice too; TF's object graph is bookkeeping, never a value.
    assert ckpt("convert", src, tmp_path / "o2.h5", "--exclude", "[nr]*").returncode == 0
    proc = ckpt("inspect", TF)
    assert "skipped" not in proc.stdout


def test_convert_creates_parents_and_names_the_users_path(tmp_path: Path) -> None:
    dst = tmp_path / "a" / "b" / "model.h5"
    proc = ckpt("convert", TF, dst, "--exclude", "model/z128")
    assert proc.returncode == 0, proc.stderr
    assert cv.open(dst).keys()
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    bad = blocker / "sub" / "m.safetensors"
    proc = ckpt("convert", TF, bad, "--exclude", "model/z128")
    assert proc.returncode == 2
    assert str(bad) in proc.stderr and ".tmp" not in proc.stderr and "spool" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and blocker.read_text() == "not a folder"


def test_unsupported_dtype_names_every_key_and_suggests_exclude(tmp_path: Path) -> None:
    src = tmp_path / "c.h5"
    cv.save(
        src,
        {
            "a": np.ones(2, np.complex128),
            "b": np.zeros(3, np.complex128),
            "w": np.ones(2, np.float32),
        },
    )
    dst = tmp_path / "c.safetensors"
    proc = ckpt("convert", src, dst)
    assert proc.returncode == 2
    err = proc.stderr
    assert "2 values: 'a' (complex128), 'b' (complex128)" in err
    assert "--exclude a --exclude b" in err and not dst.exists()
    proc = ckpt("convert", src, dst, "--exclude", "a", "--exclude", "b")
    assert proc.returncode == 0 and list(cv.load(dst)) == ["w"]


def test_show_prints_a_slice_with_print_options(tmp_path: Path) -> None:
    value = np.arange(24, dtype=np.float32).reshape(4, 6) / 7
    src = tmp_path / "m.h5"
    cv.save(src, {"w": value, "big": np.arange(5000, dtype=np.int32)})
    proc = ckpt("show", src, "w[1:3, ::2]", "--precision", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "w[1:3, ::2]  float32 (2, 3) of (4, 6)"
    assert lines[1:] == ["[[0.86, 1.14, 1.43],", " [1.71, 2.  , 2.29]]"]
    doc = json.loads(ckpt("show", src, "w[..., -1]", "--json").stdout)
    assert doc["shape"] == [4] and doc["value"] == pytest.approx(value[..., -1].tolist())
    assert "..." in ckpt("show", src, "big").stdout  # NumPy's summary beyond 1000 elements
    assert "..." not in ckpt("show", src, "big", "--threshold", "0").stdout
    for spec in ("w[9]", "w[a:b]", "missing"):
        proc = ckpt("show", src, spec)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, spec


def test_show_reads_only_the_slice(tmp_path: Path) -> None:
    src = tmp_path / "big.h5"
    cv.save(src, {"emb": np.ones((1 << 14, 1 << 12), np.float32)})  # 256 MiB
    code = (
        "import atexit, sys; atexit.register(lambda: print([s for s in open('/proc/self/status')"
        " if s.startswith('VmHWM')][0], file=sys.stderr))"
    )
    proc = ckpt("show", src, "emb[5, :4]", code=code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1] == "[1., 1., 1., 1.]"
    peak_mib = int(proc.stderr.split()[-2]) / 1024
    assert peak_mib < 200, f"peak RSS {peak_mib:.0f} MiB to show one row of a 256 MiB value"


@pytest.mark.slow  # tracemalloc makes every allocation slow
def test_show_json_of_a_large_value_streams_in_bounded_memory(tmp_path: Path) -> None:
    src = tmp_path / "big.h5"
    rng = np.random.default_rng(0)
    cv.save(src, {"m": rng.standard_normal((256, 1024)).astype(np.float32),  # 1 MiB each
                  "v": rng.standard_normal(1 << 18).astype(np.float32)})
    code = (  # what the command allocates, after what any command imports
        f"import atexit, sys, tracemalloc, ckptvar as cv; cv.open({str(src)!r}).close(); "
        "import ckptvar.cli.show; tracemalloc.start(); "
        "atexit.register(lambda: print(tracemalloc.get_traced_memory()[1], file=sys.stderr))"
    )
    proc = ckpt("show", src, "m", "v", "--json", code=code)
    assert proc.returncode == 0, proc.stderr
    peak_mib = int(proc.stderr.split()[-1]) / (1 << 20)
    assert peak_mib < 4, f"peak {peak_mib:.1f} MiB to print a 1 MiB value as JSON"
    docs = json.loads(proc.stdout)
    assert np.array_equal(docs[0]["value"], cv.load(src)["m"])


def test_show_json_of_a_large_value_is_the_same_text_as_of_a_small_one(tmp_path: Path) -> None:
    from ckptvar.cli._output import json_text, plain

    src = tmp_path / "m.h5"
    rng = np.random.default_rng(1)
    f = rng.standard_normal((40, 1000)).astype(np.float32)
    f[3, 7] = np.nan
    w = rng.standard_normal((2, 20000)).astype(np.float16)
    w[1, 5] = np.inf
    values = {"f": f, "w": w, "v": rng.standard_normal(30000),
              "i": np.arange(60000).reshape(3, 4, 5000), "b": rng.random((200, 100)) > 0.5}
    cv.save(src, values)
    specs = {"f": f, "w": w, "v": values["v"], "i": values["i"], "b": values["b"],
             "f[::-1, 3:900:7]": f[::-1, 3:900:7], "i[..., ::-3]": values["i"][..., ::-3],
             "w[-1]": w[-1], "i[1:, 2]": values["i"][1:, 2]}
    proc = ckpt("show", src, *specs, "--json")
    assert proc.returncode == 0, proc.stderr
    expected = []
    for spec, value in specs.items():
        key, _, text = spec.partition("[")
        expected.append({"path": str(src), "key": key, "index": "[" + text if text else None,
                         "dtype": value.dtype.name, "shape": list(value.shape),
                         "value": plain(value.tolist())})
    assert proc.stdout == json_text(expected) + "\n"  # several keys: one list


def test_diff_across_dtypes_huge_integers_and_nan(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    source = tmp_path / "f32.h5"
    cv.save(source, {"w": rng.standard_normal((64, 32)).astype(np.float32)})
    bf16 = tmp_path / "bf16.safetensors"
    assert ckpt("convert", source, bf16, "--dtype", "bfloat16").returncode == 0
    proc = ckpt("diff", bf16, source, "--rtol", "1e-2")
    assert proc.returncode == 1 and proc.stdout.startswith("dtype      w  bfloat16 -> float32")
    proc = ckpt("diff", bf16, source, "--rtol", "1e-2", "--ignore-dtype")
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.splitlines()[0].split() == [
        "dtype",
        "w",
        "bfloat16",
        "->",
        "float32",
        "(ignored)",
    ]
    assert "Equal: 1 values (0 identical, 1 within atol=0, rtol=0.01)" in proc.stdout
    assert ckpt("diff", bf16, source, "--ignore-dtype").returncode == 1  # exact: different

    big = 2**63 - 1
    cv.save(
        tmp_path / "p.h5",
        {"i": np.array([big, -(2**63)], np.int64), "v": np.array([1.0, np.nan, 5.0])},
    )
    cv.save(
        tmp_path / "q.h5", {"i": np.array([big - 1, big], np.int64), "v": np.array([1.0, 2.0, 5.0])}
    )
    proc = ckpt("diff", tmp_path / "p.h5", tmp_path / "q.h5", "--json")
    by_key = {r["key"]: r for r in json.loads(proc.stdout)["values"]}
    assert by_key["i"]["max_abs"] == 2**64 - 1 and by_key["i"]["beyond_tolerance"] == 2
    assert by_key["v"]["max_abs"] == "nan" and by_key["v"]["max_rel"] == "nan"
    assert by_key["v"]["nan_mismatch"] == 1 and by_key["v"]["status"] == "different"
    text = ckpt("diff", tmp_path / "p.h5", tmp_path / "q.h5").stdout
    assert "max abs 18446744073709551615" in text
    assert "max abs nan  max rel nan  1 of 3 elements beyond tolerance (1 NaN against" in text
    assert "1.798e+308" not in text and "inf" not in text


def test_inspect_json_order_latest_values_and_wide_keys(tmp_path: Path) -> None:
    src = tmp_path / "m.h5"
    keys = ["vars/10", "vars/2", "vars/1"]
    cv.save(
        src,
        {k: np.ones(2) for k in keys},
        metadata={"step": 7},
        attrs={"vars/2": {"trainable": False, "note": "frozen"}},
    )
    doc = json.loads(ckpt("inspect", src, "--json").stdout)
    assert [v["key"] for v in doc["variables"]] == ["vars/1", "vars/2", "vars/10"]
    assert doc["metadata"] == {"step": 7}
    assert doc["variables"][1]["attrs"] == {"name": "vars/2", "trainable": False, "note": "frozen"}
    stored = json.loads(ckpt("inspect", src, "--json", "--order", "stored").stdout)
    with cv.open(src) as reader:
        assert [v["key"] for v in stored["variables"]] == list(reader)
    assert "\n3 variables, " in ckpt("inspect", src).stdout  # ckptvar's own file

    wide = tmp_path / "wide.safetensors"
    cv.save(wide, {"模型/权重": np.ones(3, np.float32), "ab": np.ones(2, np.int8)})
    out = ckpt("inspect", wide).stdout
    assert "\n2 values, " in out  # a foreign file holds values, not variables
    rows = [line for line in out.splitlines() if "int8" in line or "float32" in line]
    import unicodedata

    def col(line: str, word: str) -> int:
        head = line[: line.index(word)]
        return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in head)

    assert col(rows[0], rows[0].split()[1]) == col(rows[1], rows[1].split()[1])

    runs = tmp_path / "runs"
    manager = cv.CheckpointManager(cv.Checkpoint(v=cv.Variable([1.0])), runs)
    manager.save()
    manager.save()
    doc = json.loads(ckpt("inspect", runs, "--json").stdout)
    assert doc["latest_of"] == str(runs) and doc["path"].endswith("ckpt-2.h5")


def _on_a_terminal(argv: list[str]) -> str:
    """Run ``ckpt argv`` with stderr on a pseudo-terminal (bar shown at once); its stderr."""
    master, slave = pty.openpty()
    prog = (
        "import sys, ckptvar.cli._common as c; c.PROGRESS_DELAY = 0.0; "
        "from ckptvar.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", prog, *argv], stdout=subprocess.DEVNULL, stderr=slave
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=300)
    os.close(master)
    return b"".join(chunks).decode()


def test_progress_on_a_terminal_only(tmp_path: Path) -> None:
    src = tmp_path / "a.h5"
    cv.save(src, {"w": np.ones(3 << 20, np.float32), "v": np.ones(5)})
    for argv in (
        ["inspect", str(src), "--stats"],
        ["diff", str(src), str(src)],
        ["verify", str(src)],
    ):
        err = _on_a_terminal(argv)
        assert "\r[" in err and "100%" in err, (argv, err)
        assert _on_a_terminal([*argv, "--quiet"]) == "", argv
        assert ckpt(*argv).stderr == "", argv  # a pipe: silent
    # A large value moves the bar before it is done (bytes, not values): piped with
    # --progress, the tenths are drawn while the first value is still "0 values". (A value
    # not cast is read in one verified pass, in runs of 64 MiB: cast, it moves by blocks.)
    proc = ckpt("convert", src, tmp_path / "b.zarr", "--progress", "--dtype", "float16")
    lines = proc.stderr.splitlines()
    assert any(line.startswith(" 33%") and "(0 values)" in line for line in lines), lines
    assert lines[-2].startswith("100%") and "syncing it to disk" in lines[-1]


def test_progress_waits_a_second() -> None:
    import io

    from ckptvar.cli._progress import Progress

    out = io.StringIO()
    with Progress(10, stream=out, enabled=True, tty=True, delay=3600) as bar:
        bar.update(10)
    assert out.getvalue() == ""


_MEASURE = """
import sys, threading, time, tracemalloc
peak_anon = 0
def sample():
    global peak_anon
    while True:
        for line in open('/proc/self/status'):
            if line.startswith('RssAnon'):
                peak_anon = max(peak_anon, int(line.split()[1]) * 1024)
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
tracemalloc.start()
from ckptvar.cli import main
rc = main(sys.argv[1:])
print(tracemalloc.get_traced_memory()[1], peak_anon, file=sys.stderr)
sys.exit(rc)
"""


@pytest.mark.parametrize("suffix", [".safetensors", ".h5"])
def test_convert_holds_a_bounded_window(tmp_path: Path, suffix: str) -> None:
    """6 values of 16 MiB through a 16 MiB window: the values held never approach the whole.

    ``traced`` is the peak of Python and NumPy allocations (tracemalloc); ``anon`` the
    peak anonymous resident memory, sampled. The spool's pages are page cache (the
    kernel writes them back and drops them), so they are in neither figure.
    """
    mib = 1 << 20
    src = tmp_path / "src.h5"
    values = {f"v{i}": np.full(4 * mib, i, np.float32) for i in range(6)}  # 96 MiB
    cv.save(src, values)
    figures = {}
    for window in ("16M", "1G"):
        dst = tmp_path / f"out-{window}{suffix}"
        proc = subprocess.run(
            [sys.executable, "-c", _MEASURE, "convert", str(src), str(dst), "--window", window],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        traced, anon = map(int, proc.stderr.split()[-2:])
        figures[window] = (traced / mib, anon / mib)
        got = cv.load(dst)
        assert list(got) == list(values)
        for key, value in values.items():
            np.testing.assert_array_equal(got[key], value)
        assert not [p for p in tmp_path.iterdir() if "spool" in p.name]
    print(f"{suffix}: peak traced/anon MiB: streamed {figures['16M']}, in memory {figures['1G']}")
    streamed, whole = figures["16M"], figures["1G"]
    assert streamed[0] < 2 * 16 + 8, figures  # two values' worth at most
    assert whole[0] > 96, figures  # the same measure sees a whole output held in memory
    assert streamed[1] < whole[1] - 48, figures


def test_no_metadata_keeps_the_safetensors_format_entry(tmp_path: Path) -> None:
    src = FIXTURES / "safetensors" / "model.safetensors"
    with cv.open(src) as reader:
        assert reader.metadata() == {"format": "np", "note": "fixture"}
    dst = tmp_path / "m.safetensors"
    proc = ckpt("convert", src, dst, "--no-metadata")
    assert proc.returncode == 0, proc.stderr
    with cv.open(dst) as reader:
        assert reader.metadata() == {"format": "np"}  # ckptvar's own and the rest are gone
    help_text = " ".join(ckpt("convert", "--help").stdout.split())
    assert "'format' entry" in help_text and "is kept" in help_text


@pytest.mark.parametrize("window", [None, "1"])
@pytest.mark.parametrize(("target", "becomes", "counts"),
                         [("float16", "inf", {"big": 2}), ("float8_e4m3fn", "NaN", {"big": 3, "fine": 1})])
def test_a_cast_that_overflows_names_each_value(
    tmp_path: Path, window: str | None, target: str, becomes: str, counts: dict[str, int]
) -> None:
    """``--dtype float16`` used to turn 1e6 into inf (float8_e4m3fn, which has no inf: into
    NaN, and inf too) with exit 0 and only numpy's RuntimeWarning, a source line of
    convert.py, on stderr."""
    src = tmp_path / "s.h5"
    cv.save(src, {
        "big": np.array([1e6, 1.5, -3e38, np.inf, np.nan], "f4"),
        "fine": np.array([1.0, -2.0, np.inf, np.nan], "f4"),  # inf/nan stay what they were
        "step": np.array(2**40, "i8"),
    })
    extra = ["--window", window] if window else []
    proc = ckpt("convert", src, tmp_path / "o.h5", "--dtype", target, *extra)
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr and "convert.py" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "out of" in ln]
    assert len(lines) == len(counts), proc.stderr
    for key, n in counts.items():
        line = next(ln for ln in lines if f"'{key}'" in ln)
        size = 5 if key == "big" else 4
        assert f"{n} of {size}" in line and target in line and becomes in line, line
    out = cv.load(tmp_path / "o.h5")
    assert out["step"] == 2**40 and out["big"][1] == 1.5
