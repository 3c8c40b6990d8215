"""What a new user trips on (issue 23, section 4): each item, through the real CLI and API."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv
from ckptvar._dtypes import ML_DTYPES, SUPPORTED_DTYPES, kind_of

ROOT = Path(__file__).resolve().parents[1]


def ckpt(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptvar", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=cwd, check=False)


def error_of(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), proc.stderr
    return lines[0].removeprefix("ckpt: error: ")


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return Path(cv.save(tmp_path / "good.h5", {"w": np.ones(3, np.float32),
                                               "n": np.arange(2)}))


# 1. an output no writer takes: the message cv.save gives -------------------------------------
@pytest.mark.parametrize(("name", "extra"), [
    ("out.txt", []), ("x.bin", []), ("out.txt", ["--dtype", "float16"]),
    ("x.bin", ["--dtype", "float16"]),
])
def test_convert_to_an_unwritable_suffix_says_what_cv_save_says(
        good: Path, name: str, extra: list[str]) -> None:
    dst = good.parent / name
    with pytest.raises(cv.UnsupportedFormatError) as info:
        cv.save(dst, {"w": np.ones(3)})
    assert error_of(ckpt("convert", good, dst, *extra)) == str(info.value)
    assert "writable: h5, zarr, safetensors, hf-safetensors, npz" in str(info.value)
    assert not dst.exists()


def test_convert_format_choices_are_the_writable_formats(good: Path) -> None:
    message = error_of(ckpt("convert", good, good.parent / "x.h5", "--format", "pt"))
    writable = cv.storage.writable_formats()
    assert "invalid choice: 'pt'" in message
    assert all(repr(f) in message for f in writable)
    assert "'torch'" not in message and "'tf'" not in message
    helptext = ckpt("convert", "--help").stdout
    assert f"output format ({', '.join(writable)})" in " ".join(helptext.split())
    assert "torch" in cv.storage.known_formats() and "torch" not in writable


# 2. sizes never print with an exponent ---------------------------------------------------------
def test_sizes_print_without_exponents(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "s.h5", {"a": np.zeros(256_000, np.float32),      # 1000 KiB
                                     "b": np.zeros(1_045 * 256, np.float32)})  # 1045 KiB
    out = ckpt("inspect", p)
    assert out.returncode == 0, out.stderr
    assert "1000 KiB" in out.stdout and "1.02 MiB" in out.stdout
    assert not re.search(r"\de\+\d", out.stdout)
    listing = ckpt("ls", tmp_path)
    assert listing.returncode == 0 and not re.search(r"\de\+\d", listing.stdout)
    bar = ckpt("convert", p, tmp_path / "o.h5", "--progress")
    assert not re.search(r"\de\+\d", bar.stderr) and "1000 KiB / 2.00 MiB" in bar.stderr


# 3. after 100%, convert says what it does ------------------------------------------------------
def test_convert_says_what_it_does_after_the_bar_is_full(good: Path) -> None:
    out = ckpt("convert", good, good.parent / "o.h5", "--progress")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    full = next(i for i, line in enumerate(lines) if line.lstrip().startswith("100%"))
    assert "syncing it to disk" in lines[full + 1]


# 4. messages -----------------------------------------------------------------------------------
def test_convert_into_a_path_under_a_file_says_it_once(good: Path) -> None:
    message = error_of(ckpt("convert", good, good / "x.h5"))
    assert message.count("good.h5") == 2  # the destination, then the file in its way
    assert "is a file, not a folder" in message and "Errno" not in message


@pytest.mark.parametrize("content", [b"", b"hello, not a checkpoint\n"])
def test_a_h5_file_that_is_not_hdf5_says_so(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "model.h5"
    p.write_bytes(content)
    message = error_of(ckpt("inspect", p))
    assert "not an HDF5 file" in message and "user block" not in message
    with pytest.raises(cv.CorruptCheckpointError, match="not an HDF5 file"):
        cv.load(p)


def test_show_checks_its_arguments_before_printing(good: Path) -> None:
    out = ckpt("show", good, "w", "--precision", "-3")
    assert out.stdout == ""
    assert "--precision: must be 0 or more" in error_of(out)


def test_load_of_a_directory_says_it_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    with pytest.raises(cv.UnsupportedFormatError, match=r"'.*adir' is a directory, not a"):
        cv.load(tmp_path / "adir")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(cv.UnsupportedFormatError) as info:
        cv.load(tmp_path / "x.json")
    assert "()" not in str(info.value) and "sharded," in str(info.value)


# 5. zero-size values everywhere ----------------------------------------------------------------
EMPTY = {"a": np.zeros((0,), np.float32), "b": np.zeros((3, 0), ml_dtypes.bfloat16),
         "c": np.zeros((0, 0, 2), np.int8)}


@pytest.mark.parametrize(("fmt", "pack"), [
    *((f, p) for f in ("h5", "zarr") for p in (None, 0, 1 << 20)),  # default, own, packed
    ("npz", None), ("safetensors", None),  # packing is a writer option of h5/zarr only
])
def test_every_value_empty_round_trips(tmp_path: Path, fmt: str, pack: int | None) -> None:
    options = {} if pack is None else {"pack_threshold": pack}
    p = cv.save(tmp_path / f"e.{fmt}", EMPTY, **options)
    got = cv.load(p)
    for k, v in EMPTY.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
    with cv.open(p) as r:
        assert r["a"][...].shape == (0,)
    assert ckpt("verify", p).returncode == 0


def test_empty_values_in_a_multi_process_layout(tmp_path: Path) -> None:
    coord = cv.distributed.SingleProcessCoordinator()
    for fmt in ("h5", "zarr"):
        e = cv.Variable(np.zeros((0, 4), np.float32), name="e",
                        shard=cv.Shard(full_shape=(0, 4), offset=(0, 0)))
        f = cv.Variable(np.zeros((0,), np.int64), name="f")
        path = cv.Checkpoint(e=e, f=f).save(str(tmp_path / f"ckpt.{fmt}"), coordinator=coord)
        got = cv.load(path)
        assert got["e"].shape == (0, 4) and got["f"].shape == (0,)


# 6. every ml_dtypes type -----------------------------------------------------------------------
def _every_dtype() -> dict[str, np.ndarray]:
    out = {}
    for name in ML_DTYPES:
        dt = SUPPORTED_DTYPES[name]
        kind = kind_of(dt)
        if kind == "f":
            base = [0.5, 1, 2, 4] if "e8m0" in name else [0.5, 1, -1, 2]
            out[name] = np.array(base, np.float32).astype(dt)
        elif kind == "c":
            out[name] = np.array([1 + 2j, 0.5], np.complex64).astype(dt)
        else:
            out[name] = np.array([0, 1], np.int8).astype(dt)
    return out


def test_every_ml_dtypes_type_is_supported() -> None:
    names = {n for n in dir(ml_dtypes) if isinstance(getattr(ml_dtypes, n), type)
             and issubclass(getattr(ml_dtypes, n), np.generic)}
    assert names <= set(SUPPORTED_DTYPES), sorted(names - set(SUPPORTED_DTYPES))


@pytest.mark.parametrize(("fmt", "pack"), [("h5", 0), ("h5", 1 << 20), ("zarr", 0),
                                           ("zarr", 1 << 20), ("npz", None)])
def test_every_ml_dtype_round_trips_exactly(tmp_path: Path, fmt: str, pack: int | None) -> None:
    values = _every_dtype()
    options = {} if pack is None else {"pack_threshold": pack}
    got = cv.load(cv.save(tmp_path / f"d.{fmt}", values, **options))
    for k, v in values.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k


def test_variables_of_every_ml_dtype_restore(tmp_path: Path) -> None:
    variables = {n: cv.Variable(v, name=n) for n, v in _every_dtype().items()}
    path = cv.Checkpoint(**variables).write(tmp_path / "v.h5")
    fresh = {n: cv.Variable(np.zeros_like(v.numpy()), name=n) for n, v in variables.items()}
    cv.Checkpoint(**fresh).restore(path).assert_existing_objects_matched()
    for n, v in variables.items():
        assert fresh[n].numpy().tobytes() == v.numpy().tobytes(), n


@pytest.mark.parametrize(("name", "st_name"), [("float8_e8m0fnu", "F8_E8M0"),
                                               ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
                                               ("float8_e5m2fnuz", "F8_E5M2FNUZ")])
def test_safetensors_names_the_byte_wide_float8_types(tmp_path: Path, name: str,
                                                      st_name: str) -> None:
    value = _every_dtype()[name]
    src = cv.save(tmp_path / "s.h5", {"x": value})
    out = ckpt("convert", src, tmp_path / "s.safetensors")
    assert out.returncode == 0, out.stderr
    raw = (tmp_path / "s.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8:8 + n])["x"]["dtype"] == st_name
    back = ckpt("convert", tmp_path / "s.safetensors", tmp_path / "back.zarr")
    assert back.returncode == 0, back.stderr
    got = cv.load(tmp_path / "back.zarr")["x"]
    assert got.dtype == value.dtype and got.tobytes() == value.tobytes()


# 8. ckpt --help imports no NumPy, h5py or zarr ----------------------------------------------
def test_ckpt_help_imports_nothing_heavy() -> None:
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from ckptvar.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "for sub in ('inspect', 'show', 'diff', 'verify', 'ls'):  # convert's lists formats\n"
        "    try:\n        main([sub, '--help'])\n    except SystemExit:\n        pass\n"
        "loaded = [m for m, mod in sys.modules.items()\n"
        "          if m.split('.')[0] in ('numpy', 'h5py', 'zarr', 'ml_dtypes', 'msgpack')\n"
        "          and type(mod).__name__ != '_LazyModule']\n"
        "print(sorted(loaded), time.perf_counter() - t, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    loaded, seconds = proc.stderr.strip().rsplit(" ", 1)
    assert loaded == "[]", loaded
    assert float(seconds) < 2.0  # ~0.1 s on a quiet machine; generous for a loaded one


def test_the_help_of_every_command_still_renders() -> None:
    for sub in ("convert", "inspect", "show", "diff", "verify", "ls"):
        out = ckpt(sub, "--help")
        assert out.returncode == 0 and f"usage: ckpt {sub}" in out.stdout, out.stderr


# 10. convert's resident size tracks what it reads ---------------------------------------------
def test_convert_rss_stays_well_under_the_source(tmp_path: Path) -> None:
    """A 192 MiB source streamed through a 16 MiB window: the process's peak resident size
    (VmHWM: anonymous memory and the mapped file pages it touched) stays far below it."""
    src = cv.save(tmp_path / "src.h5",
                  {f"v{i}": np.full(8 << 20, i, np.float32) for i in range(6)})
    code = ("import sys; from ckptvar.cli import main; rc = main(sys.argv[1:]); "
            "print([s for s in open('/proc/self/status') if s.startswith('VmHWM')][0], "
            "file=sys.stderr); sys.exit(rc)")
    for suffix in (".h5", ".safetensors"):
        proc = subprocess.run(
            [sys.executable, "-c", code, "convert", str(src), str(tmp_path / f"o{suffix}"),
             "--window", "16M", "-q"], capture_output=True, text=True, timeout=600,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False,
        )
        assert proc.returncode == 0, proc.stderr
        peak_mib = int(proc.stderr.split()[-2]) / 1024
        # ~65 MiB of interpreter and libraries plus what is in flight: ~85-110 MiB on a
        # quiet machine, up to ~175 MiB when the page-releasing thread waits for a CPU on a
        # loaded one; mapping the whole scratch file (as before) peaks at ~260 MiB, the
        # source's size plus the interpreter
        assert peak_mib < 192, f"{suffix}: peak RSS {peak_mib:.0f} MiB for a 192 MiB source"
        got = cv.load(tmp_path / f"o{suffix}")
        assert all(float(got[f"v{i}"][-1]) == i for i in range(6))
