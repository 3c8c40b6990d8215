"""Orbax step directories (made by orbax-checkpoint 0.12: OCDBT through a CheckpointManager,
per-array Zarr with use_ocdbt=False) read without JAX or Orbax; OCDBT needs the orbax extra
and says so; damaged or hostile arrays refused naming the array and the file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from ckpt_runs import ckpt
from ckpt_runs import ckpt_processes as ckpt_many

import ckptvar as cv

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "orbax"
ZARR = FIXTURES / "zarr_step"
OCDBT = FIXTURES / "ocdbt_run" / "5"
KEYS = ["mask", "opt_state/count", "opt_state/mu", "params/big", "params/dense/bias",
        "params/dense/kernel", "params/embed"]


def test_both_layouts_read_the_same_tree() -> None:
    pytest.importorskip("tensorstore", reason="the orbax extra (in the test extra) installs it")
    zarr_values, ocdbt_values = cv.load(ZARR), cv.load(OCDBT)
    assert sorted(zarr_values) == sorted(ocdbt_values) == KEYS
    for key in KEYS:
        np.testing.assert_array_equal(zarr_values[key], ocdbt_values[key])
    assert str(zarr_values["params/embed"].dtype) == "bfloat16"
    with cv.open(OCDBT / "_CHECKPOINT_METADATA") as reader:  # the file names the step too
        assert reader.format == "orbax"
        np.testing.assert_array_equal(reader["params/big"][3:5, ::7],
                                      np.arange(600, dtype=np.float32).reshape(30, 20)[3:5, ::7])


def test_ocdbt_without_tensorstore_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['tensorstore'] = None\n"
        "import ckptvar as cv\n"
        f"cv.open({str(OCDBT)!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 1
    assert "UnsupportedFormatError" in proc.stderr and "pip install 'ckptvar[orbax]'" in proc.stderr
    with cv.open(ZARR) as reader:  # the per-array Zarr layout needs no extra
        assert sorted(reader) == KEYS


def test_cli_inspect_verify_convert(tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    inspect, verify, convert = ckpt_many(("inspect", ZARR), ("verify", ZARR),
                                         ("convert", ZARR, out))
    assert "format: orbax" in inspect.stdout and "params/dense/kernel" in inspect.stdout
    assert verify.returncode == 0 and "not checksummed" in verify.stdout, verify.stdout
    assert convert.returncode == 0, convert.stderr
    want = cv.load(ZARR)
    got = cv.load(out)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)


def _edit_zarray(folder: Path, name: str, **changes: object) -> None:
    path = folder / name / ".zarray"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def test_damaged_and_hostile_arrays_are_refused(tmp_path: Path) -> None:
    cases = {
        "huge": ({"shape": [2**40, 2**40]}, "too many elements"),
        "tiny_chunks": ({"shape": [10**7, 10**7], "chunks": [1, 1]}, "chunks \\(limit"),
        "bad_dtype": ({"dtype": "|O"}, "dtype '\\|O' is not supported"),
    }
    for name, (changes, pattern) in cases.items():
        folder = tmp_path / name
        shutil.copytree(ZARR, folder)
        _edit_zarray(folder, "params.big", **changes)
        with pytest.raises((cv.CorruptCheckpointError, cv.UnsupportedFormatError), match=pattern):
            cv.open(folder)
    folder = tmp_path / "damaged"
    shutil.copytree(ZARR, folder)
    chunk = folder / "params.big" / "0.0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    (folder / "params.dense.bias" / "0").unlink()
    with cv.open(folder) as reader:
        with pytest.raises(cv.CorruptCheckpointError, match=r"params\.big.*'params\.big/0\.0'"):
            reader.read("params/big")
        with pytest.raises(cv.CorruptCheckpointError, match=r"lost its chunk 'params\.dense\.bias/0'"):
            reader.read("params/dense/bias")
        np.testing.assert_array_equal(reader.read("opt_state/mu"), np.ones(3))
    verify = ckpt("verify", folder)
    assert verify.returncode == 1 and "DAMAGED  params/big" in verify.stdout
    # A gzip chunk that would inflate to 64 MiB is stopped at its cell's 2400 bytes.
    bomb = tmp_path / "bomb"
    shutil.copytree(ZARR, bomb)
    _edit_zarray(bomb, "params.big", compressor={"id": "gzip", "level": 1})
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    (bomb / "params.big" / "0.0").write_bytes(packer.compress(bytes(64 << 20)) + packer.flush())
    tracemalloc.start()
    try:
        with pytest.raises(cv.CorruptCheckpointError, match="holds 2401 bytes"):
            cv.load(bomb)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()
    (folder / "_METADATA").write_text("{not json")
    with pytest.raises(cv.CorruptCheckpointError, match="_METADATA.*not valid JSON"):
        cv.open(folder)


def test_a_run_directory_opens_at_its_latest_step(tmp_path: Path) -> None:
    """Like Orbax's latest_step() and TensorFlow's latest_checkpoint: 10 beats 2, and an
    unfinished save (Orbax's tmp folder) or a stray numbered folder is not a step."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "run", run)
    (run / "11.orbax-checkpoint-tmp-1700000000").mkdir()
    (run / "12").mkdir()  # no step metadata: not finished
    with cv.open(run) as reader:
        assert reader.format == "orbax"
        assert reader.path == run / "10"
        meta = reader.metadata()
        assert meta["orbax.latest_step"] == 10 and meta["orbax.steps"] == [2, 10]
        assert int(reader["step"].read()) == 10
    assert float(cv.load(run)["w"][0, 0]) == 10.0
    shown = ckpt("inspect", run)
    assert shown.returncode == 0, shown.stderr
    assert "orbax.latest_step: 10" in shown.stdout and "orbax.steps" in shown.stdout
    shutil.rmtree(run / "10")
    with cv.open(run) as reader:
        assert reader.metadata()["orbax.latest_step"] == 2 and int(reader["step"].read()) == 2
    for step in ("2", "12"):
        shutil.rmtree(run / step)
    with pytest.raises(cv.CkptError):
        cv.open(run)


ZARR3 = FIXTURES / "zarr3_step"


def _shard_index(shard: Path, entries: list[tuple[int, int]]) -> None:
    """Rewrite a one-chunk shard's trailing index (offset, nbytes) and its CRC-32C."""
    from ckptvar.storage.checksum import crc32c

    raw = shard.read_bytes()
    body = b"".join(o.to_bytes(8, "little") + n.to_bytes(8, "little") for o, n in entries)
    shard.write_bytes(raw[: -len(body) - 4] + body + crc32c(body).to_bytes(4, "little"))


def test_zarr3_items_are_read_and_damage_is_refused(tmp_path: Path) -> None:
    """use_zarr3=True (sharding_indexed + zstd, crc32c on the shard index), read without
    Orbax; the same tree as the Zarr v2 step."""
    values = cv.load(ZARR3)
    assert sorted(values) == ["big", "dense/bias", "dense/kernel", "embed", "mask", "zeros"]
    v2 = cv.load(ZARR)
    for key in ("big", "dense/bias", "dense/kernel", "embed"):
        assert values[key].dtype == v2[f"params/{key}"].dtype
        np.testing.assert_array_equal(values[key], v2[f"params/{key}"])
    np.testing.assert_array_equal(values["zeros"], np.zeros((4, 4), np.float32))

    folder = tmp_path / "z3"
    shutil.copytree(ZARR3, folder)
    big = folder / "big" / "c" / "0" / "0"
    size = big.stat().st_size
    data = bytearray(big.read_bytes())
    data[-5] ^= 0xFF  # the index, under its CRC-32C
    big.write_bytes(bytes(data))
    bias = folder / "dense.bias" / "c" / "0"
    _shard_index(bias, [(0, size * 10)])  # an inner chunk past the shard's end
    (folder / "mask" / "c" / "0").unlink()  # a shard never written: the fill value (false)
    kernel = folder / "dense.kernel" / "c" / "0" / "0"
    _shard_index(kernel, [((1 << 64) - 1, (1 << 64) - 1)])  # an inner chunk never written
    with cv.open(folder) as reader:
        with pytest.raises(cv.CorruptCheckpointError, match=r"'big/c/0/0'.*CRC-32C"):
            reader.read("big")
        with pytest.raises(cv.CorruptCheckpointError, match="outside its"):
            reader.read("dense/bias")
        np.testing.assert_array_equal(reader.read("mask"), np.zeros(3, bool))
        np.testing.assert_array_equal(reader.read("dense/kernel"), np.zeros((4, 3), np.float32))
    meta = json.loads((folder / "embed" / "zarr.json").read_text())
    meta["codecs"][0]["configuration"]["codecs"].append({"name": "blosc", "configuration": {}})
    (folder / "embed" / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(cv.UnsupportedFormatError, match="codec 'blosc' is not read"):
        cv.open(folder)
