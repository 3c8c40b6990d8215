"""Hugging Face sharded safetensors: read as one checkpoint (lazily, shard by shard), written in
the layout transformers writes, loaded back by the real transformers 5; safetensors output of
``ckpt convert`` carries ``format: pt`` (what transformers 4 and 5 require of a header)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from ckpt_runs import ckpt_processes

import ckptvar as cv
from ckptvar.cli import main

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf_sharded"
INDEX = FIXTURE / "model.safetensors.index.json"
#: what transformers 4.57 and 5 accept as a safetensors file's metadata "format"
HF_FORMATS = ("pt", "tf", "flax", "mlx")


def ckpt(*args: object) -> subprocess.CompletedProcess[str]:
    """``ckpt ARGS`` run in this process (start-up would dominate); a completed process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _header(path: Path) -> dict[str, object]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header: dict[str, object] = json.loads(raw[8 : 8 + n])
    return header


def _hf_header_rule(path: Path) -> None:
    """transformers' check on a safetensors file (modeling_utils): metadata, when present,
    names a known format."""
    meta = _header(path).get("__metadata__")
    assert meta is None or (isinstance(meta, dict) and meta.get("format") in HF_FORMATS), meta


def _shard_fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(FIXTURE)) and target.endswith(".safetensors"):
            out.append(target)
    return out


def test_a_read_opens_only_the_shard_it_needs() -> None:
    weight_map = json.loads(INDEX.read_text())["weight_map"]
    last = sorted(set(weight_map.values()))[-1]
    key = next(k for k, v in weight_map.items() if v == last)
    for path in (FIXTURE, INDEX):  # the folder or its index
        before = _shard_fds()
        with cv.open(path) as reader:
            assert reader.format == "hf-safetensors"
            assert list(reader) == list(weight_map)  # listing opens no shard
            assert _shard_fds() == before
            row = reader[key][:1]
            assert reader.open_files == [FIXTURE / last]  # type: ignore[attr-defined]
            assert _shard_fds() == [*before, str(FIXTURE / last)]
            np.testing.assert_array_equal(row, reader.read(key)[:1])
        assert _shard_fds() == before
    assert cv.load(INDEX).keys() == weight_map.keys()


def test_every_command_takes_the_folder_or_the_index(tmp_path: Path) -> None:
    key = "encoder.layer.1.output.dense.weight"
    out = tmp_path / "one.safetensors"
    inspect, show, verify, conv = ckpt_processes(
        ("inspect", FIXTURE), ("show", INDEX, key), ("verify", FIXTURE), ("convert", INDEX, out)
    )
    assert inspect.returncode == 0, inspect.stderr
    assert "format: hf-safetensors" in inspect.stdout and key in inspect.stdout
    assert "total_size: 25280" in inspect.stdout
    assert show.returncode == 0 and "(16, 32)" in show.stdout, show.stderr
    assert verify.returncode == 0 and "READABLE: 39 values" in verify.stdout, verify.stdout
    assert conv.returncode == 0, conv.stderr
    diff = ckpt("diff", FIXTURE, out)
    assert diff.returncode == 0 and "Equal: 39 values" in diff.stdout, diff.stdout + diff.stderr


def test_convert_writes_the_transformers_layout(tmp_path: Path) -> None:
    mid, dst = tmp_path / "model.h5", tmp_path / "hf"
    assert ckpt("convert", FIXTURE, mid).returncode == 0
    proc = ckpt("convert", mid, dst, "--format", "hf-safetensors", "--max-shard-size", "10KB",
                "--metadata", "origin=test")
    assert proc.returncode == 0, proc.stderr
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    with cv.open(FIXTURE) as src:
        assert set(index["weight_map"]) == set(src)
        assert index["metadata"]["total_size"] == sum(src.info(k).nbytes for k in src)
        expected = {k: src.read(k) for k in src}
    for shard in shards:
        meta = _header(dst / shard)["__metadata__"]
        assert isinstance(meta, dict) and meta["format"] == "pt" and meta["origin"] == "test"
        assert os.path.getsize(dst / shard) <= 10_000 + 4096  # the limit, plus the header
    got = cv.load(dst)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        np.testing.assert_array_equal(got[k], v)
    # A single-shard model is one model.safetensors, as transformers writes it.
    small = tmp_path / "small"
    assert ckpt("convert", mid, small, "--format", "hf-safetensors").returncode == 0
    assert sorted(p.name for p in small.iterdir()) == ["model.safetensors"]
    assert cv.load(small).keys() == expected.keys()


def test_max_shard_size_is_checked_before_anything_is_written(tmp_path: Path) -> None:
    bad = ckpt("convert", INDEX, tmp_path / "x", "--format", "hf-safetensors",
               "--max-shard-size", "5 parsecs")
    assert bad.returncode == 2 and "not a size" in bad.stderr
    wrong = ckpt("convert", INDEX, tmp_path / "x.h5", "--max-shard-size", "5GB")
    assert wrong.returncode == 2 and "hf-safetensors only" in wrong.stderr
    assert not list(tmp_path.iterdir())


def test_the_writer_takes_the_folder_not_the_index(tmp_path: Path) -> None:
    with pytest.raises(cv.UnsupportedFormatError, match="writes a folder"):
        cv.save(tmp_path / "m" / "model.safetensors.index.json", {"w": np.ones(2)})
    assert not (tmp_path / "m" / "model.safetensors.index.json").exists()


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(FIXTURE, copy)
    return copy


def test_damaged_and_hostile_folders_are_refused_naming_the_file(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    first = copy / "model-00001-of-00002.safetensors"
    first.write_bytes(first.read_bytes()[:5000])  # truncated
    weight_map = json.loads(INDEX.read_text())["weight_map"]
    key = next(k for k, v in weight_map.items() if v == "model-00002-of-00002.safetensors")
    with cv.open(copy) as reader:  # the index alone is fine
        assert reader.read(key).size  # the other shard still reads
        with pytest.raises(cv.CorruptCheckpointError, match="model-00001-of-00002"):
            reader.read("embeddings.word_embeddings.weight")
    verify = ckpt("verify", copy)
    assert verify.returncode == 1 and "model-00001-of-00002" in verify.stdout

    copy2 = tmp_path / "missing"
    shutil.copytree(FIXTURE, copy2)
    (copy2 / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(cv.CorruptCheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        cv.open(copy2)

    index = json.loads(INDEX.read_text())
    for name, bad, pattern in (
        ("escape", {**index, "weight_map": {"w": "../../etc/passwd"}}, "not a file name"),
        ("nomap", {"metadata": {}}, "no 'weight_map'"),
        ("elsewhere", {**index, "weight_map": {"not.there": "model-00002-of-00002.safetensors"}},
         "does not hold it"),
    ):
        folder = tmp_path / name
        shutil.copytree(FIXTURE, folder)
        (folder / "model.safetensors.index.json").write_text(json.dumps(bad))
        with pytest.raises(cv.CorruptCheckpointError, match=pattern):
            with cv.open(folder) as reader:
                for k in reader:
                    reader.read(k)
    folder = tmp_path / "notjson"
    shutil.copytree(FIXTURE, folder)
    (folder / "model.safetensors.index.json").write_bytes(b"{\"weight_map\": [")
    with pytest.raises(cv.CorruptCheckpointError, match="not valid JSON"):
        cv.open(folder)


def test_convert_never_replaces_a_model_folder_holding_other_files(tmp_path: Path) -> None:
    copy = _copy(tmp_path)  # holds config.json beside the shards
    proc = ckpt("convert", INDEX, copy, "--format", "hf-safetensors", "--force")
    assert proc.returncode != 0 and "left as it is" in proc.stderr
    assert (copy / "config.json").exists()


def _saver_h5(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A BERT's weights saved by cv.Saver under their Hugging Face names."""
    values = cv.load(FIXTURE)
    with cv.Graph().as_default():
        var_list = {k: cv.Variable(v, name=k.replace(".", "_")) for k, v in values.items()}
        path = cv.Saver(var_list=var_list).save(tmp_path / "bert", global_step=3)
    return Path(path), values


def test_safetensors_from_a_saver_checkpoint_carries_format_pt(tmp_path: Path) -> None:
    src, _ = _saver_h5(tmp_path)
    plain, extra = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert ckpt("convert", src, plain).returncode == 0
    proc = ckpt("convert", src, extra, "--metadata", "license=apache-2.0", "--metadata", "k=v=w")
    assert proc.returncode == 0, proc.stderr
    assert "format=pt" in proc.stdout  # the added entry is said, never silent
    for path in (plain, extra):
        meta = _header(path)["__metadata__"]
        assert isinstance(meta, dict) and meta["format"] == "pt", meta
        assert "ckptvar.metadata" in meta  # the Saver's metadata is still there
        _hf_header_rule(path)
    meta = _header(extra)["__metadata__"]
    assert isinstance(meta, dict) and meta["license"] == "apache-2.0" and meta["k"] == "v=w"
    bad = ckpt("convert", src, tmp_path / "c.safetensors", "--metadata", "novalue")
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


@pytest.mark.slow  # importing transformers alone takes 4 s of CPU (15 s on a busy machine)
def test_transformers_loads_what_convert_writes(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the test extra installs it")
    src, values = _saver_h5(tmp_path)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    assert ckpt("convert", src, single / "model.safetensors").returncode == 0
    assert ckpt("convert", src, sharded, "--format", "hf-safetensors",
                "--max-shard-size", "8KB").returncode == 0
    for folder in (single, sharded):
        shutil.copy(FIXTURE / "config.json", folder / "config.json")
        model = transformers.BertModel.from_pretrained(folder)
        state = model.state_dict()
        assert set(state) == set(values)
        for key, value in values.items():
            np.testing.assert_array_equal(state[key].numpy(), value, err_msg=key)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("CKPTVAR_TRANSFORMERS4_PYTHON"),
    reason="set CKPTVAR_TRANSFORMERS4_PYTHON to a Python with transformers 4.x and torch "
    "(a throwaway venv: pip install torch 'transformers==4.57.*'); transformers 5 is in the "
    "test extra and cannot share one environment with 4",
)
def test_transformers_4_loads_what_convert_writes(tmp_path: Path) -> None:
    python = os.environ["CKPTVAR_TRANSFORMERS4_PYTHON"]
    src, values = _saver_h5(tmp_path)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    assert ckpt("convert", src, single / "model.safetensors").returncode == 0
    assert ckpt("convert", src, sharded, "--format", "hf-safetensors",
                "--max-shard-size", "8KB").returncode == 0
    np.savez(tmp_path / "expected.npz", **values)
    code = (
        "import sys, numpy as np, transformers\n"
        "assert transformers.__version__.startswith('4.'), transformers.__version__\n"
        "want = np.load(sys.argv[1])\n"
        "for folder in sys.argv[2:]:\n"
        "    state = transformers.BertModel.from_pretrained(folder).state_dict()\n"
        "    assert set(state) == set(want.files), folder\n"
        "    for k in want.files:\n"
        "        assert np.array_equal(state[k].numpy(), want[k]), (folder, k)\n"
        "print('ok')\n"
    )
    for folder in (single, sharded):
        shutil.copy(FIXTURE / "config.json", folder / "config.json")
    proc = subprocess.run([python, "-c", code, str(tmp_path / "expected.npz"), str(single),
                           str(sharded)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _two_shards(folder: Path, one: dict[str, np.ndarray], two: dict[str, np.ndarray],
                weight_map: dict[str, str] | str) -> Path:
    folder.mkdir()
    cv.save(folder / "model-00001-of-00002.safetensors", one)
    cv.save(folder / "model-00002-of-00002.safetensors", two)
    text = weight_map if isinstance(weight_map, str) else json.dumps({"weight_map": weight_map})
    (folder / "model.safetensors.index.json").write_text(text)
    return folder


def test_a_value_a_shard_holds_but_the_index_does_not_list_is_never_dropped_silently(
    tmp_path: Path,
) -> None:
    """Such a value used to vanish: ``ckpt verify`` said READABLE and ``ckpt convert`` wrote
    the others, exit 0. It is now in ``reader.skipped`` (convert refuses it by name unless
    --skip-unreadable) and ``ckpt verify`` fails naming it."""
    a, b, c = np.arange(4, dtype="f4"), np.ones(3, "i8"), np.zeros(2, "f2")
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    folder = _two_shards(tmp_path / "m", {"a": a, "b": b}, {"c": c}, {"a": s1, "c": s2})
    with cv.open(folder) as reader:
        assert list(reader) == ["a", "c"]
        assert reader.read("a").tolist() == a.tolist()  # one value still reads alone
        assert set(reader.skipped) == {"b"} and s1 in reader.skipped["b"]
    proc = ckpt("convert", folder, tmp_path / "out.npz")
    assert proc.returncode == 2 and "'b'" in proc.stderr and not (tmp_path / "out.npz").exists()
    proc = ckpt("convert", folder, tmp_path / "out.npz", "--skip-unreadable")
    assert proc.returncode == 0 and "'b'" in proc.stdout, proc.stdout
    verify = ckpt("verify", folder)
    assert verify.returncode == 1 and "DAMAGED  b:" in verify.stdout and s1 in verify.stdout
    inspect = ckpt("inspect", folder)
    assert inspect.returncode == 0 and "skipped" in inspect.stdout and "b" in inspect.stdout

    # a second copy of a listed value in another shard: the index's copy reads, verify flags it
    dup = _two_shards(tmp_path / "dup", {"a": a, "b": b}, {"b": b + 1}, {"a": s1, "b": s2})
    with cv.open(dup) as reader:
        assert reader.read("b").tolist() == (b + 1).tolist() and not reader.skipped
    verify = ckpt("verify", dup)
    assert verify.returncode == 1 and "DAMAGED  b:" in verify.stdout and s2 in verify.stdout


def test_an_index_listing_a_key_twice_is_refused(tmp_path: Path) -> None:
    """JSON's last-one-wins used to pick one of the two shards silently."""
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    text = f'{{"weight_map": {{"a": "{s1}", "b": "{s2}", "a": "{s2}"}}}}'
    folder = _two_shards(tmp_path / "m", {"a": np.ones(2)}, {"b": np.ones(2), "a": np.zeros(2)},
                         text)
    with pytest.raises(cv.CorruptCheckpointError,
                       match=r"index .*model\.safetensors\.index\.json' is refused: it names the "
                             r"key 'a' twice") as err:
        cv.open(folder)
    assert "not valid JSON" not in str(err.value)  # it is valid JSON: a key named twice
    proc = ckpt("inspect", folder)
    assert proc.returncode == 2 and "names the key 'a' twice" in proc.stderr


def test_a_model_folder_named_like_a_safetensors_file_opens(tmp_path: Path) -> None:
    """``ckpt convert a.safetensors out.safetensors --format hf-safetensors`` writes a folder
    named ``out.safetensors``; reading it went by the suffix to the single-file reader
    and failed ("is a directory"), so ckptvar could not read back what it wrote."""
    src = tmp_path / "a.safetensors"
    cv.save(src, {"w": np.arange(3.0)})
    out = tmp_path / "out.safetensors"
    assert ckpt("convert", src, out, "--format", "hf-safetensors").returncode == 0
    assert out.is_dir()
    with cv.open(out) as reader:
        assert reader.format == "hf-safetensors" and reader.read("w").tolist() == [0, 1, 2]
    proc = ckpt("inspect", out)
    assert proc.returncode == 0 and "hf-safetensors" in proc.stdout


def test_shards_and_total_size_count_packed_sub_byte_values_as_stored(tmp_path: Path) -> None:
    # a float4 value is stored two to a byte: 64 values take 32 bytes of a shard, as
    # transformers counts them (numel x element size of torch's float4_e2m1fn_x2)
    import ml_dtypes  # noqa: PLC0415 - installed with ckptvar

    values = {f"l{i}": np.arange(64).astype(ml_dtypes.float4_e2m1fn) for i in range(4)}
    values["x"] = np.ones(8, np.float32)
    folder = cv.save(tmp_path / "m", values, format="hf-safetensors", max_shard_size=64)
    index = json.loads((Path(folder) / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 4 * 32 + 32
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    back = cv.load(folder)
    for key, value in values.items():
        assert back[key].tobytes() == value.tobytes(), key
