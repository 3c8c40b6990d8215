"""PyTorch DCP directories (made by torch 2.13 ``dcp.save``, one and two processes) read as one
logical checkpoint without torch and without running pickle code; damaged or hostile ones
refused naming the file."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from ckpt_runs import ckpt
from ckpt_runs import ckpt_processes as ckpt_many

import ckptvar as cv
from ckptvar.formats._unpickler import restricted_loads

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "dcp"
TWO = FIXTURES / "two_ranks"


def _open_data_files(folder: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)) and target.endswith(".distcp"):
            out.append(Path(target).name)
    return sorted(out)


def test_sharded_values_are_assembled_and_slices_read_only_their_chunks() -> None:
    with cv.open(TWO) as reader:
        assert reader.format == "dcp"
        assert sorted(reader) == ["bf16", "cols", "replicated", "rows"]
        assert reader.metadata() == {"step": 11}
        np.testing.assert_array_equal(reader["rows"][5:7, 1:3],
                                      np.arange(40, dtype=np.float32).reshape(8, 5)[5:7, 1:3])
        assert _open_data_files(TWO) == ["__1_0.distcp"]  # rows 4..7 live in rank 1's file
        cols = np.arange(36, dtype=np.float64).reshape(3, 12) / 7
        np.testing.assert_array_equal(reader["cols"][:, 2:4], cols[:, 2:4])
        assert _open_data_files(TWO) == ["__0_0.distcp", "__1_0.distcp"]
        np.testing.assert_array_equal(reader.read("cols"), cols)
        np.testing.assert_array_equal(reader["cols"][1, ::-3], cols[1, ::-3])
    assert _open_data_files(TWO) == []


def test_convert_verify_and_inspect(tmp_path: Path) -> None:
    st, hf = tmp_path / "m.safetensors", tmp_path / "hf"
    verify, inspect, conv, proc = ckpt_many(
        ("verify", TWO), ("inspect", FIXTURES / "single"), ("convert", TWO, st),
        ("convert", FIXTURES / "single", hf, "--format", "hf-safetensors",
         "--max-shard-size", "100B"),
    )
    assert verify.returncode == 0, verify.stderr
    assert verify.stdout.startswith("READABLE: 4 values") and "not checksummed" in verify.stdout
    assert "optim.state.0.exp_avg" in inspect.stdout and "optim.param_groups.0.lr: 0.01" in inspect.stdout
    assert conv.returncode == 0, conv.stderr
    assert proc.returncode == 0, proc.stderr
    for src, dst in ((TWO, st), (FIXTURES / "single", hf)):
        want, got = cv.load(src), cv.load(dst)
        assert want.keys() == got.keys()
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v)
    assert len(list(hf.glob("model-*.safetensors"))) > 1


def test_convert_to_our_formats_keeps_an_optimizers_tuples_as_lists(tmp_path: Path) -> None:
    # DCP keeps an optimizer's betas as a tuple, which ckptvar's metadata has no type for:
    # stored as a list, and said, instead of refusing the whole conversion
    h5, zarr = tmp_path / "o.h5", tmp_path / "o.zarr"
    runs = ckpt_many(("convert", FIXTURES / "single", h5), ("convert", FIXTURES / "single", zarr))
    for run, dst in zip(runs, (h5, zarr), strict=True):
        assert run.returncode == 0, run.stderr
        assert "optim.param_groups.0.betas" in run.stdout and "as a list" in run.stdout
        with cv.open(dst) as reader:
            meta = reader.metadata()
        assert meta["optim.param_groups.0.betas"] == [0.9, 0.999] and meta["epoch"] == 3
        want, got = cv.load(FIXTURES / "single"), cv.load(dst)
        assert want.keys() == got.keys()


def _copy(tmp_path: Path, name: str = "two_ranks") -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_a_pickle_naming_any_other_global_is_refused(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(cv.CorruptCheckpointError, match=r"\.metadata.*names the global posix\.system"):
        cv.open(folder)
    # DCP's classes are allowed in a DCP .metadata only, never in a torch.save pickle.
    dcp_global = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81."
    with pytest.raises(cv.CorruptCheckpointError, match="names the global"):
        restricted_loads(dcp_global)


def test_damaged_data_files_are_named(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    data = folder / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:3000])
    with pytest.raises(cv.CorruptCheckpointError, match=r"__1_0\.distcp.*truncated"):
        cv.open(folder)
    folder = _copy(tmp_path, "single")
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(cv.CorruptCheckpointError, match=r"'__0_0\.distcp'.*missing"):
        cv.open(folder)
    folder = tmp_path / "flipped"
    shutil.copytree(TWO, folder)
    raw = bytearray((folder / "__0_0.distcp").read_bytes())
    at = raw.find(np.arange(4, dtype=np.float32).tobytes())  # rows' first values
    assert at > 0
    raw[at + 5] ^= 0x10
    (folder / "__0_0.distcp").write_bytes(bytes(raw))
    with cv.open(folder) as reader:
        with pytest.raises(cv.CorruptCheckpointError, match=r"'rows'.*__0_0\.distcp.*CRC"):
            reader.read("rows")
        np.testing.assert_array_equal(reader["rows"][4:], np.arange(20, 40).reshape(4, 5))
    verify = ckpt("verify", folder)
    assert verify.returncode == 1 and "DAMAGED  rows" in verify.stdout, verify.stdout


def _rewrite_metadata(folder: Path, change: object) -> None:
    """Edit the real DCP metadata with torch (as a hostile writer could) and save it back."""
    torch_dcp = pytest.importorskip("torch.distributed.checkpoint")
    meta = torch_dcp.FileSystemReader(str(folder)).read_metadata()
    change(meta)  # type: ignore[operator]
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def test_chunks_outside_their_value_or_overlapping_are_refused(tmp_path: Path) -> None:
    import torch

    def outside(meta: object) -> None:
        chunk = meta.state_dict_metadata["rows"].chunks[1]  # type: ignore[attr-defined]
        chunk.offsets = torch.Size([6, 0])

    def huge(meta: object) -> None:
        meta.state_dict_metadata["rows"].size = torch.Size([2**40, 2**40])  # type: ignore[attr-defined]

    def overlap(meta: object) -> None:
        sd = meta.state_dict_metadata  # type: ignore[attr-defined]
        sd["rows"].chunks[1].sizes = torch.Size([4, 5])
        sd["rows"].chunks[0].sizes = torch.Size([5, 5])

    for name, change, pattern in (
        ("outside", outside, r"'rows' at \[6, 0\].*outside its shape \[8, 5\]"),
        ("huge", huge, "too many elements|hold 40 elements"),
        ("overlap", overlap, "overlap"),
    ):
        folder = tmp_path / name
        shutil.copytree(TWO, folder)
        if name == "outside":  # keep the storage index pointing at the moved chunk
            def both(meta: object, change: object = change) -> None:
                change(meta)  # type: ignore[operator]
                sd = meta.storage_data  # type: ignore[attr-defined]
                for index in list(sd):
                    if index.fqn == "rows" and tuple(index.offset) == (4, 0):
                        sd[type(index)("rows", torch.Size([6, 0]), index.index)] = sd.pop(index)
            _rewrite_metadata(folder, both)
        else:
            _rewrite_metadata(folder, change)
        with pytest.raises(cv.CorruptCheckpointError, match=pattern):
            cv.open(folder)


def test_dcp_with_safetensors_serialization_is_read_from_its_safetensors_files(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors.torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, -2, 3, 4])}
    writer = FileSystemWriter(tmp_path / "st", serialization_format=SerializationFormat.SAFETENSORS)
    with pytest.warns(UserWarning):  # torch: "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=writer)
    got = cv.load(tmp_path / "st")
    assert got.keys() == state.keys()
    for key, value in state.items():
        np.testing.assert_array_equal(got[key], value.numpy())
    data = tmp_path / "st" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-8])  # a truncated safetensors file
    with cv.open(tmp_path / "st") as reader:
        with pytest.raises(cv.CorruptCheckpointError, match=r"__0_0\.distcp"):
            reader.read("a")


class _EnumsByName(pickle.Pickler):
    """Pickles Enum members by name, ``getattr(cls, name)``, as Python 3.12 (and some
    3.11 releases) do: DCP metadata written there names ``builtins.getattr``."""

    def reducer_override(self, obj: object) -> object:
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_metadata_with_enums_pickled_by_name_is_read_and_getattr_stays_narrow(
    tmp_path: Path,
) -> None:
    torch_dcp = pytest.importorskip("torch.distributed.checkpoint")
    folder = tmp_path / "by_name"
    shutil.copytree(TWO, folder)
    meta = torch_dcp.FileSystemReader(str(folder)).read_metadata()
    with open(folder / ".metadata", "wb") as f:
        _EnumsByName(f, protocol=4).dump(meta)
    assert b"getattr" in (folder / ".metadata").read_bytes()
    np.testing.assert_array_equal(cv.load(folder)["rows"], cv.load(TWO)["rows"])
    # the getattr a DCP pickle may name takes only a member of that enum, nothing else
    from ckptvar.formats._unpickler import DCP_GLOBALS

    with pytest.raises(cv.CorruptCheckpointError, match="only the members"):
        DCP_GLOBALS[("builtins", "getattr")]("x", "upper")


def test_overlapping_chunks_are_refused_however_many_chunks_a_value_has(tmp_path: Path) -> None:
    """Beyond 1024 chunks a value used to be checked by volume only: two chunks overlapping by
    a row and leaving another row uncovered passed, and a read returned that row as whatever
    bytes were in memory. 1023 empty chunks were enough to get past the pairwise check."""
    import torch

    def overlap_and_gap(meta: object) -> None:
        rows = meta.state_dict_metadata["rows"]  # type: ignore[attr-defined]
        first, second = rows.chunks[0], rows.chunks[1]
        first.sizes = torch.Size([5, 5])  # rows 0..4
        second.sizes = torch.Size([3, 5])  # rows 4..6: row 4 twice, row 7 never, 40 elements
        empty = [type(first)(offsets=first.offsets, sizes=torch.Size([0, 5]))] * 1023
        rows.chunks = [first, second, *empty]

    folder = tmp_path / "many"
    shutil.copytree(TWO, folder)
    _rewrite_metadata(folder, overlap_and_gap)
    with pytest.raises(cv.CorruptCheckpointError, match="'rows'.*(overlap|cover)"):
        cv.open(folder)

    def many_chunks(meta: object) -> None:  # the same tiling plus empty chunks still reads
        rows = meta.state_dict_metadata["rows"]  # type: ignore[attr-defined]
        first = rows.chunks[0]
        rows.chunks = [*rows.chunks, *[type(first)(first.offsets, torch.Size([0, 5]))] * 1100]

    good = tmp_path / "good"
    shutil.copytree(TWO, good)
    _rewrite_metadata(good, many_chunks)
    np.testing.assert_array_equal(cv.load(good)["rows"], cv.load(TWO)["rows"])


def test_a_non_tensor_entry_shared_by_reference_is_left_out_not_expanded(tmp_path: Path) -> None:
    """A 300 KB DCP whose non-tensor entries were lists holding each other by reference
    ([x, x] sixteen deep: 65,536 leaves from ~100 bytes each) made ``ckpt inspect`` take
    half a minute and ``--json`` print 700 MB. Such an entry is now listed in skipped."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    node: object = 1
    for _ in range(16):
        node = [node, node]
    folder = tmp_path / "dag"
    with pytest.warns(UserWarning):  # torch: "assuming the intent is to save in a single process"
        dcp.save({"w": torch.ones(2), "dag": node, "lr": 0.5, "sizes": [[1, 2], [1, 2]]},
                 checkpoint_id=str(folder))
    with cv.open(folder) as reader:
        assert list(reader) == ["w"]
        assert "shared" in reader.skipped["dag"], reader.skipped
        meta = reader.metadata()
    assert meta["lr"] == 0.5 and meta["sizes"] == [[1, 2], [1, 2]]
    proc = ckpt("inspect", folder, "--json")
    assert proc.returncode == 0 and len(proc.stdout) < 100_000
