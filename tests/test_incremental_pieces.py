"""Incremental Zarr steps store a large value as several chunk files (format 1.4, "Pieces"
in docs/FORMAT.md): a step shares the unchanged chunks of a partly changed value (an
embedding table with a few rows touched) and writes only the changed ones; every step
still loads bit-exact with ckptvar and plain zarr-python."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import zarr

import ckptvar as cv
from ckpt_runs import ckpt as ckpt_cli

PIECE = 4 << 20  # the writer's chunk size (ZarrWriter's PIECE_BYTES)
ROW = 64 * 4  # bytes per table row
ROWS_PER_PIECE = PIECE // ROW
ROWS = 5 * ROWS_PER_PIECE + 1000  # 5 whole chunks and a short (padded) last one


def _added(step: Path) -> int:
    """Bytes a step added on disk: files linked from another step add none."""
    return sum(p.stat().st_size for p in step.rglob("*") if p.is_file() and p.stat().st_nlink == 1)


def _model() -> tuple[cv.Checkpoint, cv.Variable]:
    table = cv.Variable(np.random.default_rng(0).random((ROWS, 64), dtype=np.float32),
                        name="table")
    odd = cv.Variable(np.arange(600_000 * 3, dtype=np.float32).reshape(600_000, 3),
                      name="odd")  # 12-byte rows: chunks of a whole number of blocks
    return cv.Checkpoint(table=table, odd=odd, step=cv.Variable(0, name="step")), table


def test_a_partly_changed_table_writes_only_its_changed_chunks(tmp_path: Path,
                                                               fresh_graph: cv.Graph) -> None:
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format="zarr", max_to_keep=2,
                                   incremental=True)
    first = Path(manager.save())
    assert zarr.open_group(first, mode="r")["table"].chunks == (ROWS_PER_PIECE, 64)
    chunks = sorted(n for n in os.listdir(first / "table") if n.startswith("c."))
    assert chunks == [f"c.{i}.0" for i in range(6)]
    assert (first / "table" / "c.5.0").stat().st_size == PIECE  # padded, as Zarr stores it

    hot = np.arange(2 * ROWS_PER_PIECE + 10, 2 * ROWS_PER_PIECE + 400)  # in chunk 2 only
    new = table.numpy()
    new[hot] += 1.0
    # a whole write: changed, its rows unknown (a scatter would be a row delta, format
    # 1.5: tests/test_row_deltas.py); so the chunks are compared by checksum
    table.assign(new)
    before = {n: (first / "table" / n).stat().st_ino for n in chunks}
    second = Path(manager.save())
    added = _added(second)
    assert PIECE <= added <= 1.10 * PIECE, added  # one chunk of six (+ the small values)
    for n in chunks:  # the other chunks are the same files
        same = (second / "table" / n).stat().st_ino == before[n]
        assert same == (n != "c.2.0"), n
    want = table.numpy().copy()

    # a third step (nothing changed) prunes the first: the second stands alone, bit-exact
    third = Path(manager.save())
    assert _added(third) < 64 << 10  # every chunk linked: only documents and the record
    assert not first.exists()
    got = cv.load(second)
    assert np.array_equal(got["table"], want)
    assert np.array_equal(got["odd"], ckpt.odd.numpy())
    group = zarr.open_group(second, mode="r")  # plain zarr-python reads the chunks
    assert np.array_equal(group["table"][:], want) and np.array_equal(group["odd"][:],
                                                                      ckpt.odd.numpy())
    with cv.open(second) as reader:  # a slice across two chunks reads only its bytes
        lo = 3 * ROWS_PER_PIECE - 5
        assert np.array_equal(reader["table"][lo: lo + 10], want[lo: lo + 10])
        assert np.array_equal(reader["table"][ROWS - 3:], want[ROWS - 3:])
    table.assign(np.zeros((ROWS, 64), np.float32))
    ckpt.restore(str(second))
    assert np.array_equal(table.numpy(), want)
    res = ckpt_cli("verify", second)
    assert res.returncode == 0, res.stdout + res.stderr


def test_chunks_compared_as_written_carry_the_values_checksums(tmp_path: Path,
                                                               fresh_graph: cv.Graph) -> None:
    """A changed value whose chunks are compared with the base's is hashed a chunk at a
    time as it is written: the checksums it records are those of a full save (the padded
    last chunk and 12-byte rows included), and only its changed chunks are new files."""
    ckpt, table = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format="zarr", max_to_keep=3,
                                   incremental=True)
    first = Path(manager.save())
    new = table.numpy().copy()
    new[-5:] += 1.0  # the short last chunk only
    table.assign(new)
    ckpt.odd.assign(ckpt.odd.numpy() * 2.0)  # every chunk of it
    second = Path(manager.save())
    linked = {n for n in os.listdir(second / "table") if n.startswith("c.")
              and (second / "table" / n).stat().st_ino == (first / "table" / n).stat().st_ino}
    assert linked == {f"c.{i}.0" for i in range(5)}
    assert not any((second / "odd" / n).stat().st_nlink > 1
                   for n in os.listdir(second / "odd") if n.startswith("c."))
    full = cv.save(tmp_path / "full.zarr", {"table": table.numpy(), "odd": ckpt.odd.numpy()})
    with cv.open(second) as step, cv.open(full) as alone:
        for key in ("table", "odd"):
            assert step.entry(key).checksum == alone.entry(key).checksum, key
            assert step.entry(key).blocks == alone.entry(key).blocks, key
    res = ckpt_cli("verify", second)
    assert res.returncode == 0, res.stdout + res.stderr
    assert np.array_equal(zarr.open_group(second, mode="r")["table"][:], new)


def test_a_damaged_or_missing_chunk_is_reported(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, _ = _model()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", format="zarr", incremental=True)
    step = Path(manager.save())
    chunk = step / "table" / "c.3.0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with cv.open(step) as reader, pytest.raises(cv.errors.CorruptCheckpointError,
                                                match="'table'"):
        reader.verify("table")
    chunk.unlink()
    with pytest.raises(cv.errors.CorruptCheckpointError, match=r"c\.3\.0"):
        cv.load(step)


def test_a_full_manager_stores_one_chunk_per_value(tmp_path: Path,
                                                   fresh_graph: cv.Graph) -> None:
    """Only incremental managers store values in several chunks: an ordinary save, and
    what readers of format 1.3 and older read, is unchanged."""
    ckpt, _ = _model()
    step = Path(cv.CheckpointManager(ckpt, tmp_path / "run", format="zarr").save())
    assert sorted(n for n in os.listdir(step / "table") if n.startswith("c.")) == ["c.0.0"]
    with cv.open(step) as reader:
        assert reader.record.format_version == (1, 2)


def test_a_process_file_of_a_multi_process_step_shares_its_chunks(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """The collective path (a coordinator, a sharded variable): a bfloat16 table (no
    global Zarr array for that dtype) is stored in the process's own Zarr tree, in
    chunks, and a step shares the unchanged ones with the base step's tree."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rows = 3 * (PIECE // 128) + 7  # 64 bfloat16 = 128 bytes a row: 3 chunks and a bit
    value = np.random.default_rng(1).random((rows, 64)).astype(ml_dtypes.bfloat16)
    table = cv.Variable(value, name="table", shard=cv.Shard(full_shape=(rows, 64),
                                                            offset=(0, 0)))
    coord = cv.distributed.SingleProcessCoordinator()
    manager = cv.CheckpointManager(cv.Checkpoint(table=table), tmp_path / "run",
                                   format="zarr", incremental=True, coordinator=coord)
    first = Path(manager.save())
    changed = table.numpy()
    changed[5:9] += 1.0  # chunk 0 only, assigned whole: no row log to make it a row delta
    table.assign(changed)
    second = Path(manager.save())
    files = sorted((second / "rank-00000.zarr").rglob("c.*.0"))
    assert len(files) == 4
    shared = [f.stat().st_nlink == 2 for f in files]
    assert shared == [False, True, True, True], files
    assert np.array_equal(cv.load(second)["table"].view(np.uint16),
                          table.numpy().view(np.uint16))
    with cv.open(second) as reader:
        assert reader.shared() == {"table": [first.name]}


def test_a_record_whose_pieces_do_not_fit_is_refused(tmp_path: Path) -> None:
    """A forged record: ``pieces`` for a value stored as one chunk (its first chunk is
    then the wrong size), or rows that no chunking of its shape has."""
    import json

    from ckptvar.storage import _record
    from ckptvar.storage import checksum as _checksum

    def forge(path: Path, pieces: dict[str, int]) -> None:
        rec_file = path / "_ckptvar" / "record" / "c.0"
        rec = _record.decode(rec_file.read_bytes(), path, container="zarr")
        rec.pieces = pieces
        new = _record.encode(rec)
        rec_file.write_bytes(new)
        meta = json.loads((path / "zarr.json").read_text())
        meta["attributes"]["ckptvar"].update(record_nbytes=len(new),
                                             record_crc32c=_checksum.crc(new))
        (path / "zarr.json").write_text(json.dumps(meta))

    value = np.arange(1000 * 64, dtype=np.float32).reshape(1000, 64)
    for pieces, says in (({"w": 10}, "chunk of"), ({"w": 1000}, "rows per chunk")):
        p = tmp_path / f"forged-{pieces['w']}.zarr"
        cv.save(p, {"w": value})
        forge(p, pieces)
        with pytest.raises(cv.errors.CorruptCheckpointError, match=says):
            cv.load(p)


def test_a_restore_opens_each_chunk_file_once(tmp_path: Path, fresh_graph: cv.Graph,
                                               request: pytest.FixtureRequest) -> None:
    """A value in several chunk files is opened once per reader: the probes, the verify
    pass and the read pass of a restore share the descriptors (opening its 16 chunks at
    each of the restore's 18 opens of the value cost a fifth of its restore), and
    closing the reader closes them."""
    # 64 MiB: a restore reads and hashes it in pieces on the I/O threads, each piece of
    # work opening the value
    table = cv.Variable(np.random.default_rng(1).random((16 * ROWS_PER_PIECE, 64),
                                                        dtype=np.float32), name="table")
    ckpt = cv.Checkpoint(table=table)
    step = Path(cv.CheckpointManager(ckpt, tmp_path / "run", format="zarr",
                                     incremental=True).save())
    want = table.numpy()
    ours = {p.stat().st_ino: p.name for p in (step / "table").iterdir() if p.name.startswith("c.")}
    assert len(ours) == 16
    opened = request.getfixturevalue("zarr_opens")  # from here on
    fds_before = len(os.listdir("/proc/self/fd"))
    table.assign(np.zeros_like(want))
    ckpt.restore(str(step)).assert_consumed()
    assert np.array_equal(table.numpy(), want)
    assert {ours[i]: opened.get(i, 0) for i in ours} == {name: 1 for name in ours.values()}
    assert len(os.listdir("/proc/self/fd")) <= fds_before  # the reader let them go
