"""PyTorch files: hostile pickles never run, hostile sizes are refused before allocation.

The oracles: a marker file that the payload would create, and a Python audit
hook (in a child process) recording os.system / exec / compile / subprocess events
while ckptvar reads the files. A positive control shows the same payloads do
run under plain ``pickle.loads``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import CkptError, CorruptCheckpointError, UnsupportedFormatError
from ckptvar.formats import TorchBackend

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class _Reduce:
    """Pickles as a call of ``fn(*args)`` (what an attacker's payload looks like)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _zip_pt(path: Path, pkl: bytes, members: dict[str, bytes] | None = None,
            top: str = "archive", compress: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compress) as zf:
        zf.writestr(f"{top}/data.pkl", pkl)
        zf.writestr(f"{top}/byteorder", "little")
        zf.writestr(f"{top}/version", "3\n")
        for name, data in (members or {}).items():
            zf.writestr(f"{top}/{name}", data)
    return path


def _legacy_pt(path: Path, pkl: bytes, keys: list[str] | None = None,
               storages: list[bytes] | None = None) -> Path:
    buf = io.BytesIO()
    for obj in (LEGACY_MAGIC, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(obj, buf, protocol=2)
    buf.write(pkl)
    pickle.dump(keys or [], buf, protocol=2)
    for data in storages or []:
        buf.write(data)
    path.write_bytes(buf.getvalue())
    return path


def _tensor_pickle(numel: int, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                   storage: str = "FloatStorage") -> bytes:
    """A hand-written protocol-2 pickle of {'w': tensor}, as torch.save writes it."""

    def pint(n: int) -> bytes:
        return b"J" + struct.pack("<i", n) if n < 2**31 else b"\x8a\x08" + struct.pack("<q", n)

    def ptuple(t: tuple[int, ...]) -> bytes:
        return b"(" + b"".join(pint(v) for v in t) + b"t"

    return (
        b"\x80\x02}X\x01\x00\x00\x00w"
        b"ctorch._utils\n_rebuild_tensor_v2\n("
        b"(X\x07\x00\x00\x00storage"
        + f"ctorch\n{storage}\n".encode()
        + b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpu" + pint(numel) + b"tQ"
        + pint(offset) + ptuple(size) + ptuple(stride)
        + b"\x89ccollections\nOrderedDict\n)RtRs."
    )


def test_hand_built_tensor_pickle_reads(tmp_path: Path) -> None:
    data = np.arange(6, dtype="<f4").tobytes()
    path = _zip_pt(tmp_path / "ok.pt", _tensor_pickle(6, 1, (2, 2), (1, 2)), {"data/0": data})
    with cv.open(path) as reader:
        np.testing.assert_array_equal(reader["w"].read(), np.array([[1, 3], [2, 4]], "f4"))


# --------------------------------------------------------------------------- hostile files


def _hostile_files(tmp: Path, marker: Path) -> dict[str, Path]:
    touch = f"open({str(marker)!r}, 'w').write('pwned')"
    payloads = {
        "system": pickle.dumps({"w": _Reduce(os.system, f"touch {marker}")}, protocol=2),
        "eval_stack_global": pickle.dumps({"w": _Reduce(eval, touch)}, protocol=4),
        "exec": pickle.dumps(_Reduce(exec, touch), protocol=4),
        "getattr_chain": pickle.dumps(
            _Reduce(getattr, _Reduce(__import__, "os"), "system"), protocol=4
        ),
    }
    files = {}
    for name, pkl in payloads.items():
        files[f"zip_{name}"] = _zip_pt(tmp / f"{name}.pt", pkl)
        files[f"legacy_{name}"] = _legacy_pt(tmp / f"{name}_legacy.pt", pkl)
    # An allowed global whose state the pickle tries to overwrite (BUILD).
    build = (b"\x80\x02ctorch\nFloatStorage\n}X\x08\x00\x00\x00np_dtypeX\x01\x00\x00\x00Osb.")
    files["build_on_allowed"] = _zip_pt(tmp / "build.pt", build)
    # TorchScript archive.
    files["torchscript"] = _zip_pt(
        tmp / "script.pt", pickle.dumps({}, protocol=2),
        {"constants.pkl": pickle.dumps((), protocol=2), "code/__torch__.py": b"def f(): pass"},
    )
    return files


CHILD = r"""
import json, sys
events = []
watch = ("os.system", "exec", "compile", "subprocess.Popen", "os.exec", "os.posix_spawn",
         "os.spawn", "os.fork", "ctypes.dlopen", "import")
armed = False
def hook(event, args):
    if armed and event.startswith(watch):
        events.append([event, repr(args)[:200]])
sys.addaudithook(hook)
import ckptvar as cv
import ckptvar.formats  # everything ckptvar needs is imported before arming
cv.open, cv.CkptError  # ckptvar loads its names on first use: load them before arming
import zipfile, io, pickle, struct, numpy, encodings.cp437  # zipfile decodes names lazily
files = json.loads(sys.argv[1])
outcome = {}
armed = True
for name, path in files.items():
    try:
        with cv.open(path, format="torch") as reader:
            [reader[k].read() for k in reader]
        outcome[name] = "loaded"
    except cv.CkptError as exc:
        outcome[name] = type(exc).__name__ + ": " + str(exc)
    except BaseException as exc:
        outcome[name] = "UNEXPECTED " + type(exc).__name__ + ": " + str(exc)
armed = False
print(json.dumps({"outcome": outcome, "events": events}))
"""


def test_malicious_pickles_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    files = _hostile_files(tmp_path, marker)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps({k: str(v) for k, v in files.items()})],
        capture_output=True, text=True, check=True,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["events"] == []
    assert not marker.exists()
    for name, outcome in report["outcome"].items():
        expected = "UnsupportedFormatError" if name == "torchscript" else "CorruptCheckpointError"
        assert outcome.startswith(expected), (name, outcome)
    assert "posix.system" in report["outcome"]["zip_system"]
    assert "builtins.eval" in report["outcome"]["zip_eval_stack_global"]
    assert "TorchScript" in report["outcome"]["torchscript"]
    assert len(report["outcome"]) == 10


def test_positive_control_plain_pickle_would_run_the_payload(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = _hostile_files(tmp_path, marker)["zip_eval_stack_global"]
    code = ("import pickle, zipfile, sys; "
            "pickle.loads(zipfile.ZipFile(sys.argv[1]).read('archive/data.pkl'))")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    assert marker.read_text() == "pwned"


# --------------------------------------------------------------------------- hostile sizes


@pytest.mark.parametrize(
    ("numel", "offset", "size", "stride", "match"),
    [
        (6, 0, (3, 3), (3, 1), "reaches element 8"),
        (6, 6, (1,), (1,), "reaches element 6"),
        (6, 0, (2, 2), (1, 10), "reaches element 11"),
        (6, 0, (2**40, 2**40), (1, 1), "too many elements"),
        (6, -1, (1,), (1,), "offset"),
        (6, 0, (-1,), (1,), "negative"),
        (2**50, 0, (2**50,), (1,), "holds 24 bytes"),
    ],
)
def test_tensor_outside_its_storage_is_refused(
    tmp_path: Path, numel: int, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
    match: str,
) -> None:
    pkl = _tensor_pickle(numel, offset, size, stride)
    data = np.arange(6, dtype="<f4").tobytes()
    path = _zip_pt(tmp_path / "oob.pt", pkl, {"data/0": data})
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=match):
            TorchBackend.open_reader(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 << 20


def test_legacy_storage_out_of_bounds_and_truncation(tmp_path: Path) -> None:
    pkl = _tensor_pickle(6, 0, (6,), (1,))
    good = struct.pack("<q", 6) + np.arange(6, dtype="<f4").tobytes()
    ok = _legacy_pt(tmp_path / "ok.pt", pkl, ["0"], [good])
    np.testing.assert_array_equal(cv.load(ok)["w"], np.arange(6, dtype="f4"))
    short = _legacy_pt(tmp_path / "short.pt", pkl, ["0"], [good[:-4]])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        cv.load(short)
    lying = _legacy_pt(tmp_path / "lie.pt", pkl, ["0"], [struct.pack("<q", 2**40) + good[8:]])
    with pytest.raises(CorruptCheckpointError, match="records"):
        cv.load(lying)


def _set_declared_size(path: Path, member: str, size: int) -> None:
    """Rewrite a member's uncompressed size in both zip headers (a lying archive)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    struct.pack_into("<I", data, info.header_offset + 22, size)
    central = data.rfind(b"PK\x01\x02" + data[data.find(b"PK\x01\x02") + 4 : 0])
    pos = 0
    while True:
        pos = data.find(b"PK\x01\x02", pos)
        assert pos >= 0
        (nlen,) = struct.unpack_from("<H", data, pos + 28)
        if data[pos + 46 : pos + 46 + nlen].decode() == member:
            struct.pack_into("<I", data, pos + 24, size)
            break
        pos += 4
    del central
    path.write_bytes(bytes(data))


def test_zip_bomb_is_refused_before_decompression(tmp_path: Path) -> None:
    path = _zip_pt(tmp_path / "bomb.pt", pickle.dumps({"a": 1}, protocol=2) * 1,
                   compress=zipfile.ZIP_DEFLATED)
    _set_declared_size(path, "archive/data.pkl", 0xFFFF_FFF0)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="zip bomb|limit"):
            cv.open(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 << 20


def test_storage_member_size_must_match_the_pickle(tmp_path: Path) -> None:
    pkl = _tensor_pickle(6, 0, (6,), (1,))
    path = _zip_pt(tmp_path / "s.pt", pkl, {"data/0": b"\x00" * 20})
    with pytest.raises(CorruptCheckpointError, match="holds 20 bytes"):
        cv.open(path)
    path = _zip_pt(tmp_path / "m.pt", pkl, {})
    with pytest.raises(CorruptCheckpointError, match="lacks the storage"):
        cv.open(path)


def test_garbage_and_non_torch_inputs_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "g.pt").write_bytes(b"\x80\x02garbage")
    with pytest.raises(CorruptCheckpointError):
        cv.open(tmp_path / "g.pt")
    (tmp_path / "t.pt").write_bytes(b"hello world")
    with pytest.raises(CorruptCheckpointError, match="neither"):
        cv.open(tmp_path / "t.pt")
    with zipfile.ZipFile(tmp_path / "z.pt", "w") as zf:
        zf.writestr("readme.txt", "x")
    with pytest.raises(CorruptCheckpointError, match="data.pkl"):
        cv.open(tmp_path / "z.pt")
    deep = b"\x80\x02" + b"(" * 100_000 + b"l" * 100_000 + b"."
    _zip_pt(tmp_path / "deep.pt", deep)
    with pytest.raises(CkptError):
        cv.open(tmp_path / "deep.pt")


def test_unsupported_tensor_dtype_is_refused(tmp_path: Path) -> None:
    pkl = _tensor_pickle(2, 0, (2,), (1,), storage="QInt8Storage")
    path = _zip_pt(tmp_path / "q.pt", pkl, {"data/0": b"\x00\x00"})
    with pytest.raises(CorruptCheckpointError, match="QInt8Storage"):
        cv.open(path)


def test_torch_reader_is_read_only(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedFormatError):
        cv.save(tmp_path / "x.pt", {"a": np.zeros(2)})


def test_a_flipped_byte_in_a_storage_fails_the_zip_crc(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parent.parent / "fixtures" / "torch" / "state_dict.pt"
    with cv.open(src) as reader:
        assert reader.info("0.weight").checksum is not None  # the tensor is its whole storage
        assert reader.info("shared.column").checksum is not None  # its storage's CRC-32
        clean = reader["0.weight"].read()
    with zipfile.ZipFile(src) as zf:
        info = zf.getinfo("state_dict/data/0")
    data = bytearray(src.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    data[info.header_offset + 30 + name_len + extra_len + 5] ^= 0x10
    path = tmp_path / "damaged.pt"
    path.write_bytes(bytes(data))
    with cv.open(path) as reader:
        with pytest.raises(CorruptCheckpointError, match="CRC-32"):
            reader["0.weight"].read()
        assert not np.array_equal(reader["0.weight"].read(verify=False), clean)


@pytest.mark.parametrize(
    "pkl",
    [
        b"\x80\x05\x8e" + struct.pack("<Q", 2**31) + b"x",  # BINBYTES8
        b"\x80\x05\x96" + struct.pack("<Q", 2**31) + b"x",  # BYTEARRAY8
        b"\x80\x03B" + struct.pack("<I", 2**31) + b"x",  # BINBYTES
        b"\x80\x04\x95" + struct.pack("<Q", 2**40) + b"x",  # FRAME
        b"\x80\x02\x8b" + struct.pack("<i", 2**31 - 1) + b"x",  # LONG4
    ],
    ids=["binbytes8", "bytearray8", "binbytes", "frame", "long4"],
)
@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_pickle_lengths_never_allocate_what_is_not_there(
    tmp_path: Path, pkl: bytes, layout: str
) -> None:
    path = (_zip_pt if layout == "zip" else _legacy_pt)(tmp_path / "big.pt", pkl)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError):
            cv.open(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 << 20


def _shared_dag(depth: int) -> Any:
    """``[x, x]`` nested ``depth`` times: a few hundred pickle bytes, 2**depth paths."""
    node: Any = 1
    for _ in range(depth):
        node = [node, node]
    return node


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_containers_shared_by_reference_cannot_blow_up_the_key_walk(
    tmp_path: Path, layout: str
) -> None:
    """A 300-byte pickle whose lists share each other used to hang ``cv.open`` (2**40 keys)."""
    pkl = pickle.dumps({"a": _shared_dag(40)}, protocol=2)
    path = (_zip_pt if layout == "zip" else _legacy_pt)(tmp_path / "dag.pt", pkl)
    code = (
        "import sys, ckptvar as cv\n"
        "try:\n    cv.open(sys.argv[1])\n"
        "except cv.CorruptCheckpointError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, check=False,
                         text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:") and "dag.pt" in out.stdout, out.stdout


def test_a_container_shared_by_reference_is_read_under_each_name(tmp_path: Path) -> None:
    """Legitimate sharing (``{"model": sd, "ema": sd}``) still reads, under both prefixes."""
    shared = {"w": 1.5, "n": [1, 2]}
    pkl = pickle.dumps({"model": shared, "ema": shared, "deep": _shared_dag(8)}, protocol=2)
    with cv.open(_zip_pt(tmp_path / "shared.pt", pkl)) as reader:
        meta = reader.metadata()
    assert meta["model.w"] == meta["ema.w"] == 1.5
    assert meta["ema.n.1"] == 2
    assert sum(k.startswith("deep.") for k in meta) == 2**8


def _expanded_file(tmp_path: Path) -> Path:
    """One float32 element viewed 2**33 times (stride 0), as ``torch.zeros(1).expand(n)``
    saves it: 32 GiB as an array, a few hundred bytes as a file."""
    data = np.array([2.5], "<f4").tobytes()
    return _zip_pt(tmp_path / "expanded.pt", _tensor_pickle(1, 0, (2**33,), (0,)), {"data/0": data})


_SMALL_MEMORY = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))"


def _ckpt_limited(*args: object) -> subprocess.CompletedProcess[str]:
    prog = f"{_SMALL_MEMORY}; import sys; from ckptvar.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", prog, *map(str, args)], capture_output=True,
                          text=True, timeout=120, check=False)


def test_verify_checks_a_views_storage_without_building_the_view(tmp_path: Path) -> None:
    """``ckpt verify`` of an expanded tensor used to build all 32 GiB of it (a traceback of
    numpy's MemoryError where memory is short): checking the storage's CRC-32 is enough."""
    path = _expanded_file(tmp_path)
    proc = _ckpt_limited("verify", path)
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout + proc.stderr
    with cv.open(path) as reader:
        assert reader["w"][5:8].tolist() == [2.5] * 3
    raw = bytearray(path.read_bytes())
    raw[raw.index(np.array([2.5], "<f4").tobytes())] ^= 1  # damage the one stored element
    path.write_bytes(bytes(raw))
    proc = _ckpt_limited("verify", path)
    assert proc.returncode == 1 and "DAMAGED  w" in proc.stdout, proc.stdout + proc.stderr


def test_a_value_too_large_for_memory_is_a_one_line_error(tmp_path: Path) -> None:
    proc = _ckpt_limited("convert", _expanded_file(tmp_path), tmp_path / "out.npz")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("ckpt: error: ") and "memory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.npz").exists()


def test_a_small_pickle_cannot_expand_to_a_million_entries(tmp_path: Path) -> None:
    """With a floor of 2**20 entries, a 300-byte pickle ([x, x] twenty deep) still listed a
    million metadata entries (ckpt inspect printed each)."""
    pkl = pickle.dumps({"a": _shared_dag(20)}, protocol=2)
    with pytest.raises(CorruptCheckpointError, match="shared by reference"):
        cv.open(_zip_pt(tmp_path / "dag20.pt", pkl))


def test_a_float4_e2m1fn_x2_tensor_is_read_unpacked(tmp_path: Path) -> None:
    """A ``torch.float4_e2m1fn_x2`` tensor (two FP4 values a byte) was skipped as a dtype
    ckptvar cannot hold. It now reads as ``ml_dtypes.float4_e2m1fn``, one value a byte,
    the last dimension doubled, the first of each pair from the low nibble (as torch's
    own ONNX exporter unpacks it: 0x71 is 0.5 then 6.0), and its attrs say so."""
    import ml_dtypes

    torch = pytest.importorskip("torch")
    raw = torch.tensor([[0x71, 0x02], [0xF3, 0x54], [0x10, 0x0F]], dtype=torch.uint8)
    packed = raw.view(torch.float4_e2m1fn_x2)
    torch.save({"p": packed, "view": packed[1:], "w": torch.ones(2)}, tmp_path / "f4.pt")
    f4 = np.dtype(ml_dtypes.float4_e2m1fn)
    whole = np.array([[0.5, 6, 1, 0], [1.5, -6, 2, 3], [0, 0.5, -6, 0]], f4)
    with cv.open(tmp_path / "f4.pt") as reader:
        assert sorted(reader) == ["p", "view", "w"] and dict(reader.skipped) == {}
        info = reader.info("p")
        assert (info.dtype, info.shape) == (f4, (3, 4))
        assert info.attrs["torch_dtype"] == "float4_e2m1fn_x2"
        assert "low nibble" in info.attrs["unpacked"]
        for key, expected in (("p", whole), ("view", whole[1:])):
            got = reader[key].read()
            assert got.dtype == f4 and got.view(np.uint8).tolist() == (
                expected.view(np.uint8).tolist())
            assert reader[key][-1].view(np.uint8).tolist() == expected[-1].view(np.uint8).tolist()
    with pytest.warns(UserWarning, match="another dtype or shape"):
        loaded = cv.load(tmp_path / "f4.pt")
    assert loaded["p"].view(np.uint8).tolist() == whole.view(np.uint8).tolist()


def test_a_float4_e2m1fn_x2_tensor_unpacked_is_said_by_load_and_convert(tmp_path: Path) -> None:
    """``ckpt convert`` and ``cv.load`` of a ``torch.float4_e2m1fn_x2`` tensor gave it
    unpacked (another dtype, the last dimension doubled) and said nothing; both say it,
    naming the value and the shape the file holds, as they name the values left out."""
    from ckpt_runs import ckpt_processes

    torch = pytest.importorskip("torch")
    raw = torch.tensor([[0x71, 0x02], [0xF3, 0x54]], dtype=torch.uint8)
    src = tmp_path / "f4.pt"
    torch.save({"p": raw.view(torch.float4_e2m1fn_x2), "w": torch.ones(2)}, src)
    with cv.open(src) as reader:
        assert list(reader.changed) == ["p"] and "[2, 2]" in reader.changed["p"]
    with pytest.warns(UserWarning, match=r"gives 1 value.* another dtype or shape") as caught:
        loaded = cv.load(src)
    [said] = [str(w.message) for w in caught]
    assert "'p' (torch.float4_e2m1fn_x2 of shape [2, 2]" in said and "'w'" not in said
    assert loaded["p"].shape == (2, 4)
    proc, only_w = ckpt_processes(("convert", src, tmp_path / "f4.safetensors"),
                                  ("convert", src, tmp_path / "w.safetensors", "--filter", "w"))
    assert proc.returncode == 0, proc.stderr
    assert "Unpacked 1 value" in proc.stdout and "'p'" in proc.stdout, proc.stdout
    assert "float4_e2m1fn_x2 of shape [2, 2]" in proc.stdout, proc.stdout
    assert only_w.returncode == 0 and "Unpacked" not in only_w.stdout, only_w.stdout
