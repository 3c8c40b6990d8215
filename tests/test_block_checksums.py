"""Per-block checksums (format 1.2): a lazy slice reads and verifies only the blocks that
hold it, straight into the result; damage is caught in the blocks read and nowhere else;
files without block checksums still read, a slice then verifying the whole value."""

from __future__ import annotations

import shutil
import tracemalloc
from pathlib import Path

import h5py
import msgpack
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.storage._record_index import INDEX_FROM

MiB = 1 << 20
ROWS, COLS = 1024, 16384  # 64 MiB of float32, 64 KiB rows: one or more rows a block


def _big() -> np.ndarray:
    return np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)


def _data_offset(p: Path, key: str) -> tuple[Path, int]:
    """The file holding ``key``'s bytes and where they start in it."""
    if p.suffix == ".h5":
        with h5py.File(p, "r") as f:
            return p, int(f[key].id.get_offset())
    return p / key / "c.0.0", 0


def _flip(p: Path, key: str, at: int) -> None:
    """Flip one byte of ``key``'s stored bytes, ``at`` bytes into the value."""
    f, base = _data_offset(p, key)
    with open(f, "r+b") as fh:
        fh.seek(base + at)
        b = fh.read(1)
        fh.seek(base + at)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def big() -> np.ndarray:
    return _big()


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_slices_round_trip_through_their_blocks(tmp_path: Path, fmt: str, big: np.ndarray) -> None:
    p = cv.save(tmp_path / f"c.{fmt}", {"w": big, "v": np.arange(70_000, dtype=np.float64)})
    with cv.open(p) as r:
        e = r._values["w"]
        assert e.blocks is not None and len(e.blocks) == 4 * (big.nbytes // r._record.block_size)
        for index in [slice(1, 3), slice(5, 9), 7, (100, slice(3, 900)), slice(1000, None),
                      (slice(10, 200, 7), slice(None, None, -3)), (Ellipsis, 5), -1,
                      slice(300, 100, -1), (slice(0, 0),)]:
            np.testing.assert_array_equal(r["w"][index], big[index])
        v = np.arange(70_000, dtype=np.float64)  # 560,000 bytes: three blocks, not 1 MiB
        assert r._values["v"].blocks is not None
        np.testing.assert_array_equal(r["v"][1000:1010], v[1000:1010])
        assert r.verify_all() == []


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_damage_is_caught_in_the_blocks_read_and_only_there(
    tmp_path: Path, fmt: str, big: np.ndarray
) -> None:
    p = cv.save(tmp_path / f"c.{fmt}", {"w": big})
    row = big[0].nbytes
    with cv.open(p) as r:
        size = r._record.block_size  # rows are 64 KiB: one or more rows a block
    assert size % row == 0
    k = 40 * row // size  # the damaged block: rows lo..hi - 1
    lo, hi = k * size // row, (k + 1) * size // row
    _flip(p, "w", 40 * row + 12)
    with cv.open(p) as r:
        lazy = r["w"]
        for index in [slice(lo, lo + 1), slice(hi - 1, hi), slice(lo - 10, hi + 6), lo,
                      (hi - 1, slice(9, 10))]:
            with pytest.raises(cv.CorruptCheckpointError) as err:
                lazy[index]
            msg = str(err.value)
            assert "'w'" in msg and str(p) in msg and f"block {k} " in msg, msg
        # the blocks around it are intact: slices that do not touch block k still read
        np.testing.assert_array_equal(lazy[lo - 4 : lo], big[lo - 4 : lo])
        np.testing.assert_array_equal(lazy[hi:300], big[hi:300])
        np.testing.assert_array_equal(lazy[lo - 1, 5:], big[lo - 1, 5:])
        with pytest.raises(cv.CorruptCheckpointError, match="checksum"):
            lazy.read()  # the whole value fails its own checksum
        assert [k for k, _ in r.verify_all()] == ["w"]


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_slice_costs_the_slice_in_memory(tmp_path: Path, fmt: str, big: np.ndarray) -> None:
    """16 MiB of rows that start and end inside blocks: read straight into the result;
    the edge blocks' other bytes are hashed through a small buffer."""
    p = cv.save(tmp_path / f"c.{fmt}", {"w": big})
    with cv.open(p) as r:
        lazy = r["w"]
        lazy[0:1]  # first use: the reader's own set-up is not the slice's cost
        tracemalloc.start()
        try:
            got = lazy[101:357]  # 256 rows of 64 KiB: 16 MiB, not block-aligned
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert got.nbytes == 16 * MiB
    np.testing.assert_array_equal(got, big[101:357])
    assert peak <= 1.05 * got.nbytes, peak / got.nbytes


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_files_without_block_checksums_verify_the_whole_value(tmp_path: Path, fmt: str) -> None:
    """The format-1.1 golden file: a slice of its 1.5 MiB value hashes the whole value."""
    src = Path(__file__).parent / "golden" / f"format-1.1.{fmt}"
    p = tmp_path / src.name
    (shutil.copytree if fmt == "zarr" else shutil.copyfile)(src, p)
    with cv.open(p) as r:
        assert r._values["emb"].blocks is None
        emb = r["emb"][10:20]
    _flip(p, "emb", 300 * 4096)  # row 300: outside the slice
    with cv.open(p) as r:
        with pytest.raises(cv.CorruptCheckpointError) as err:
            r["emb"][10:20]
        assert "'emb'" in str(err.value) and "checksum" in str(err.value)
    assert emb.shape == (10, 1024)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_blocks_are_found_through_the_key_index(tmp_path: Path, fmt: str, big: np.ndarray) -> None:
    vals = {f"s/{i}": np.full(3, i, np.int32) for i in range(INDEX_FROM)}
    vals["w"] = big[:64]  # 4 MiB, 64 KiB rows
    p = cv.save(tmp_path / f"c.{fmt}", vals)
    with cv.open(p) as r:
        size, row = r._record.block_size, big[0].nbytes
    _flip(p, "w", 5 * size + 1)  # in block 5, row 5 * size // row
    with cv.open(p) as r:
        np.testing.assert_array_equal(r["w"][0 : 5 * size // row], big[0 : 5 * size // row])
        with pytest.raises(cv.CorruptCheckpointError, match="block 5 "):
            r["w"][5 * size // row]
        assert not r._values.decoded_all  # only the index was used
        assert r._values["w"] == dict(r._values.items())["w"]  # the columns agree


def test_a_record_with_malformed_block_checksums_is_refused(tmp_path: Path) -> None:
    import json

    import crc32c

    p = cv.save(tmp_path / "c.zarr", {"w": np.ones(200_000, np.float32)})

    def rewrite(mutate) -> None:  # type: ignore[no-untyped-def]
        doc = msgpack.unpackb((p / "_ckptvar/record/c.0").read_bytes())
        mutate(doc)
        data = msgpack.packb(doc, use_bin_type=True)
        (p / "_ckptvar/record/c.0").write_bytes(data)
        meta = json.loads((p / "zarr.json").read_text())
        meta["attributes"]["ckptvar"].update(record_nbytes=len(data),
                                              record_crc32c=crc32c.crc32c(data))
        (p / "zarr.json").write_text(json.dumps(meta))

    good = msgpack.unpackb((p / "_ckptvar/record/c.0").read_bytes())
    cases = [
        (lambda d: d["block_checksums"].__setitem__(0, d["block_checksums"][0][:-4]),
         "block checksums for"),
        (lambda d: d["block_checksums"].__setitem__(0, "x"), "not binary"),
        (lambda d: d.update(block_size=1000), "block_size"),
        (lambda d: d.pop("block_size"), "without 'block_size'"),
        (lambda d: d.update(block_checksums=[]), "not a list of 1"),
    ]
    for mutate, match in cases:
        rewrite(lambda d: d.update(good))
        rewrite(mutate)
        with pytest.raises(cv.CorruptCheckpointError, match=match):
            cv.open(p)
    # well formed, but blocks that do not join to the value's checksum: verify says so
    rewrite(lambda d: d.update(good))
    crcs = bytearray(good["block_checksums"][0])
    crcs[0] ^= 1
    rewrite(lambda d: d["block_checksums"].__setitem__(0, bytes(crcs)))
    with cv.open(p) as r:
        assert [k for k, _ in r.verify_all()] == ["w"]
        assert "do not join" in r.verify_all()[0][1]
        with pytest.raises(cv.CorruptCheckpointError, match="block 0 "):
            r["w"][0:10]


def _reblock(p: Path, size: int) -> None:
    """Rewrite the Zarr checkpoint ``p``'s record as a writer of ``size``-byte blocks
    would have written it (the 256 KiB of files written before 2026-11-27)."""
    import json

    import crc32c

    doc = msgpack.unpackb((p / "_ckptvar/record/c.0").read_bytes())
    loaded = cv.load(p)
    blocks = []
    for key, was in zip(doc["keys"], doc["block_checksums"], strict=True):
        data = loaded[key].tobytes()
        blocks.append(None if was is None or len(data) <= size else np.array(
            [crc32c.crc32c(data[i : i + size]) for i in range(0, len(data), size)],
            "<u4").tobytes())
    doc.update(block_size=size, block_checksums=blocks)
    data = msgpack.packb(doc, use_bin_type=True)
    (p / "_ckptvar/record/c.0").write_bytes(data)
    meta = json.loads((p / "zarr.json").read_text())
    meta["attributes"]["ckptvar"].update(record_nbytes=len(data), record_crc32c=crc32c.crc32c(data))
    (p / "zarr.json").write_text(json.dumps(meta))


def test_an_incremental_save_on_a_base_of_other_blocks(tmp_path: Path) -> None:
    """A base whose record has 256 KiB blocks: its values are still reused (compared by
    their checksums, which do not depend on the block size), and the new record holds
    blocks of the writer's size, which verify."""
    from ckptvar.storage import backend_for

    rng = np.random.default_rng(3)
    a, b, c = rng.random(200_000), rng.random((300, 400)).astype(np.float32), rng.random(90_000)
    base = cv.save(tmp_path / "a.zarr", {"a": a, "b": b, "c": c})
    _reblock(base, 256 << 10)
    with cv.open(base) as r:
        assert r._record.block_size == 256 << 10 and r._values["a"].blocks is not None
        np.testing.assert_array_equal(r["a"][1000:1010], a[1000:1010])  # it verifies
    c2 = c.copy()
    c2[-1] += 1
    new = tmp_path / "b.zarr"
    writer = backend_for(new, None, mode="w").open_writer(new, base=base, known={"a": True})
    for key, value in (("a", a), ("b", b), ("c", c2)):
        writer.add(key, value)
    writer.commit()
    assert writer.reused == ["a", "b"]  # "a" known unchanged, "b" by its checksum
    with cv.open(new) as r:
        size = r._record.block_size
        assert size == 64 << 10
        for key, value in (("a", a), ("b", b), ("c", c2)):
            assert len(r._values[key].blocks) == 4 * -(-value.nbytes // size)
        assert [k for k, _ in r.verify_all()] == []
        np.testing.assert_array_equal(r["a"][150_000:150_010], a[150_000:150_010])
        np.testing.assert_array_equal(r["b"][7], b[7])


def test_a_crc_is_moved_past_512_mib_and_more() -> None:
    """``combine`` past a long piece: CRC-32C's shift operators do not repeat every 2^32
    bits as zlib's CRC-32 ones do (joining a 1 GiB value's blocks takes such shifts)."""
    from ckptvar.storage import checksum

    zeros = bytes(1 << 20)
    head = checksum.crc(b"head")
    for mib in (512, 600, 1024 + 3):
        whole, part = head, 0
        for _ in range(mib):
            whole, part = checksum.extend(whole, zeros), checksum.extend(part, zeros)
        assert checksum.combine(head, part, mib << 20) == whole, mib


@pytest.mark.parametrize("size", [16, 4096])
def test_many_blocks_join_to_the_value_checksum(size: int) -> None:
    """Block CRCs joined one by one or as a tree of pairs (many blocks) give the value's
    CRC, for counts odd and even, the last block whole or short."""
    from ckptvar.storage import checksum
    from ckptvar.storage._container.blocks import blocks_agree, hash_blocks

    data = np.random.default_rng(size).integers(0, 256, 700 * size + 9, dtype=np.uint8)
    for count in (1, 2, 3, 63, 64, 65, 127, 128, 129, 255, 256, 257, 700):
        for extra in (0, 1, size - 1):
            n = min((count - 1) * size + extra + 1, len(data))
            view = memoryview(data[:n])
            whole, blocks = hash_blocks(view, 12345, size)
            assert whole == checksum.crc(view, 12345), (count, extra)
            assert len(blocks) == 4 * -(-n // size)
            assert blocks_agree(12345, blocks, n, size, whole)
            assert not blocks_agree(12346, blocks, n, size, whole)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
@pytest.mark.parametrize("durable", [True, False])
def test_values_hashed_while_written_or_beside_the_writes_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, durable: bool
) -> None:
    """Each piece hashed just before it is written (HDF5 on one CPU) or each
    value on the checksum thread beside the writes: the same record, every value
    verifies; an HDF5 save hashing while it writes hashes no value in a pass of its own."""
    from ckptvar.storage._container import writer

    rng = np.random.default_rng(5)
    values = {"big": rng.random((1300, 333)).astype(np.float32),  # 1.7 MB: pieces, a short one
              "one_block": np.arange(10_000, dtype=np.int32),   # 40 KB: less than a block
              "empty": np.zeros((0, 3), np.float64), "tiny": np.arange(3, dtype=np.int8)}
    records = []
    for hot in (False, True):
        monkeypatch.setattr(writer, "HASH_WHILE_WRITING", hot)
        if hot and fmt == "h5":  # no separate pass: a call of ValueWrite.hash would fail
            monkeypatch.setattr(writer.ValueWrite, "hash", lambda self, **kw: 1 / 0)
        p = cv.save(tmp_path / f"{hot}.{fmt}", values, durable=durable, pack_threshold=8)
        with cv.open(p) as r:
            assert [k for k, _ in r.verify_all()] == []
            for k, v in values.items():
                np.testing.assert_array_equal(r[k].read(), v)
            np.testing.assert_array_equal(r["big"][700:701, 5:9], values["big"][700:701, 5:9])
            records.append({k: (r._values[k].checksum, r._values[k].blocks) for k in values})
    assert records[0] == records[1]
    assert records[0]["big"][1] is not None and records[0]["one_block"][1] is None
