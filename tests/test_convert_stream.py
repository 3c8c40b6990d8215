"""``ckpt convert`` through its window: what it reads and writes, counted by the kernel.

A streamed conversion costs about what ``cv.save(cv.load())`` costs because each source
byte is read once (verified as it is read) and each output byte goes into the scratch
file once, by ``pwrite`` (never by faulting the file's pages in through its mapping),
then once into DST. The counts come from ``/proc/self/io`` of a real ``ckpt`` process:
``rchar`` and ``wchar`` are the bytes its read and write system calls moved, whether
from the page cache or the disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

pytestmark = pytest.mark.skipif(not Path("/proc/self/io").exists(),
                                reason="the kernel's per-process I/O counts (/proc/self/io) "
                                       "are Linux's")

# The first conversion imports what a conversion uses and reads the source into the page
# cache; the second is counted.
_COUNT = """
import json, sys
from ckptvar.cli import main

def io():
    return {k: int(v) for k, v in (line.split(":") for line in open("/proc/self/io"))}

src, dst, *rest = sys.argv[1:]
if main(["convert", "-q", src, dst + ".warm" + dst[dst.rindex("."):], *rest]):
    sys.exit(1)
before = io()
rc = main(["convert", "-q", src, dst, *rest])
after = io()
print(json.dumps({k: after[k] - before[k] for k in after}), file=sys.stderr)
sys.exit(rc)
"""


def _count(src: Path, dst: Path, *args: str) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT, str(src), str(dst), *args],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    counts: dict[str, int] = json.loads(proc.stderr.strip().splitlines()[-1])
    return counts


@pytest.mark.parametrize("suffix", [".h5", ".safetensors", ".zarr"])
def test_streamed_convert_reads_each_byte_once_and_spools_by_write(
    tmp_path: Path, suffix: str
) -> None:
    """48 MiB through an 8 MiB window: the source's bytes are read once; the scratch file
    gets each output byte once by ``write`` (so the conversion writes twice the output in
    all, where an in-memory one writes it once); nothing is read back from it by ``read``
    (the writer reads it through the mapping, from the page cache)."""
    values = {f"v{i}": np.full((3 << 20,), i, np.float32) for i in range(4)}  # 4 x 12 MiB
    src = cv.save(tmp_path / "src.h5", values)
    out = sum(v.nbytes for v in values.values())
    slack = 2 * MIB  # the record, headers, file-system metadata, Python's own reads
    streamed = _count(src, tmp_path / f"s{suffix}", "--window", "8M")
    whole = _count(src, tmp_path / f"m{suffix}", "--window", "1G")
    for counts in (streamed, whole):
        assert out <= counts["rchar"] < out + slack, (counts, out)  # each source byte once
    assert out <= whole["wchar"] < out + slack, whole
    assert 2 * out <= streamed["wchar"] < 2 * out + slack, streamed
    for name in ("s", "m"):
        got = cv.load(tmp_path / f"{name}{suffix}")
        assert list(got) == list(values)
        for key, value in values.items():
            np.testing.assert_array_equal(got[key], value)
    assert not [p for p in tmp_path.iterdir() if "spool" in p.name]


def test_a_cast_reads_each_byte_once_in_memory_and_streamed(tmp_path: Path) -> None:
    """``--dtype float16``: each run is read verified and cast as it comes (not read in
    blocks and then again to check the value's checksum); streamed, each output byte
    (half the source's) goes into the scratch file once."""
    values = {f"v{i}": np.arange(3 << 20, dtype=np.float32) % 1000 + i for i in range(4)}
    src = cv.save(tmp_path / "src.h5", values)
    nbytes = sum(v.nbytes for v in values.values())
    out, slack = nbytes // 2, 2 * MIB
    streamed = _count(src, tmp_path / "s.h5", "--window", "8M", "--dtype", "float16")
    whole = _count(src, tmp_path / "m.h5", "--window", "1G", "--dtype", "float16")
    for counts in (streamed, whole):
        assert nbytes <= counts["rchar"] < nbytes + slack, (counts, nbytes)
    assert out <= whole["wchar"] < out + slack, whole
    assert 2 * out <= streamed["wchar"] < 2 * out + slack, streamed
    for name in ("s", "m"):
        got = cv.load(tmp_path / f"{name}.h5")
        for key, value in values.items():
            assert got[key].dtype == np.float16
            np.testing.assert_array_equal(got[key], value.astype(np.float16))


def test_a_streamed_convert_says_what_it_does_after_the_full_bar(tmp_path: Path) -> None:
    """Every value read, the bar is full and counts every value; then the conversion says
    that it is writing and syncing DST (the part after 100% that took seconds unsaid)."""
    src = cv.save(tmp_path / "src.h5",
                  {f"v{i}": np.full((3 << 20,), i, np.float32) for i in range(4)})
    for suffix, args in ((".h5", []), (".safetensors", ["--dtype", "bfloat16"])):
        proc = subprocess.run(
            [sys.executable, "-m", "ckptvar", "convert", str(src), str(tmp_path / f"o{suffix}"),
             "--window", "8M", "--progress", *args],
            capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert proc.returncode == 0, proc.stderr
        lines = proc.stderr.splitlines()
        assert lines[-2].startswith("100%") and "(4 values)" in lines[-2], lines
        assert lines[-1] == f"writing {tmp_path / f'o{suffix}'} and syncing it to disk ...", lines


def test_a_killed_streamed_convert_leaves_no_scratch_file(tmp_path: Path) -> None:
    """The scratch file has no name once it is open: a conversion killed (SIGKILL, no
    cleanup runs) half-way through its values leaves none behind."""
    import signal

    src = cv.save(tmp_path / "src.h5",
                  {f"v{i}": np.full((3 << 20,), i, np.float32) for i in range(8)})
    out = tmp_path / "out"
    out.mkdir()
    with subprocess.Popen(
        [sys.executable, "-m", "ckptvar", "convert", str(src), str(out / "o.h5"),
         "--window", "8M", "--progress", "--dtype", "float16"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ) as proc:
        try:
            assert proc.stderr is not None
            seen = []
            for line in proc.stderr:  # a line per tenth of the work
                seen.append(line)
                if "%" in line and int(line.split("%")[0]) >= 30:
                    proc.send_signal(signal.SIGKILL)
                    break
            assert proc.wait(timeout=60) == -signal.SIGKILL, seen
        finally:
            proc.kill()
        assert not [p.name for p in out.iterdir() if "spool" in p.name]


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def test_safetensors_writes_a_large_tensor_in_pieces(tmp_path: Path) -> None:
    """A 20 MiB tensor goes out in ``write`` calls of at most 8 MiB: from a scratch file's
    mapping, one call per tensor made the kernel copy it in ever smaller chunks."""
    value = np.ones(20 << 20, np.uint8)
    before = _io()["syscw"]
    cv.save(tmp_path / "x.safetensors", {"a": value}, durable=False)
    assert _io()["syscw"] - before >= 4  # the header, then 8 + 8 + 4 MiB
    np.testing.assert_array_equal(cv.load(tmp_path / "x.safetensors")["a"], value)


def _mapped(address: int, nbytes: int) -> list[bool]:
    """Whether each 4 KiB page of ``[address, address + nbytes)`` is in this process's page
    table (``/proc/self/pagemap``: bit 63 of each page's entry)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // 4096 * 8)
        raw = f.read(nbytes // 4096 * 8)
    return [bool(e >> 63) for e in np.frombuffer(raw, "<u8").tolist()]


def test_the_scratch_mapping_follows_the_writer(tmp_path: Path) -> None:
    """Once every value is in the scratch file, what the writer has written (the process's
    written bytes) is released, and what lies more than two pieces ahead of it; the pages
    in between, which the writer is reading, stay mapped."""
    from ckptvar.cli import convert

    mib = 1 << 20
    with convert._spool(tmp_path / "o.h5", 64 * mib, 16 * mib) as spool:
        assert spool is not None and spool.piece == 4 * mib
        data = np.arange(16 * mib, dtype=np.uint32)  # 64 MiB
        spool.write(spool.place(data.nbytes), data)
        spool.flush()
        assert not [p for p in tmp_path.iterdir()]  # the scratch file has no name
        view = spool.view(0, np.dtype(np.uint32), (16 * mib,))
        address = view.ctypes.data
        spool.hand_over()
        with open(os.devnull, "wb", buffering=0) as sink:  # the writer's first 20 MiB
            for _ in range(20):
                sink.write(bytes(mib))
        flat = view.reshape(-1)
        assert int(flat[::1024].sum()) == int(data[::1024].sum())  # maps every page
        spool.tick()
        pages = _mapped(address, 64 * mib)
        per_mib = 256
        assert not any(pages[: 20 * per_mib])  # behind the writer
        assert all(pages[20 * per_mib : 28 * per_mib])  # being read: kept
        assert not any(pages[28 * per_mib :])  # further on
        del view, flat
