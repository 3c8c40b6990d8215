"""Values written a piece at a time (storage.Chunked): the same file as whole values,
bounded host memory, and the GPU staging path (CUDA runs are marked ``gpu``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.storage import Chunked, materialize
from ckptvar.storage.chunked import HostPieces


class _Pieces:
    """A Chunked value over a host array, in pieces of ``n`` bytes (any length)."""

    def __init__(self, a: np.ndarray, n: int) -> None:
        self.a, self.n = np.ascontiguousarray(a), n
        self.shape, self.dtype, self.nbytes = self.a.shape, self.a.dtype, self.a.nbytes
        self.calls = 0

    def byte_chunks(self):  # type: ignore[no-untyped-def]
        self.calls += 1
        flat = self.a.reshape(-1).view(np.uint8)
        for i in range(0, flat.size, self.n):
            yield memoryview(flat[i : i + self.n].copy())  # a buffer reused by nobody


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
@pytest.mark.parametrize("piece", [4099, 300_001, 1 << 20])
def test_a_chunked_value_is_stored_as_the_whole_value_would_be(tmp_path, fmt, piece):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((700, 1000)).astype(np.float32)  # 2.8 MB: 11 blocks
    small = rng.standard_normal(10).astype(np.float32)  # one block
    whole = cv.save(tmp_path / f"whole.{fmt}", {"big": big, "small": small})
    pieces = {"big": _Pieces(big, piece), "small": _Pieces(small, max(1, piece // 1000))}
    assert all(isinstance(v, Chunked) for v in pieces.values())
    chunked = cv.save(tmp_path / f"chunked.{fmt}", pieces)
    with cv.open(whole) as a, cv.open(chunked) as b:
        for key in ("big", "small"):
            assert a.info(key).checksum == b.info(key).checksum  # the same CRC, and blocks
            np.testing.assert_array_equal(b.read(key), a.read(key))
        b.verify("big")
        np.testing.assert_array_equal(b["big"][123:456, 7:9], big[123:456, 7:9])
    assert pieces["big"].calls == 1  # written and hashed in one pass over the pieces
    assert subprocess.run([sys.executable, "-m", "ckptvar.cli", "verify", str(chunked)],
                          capture_output=True, timeout=60, check=False).returncode == 0


def test_a_chunked_value_that_gives_too_few_bytes_fails_the_save_and_keeps_nothing(tmp_path):
    class Short(_Pieces):
        def byte_chunks(self):  # type: ignore[no-untyped-def]
            yield from list(super().byte_chunks())[:-1]

    a = np.arange(100_000, dtype=np.float64)
    with pytest.raises(ValueError, match="gave"):
        cv.save(tmp_path / "x.h5", {"a": Short(a, 65536)})
    assert not (tmp_path / "x.h5").exists()
    assert list(tmp_path.iterdir()) == []


def test_packed_and_compressed_chunked_values_are_stored_exactly(tmp_path):
    a = np.arange(30, dtype=np.int16)
    b = np.arange(300_000, dtype=np.float32)
    p = cv.save(tmp_path / "p.zarr", {"a": _Pieces(a, 7), "b": _Pieces(b, 99_999)},
                pack_threshold=1 << 20, compression="zstd")
    out = cv.load(p)
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)
    s = cv.save(tmp_path / "p.safetensors", {"b": _Pieces(b, 99_999)})  # streamed too
    np.testing.assert_array_equal(cv.load(s)["b"], b)


def test_a_large_strided_host_array_is_written_without_a_full_contiguous_copy(
        tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTVAR_STAGING_BYTES", str(1 << 20))
    a = np.arange(4096 * 2048, dtype=np.float32).reshape(4096, 2048).T  # 32 MiB, strided
    be = np.arange(3 << 20, dtype=">f4")  # 12 MiB, big-endian
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        path = cv.save(tmp_path / "t.h5", {"t": a, "be": be})
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20, f"saving 44 MiB of strided values allocated {peak / 2**20:.1f} MiB"
    out = cv.load(path)
    np.testing.assert_array_equal(out["t"], a)
    np.testing.assert_array_equal(out["be"], be)
    assert out["be"].dtype == np.float32


def test_host_pieces_copy_whole_rows_and_materialize_exactly():
    a = np.arange(60, dtype=">u2").reshape(5, 12)[:, ::2]
    v = HostPieces(a, piece=20)  # 12-byte rows: one row a piece
    assert [len(p) for p in v.byte_chunks()] == [12] * 5
    np.testing.assert_array_equal(materialize(v), a)
    with pytest.raises(ValueError, match="at least one dimension"):
        HostPieces(np.float32(1.0).reshape(()))


def test_the_staging_size_comes_from_the_environment(monkeypatch):
    from ckptvar._staging import staging_bytes

    monkeypatch.setenv("CKPTVAR_STAGING_BYTES", str((1 << 20) + 5))
    assert staging_bytes() == 1 << 20
    monkeypatch.setenv("CKPTVAR_STAGING_BYTES", "12")
    assert staging_bytes() == 64 << 10
    monkeypatch.setenv("CKPTVAR_STAGING_BYTES", "lots")
    with pytest.raises(ValueError, match="CKPTVAR_STAGING_BYTES"):
        staging_bytes()


# -- on a CUDA device -------------------------------------------------------------------------

_GPU_SCRIPT = textwrap.dedent("""
    import os, resource, sys, threading, time
    import numpy as np, torch, cupy as cp
    import ckptvar as cv
    fmt, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    # 1 GiB of CUDA tensors, bf16 among them (CuPy has no bf16: torch stages it)
    tensors = {f"w{i}": torch.randn(8192, 4096, device="cuda") for i in range(7)}
    tensors["bf"] = torch.randn(8192, 4096, device="cuda").to(torch.bfloat16)
    tensors["t"] = torch.randn(2048, 4096, device="cuda").t()  # not contiguous
    torch.cuda.synchronize()
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = [0]
    stop = threading.Event()
    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss()); time.sleep(0.002)
    cv.save(out + "/warm." + fmt, {"x": torch.ones(4, device="cuda")})  # pinned halves made
    before = rss()
    w = threading.Thread(target=watch); w.start()
    t0 = time.perf_counter()
    path = cv.save(out + "/m." + fmt, tensors)
    dt = time.perf_counter() - t0
    stop.set(); w.join()
    grew = (peak[0] - before) / 2**20
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"saved {nbytes / 2**30:.2f} GiB from the GPU in {dt:.2f} s; host RSS grew {grew:.0f} MiB")
    assert grew < 192, grew  # the two pinned halves exist already; 1 GiB would be a host copy
    back = cv.load(path)
    for k, t in tensors.items():
        ref = t.cpu()
        got = back[k]
        if k == "bf":
            assert np.array_equal(got.view(np.int16), ref.view(torch.int16).numpy())
        else:
            assert np.array_equal(got, ref.numpy()), k
    # the same bytes and checksums as a save of the host copies
    host = cv.save(out + "/h." + fmt, {k: t.cpu() for k, t in tensors.items()})
    with cv.open(path) as a, cv.open(host) as b:
        assert all(a.info(k).checksum == b.info(k).checksum for k in tensors)
    # onto the GPU through the pinned buffer, and restore into CuPy-backed variables
    g = cv.load(path, device="GPU:0", keys=["w0", "t"])
    assert isinstance(g["w0"], cp.ndarray)
    assert bool((g["w0"] == cp.asarray(tensors["w0"])).all())
    tt = cv.load(path, like="torch", device="cuda:0", keys=["bf", "w1", "t"])
    assert all(tt[k].is_cuda and torch.equal(tt[k], tensors[k]) for k in tt)
    try:  # a jax.Array on the GPU goes through DLPack and the same staging
        import jax
        gpu = jax.devices("gpu")[0]
    except Exception:  # noqa: BLE001 - no jax, or a jax without CUDA
        gpu = None
    if gpu is not None:
        j = jax.device_put(np.arange(3 << 20, dtype=np.float32).reshape(3, -1), gpu)
        jp = cv.save(out + "/j." + fmt, {"params": {"w": j}})
        assert np.array_equal(cv.load(jp)["params/w"], np.asarray(j))
    with cv.device("GPU:0"):
        v = cv.Variable(np.zeros((8192, 4096), np.float32), name="w0")
    ck = cv.Checkpoint(w0=v)
    ck.write(out + "/v." + fmt)
    v.assign(cp.ones((8192, 4096), cp.float32))
    ck.read(out + "/v." + fmt).assert_consumed()
    assert float(v.value().sum()) == 0.0
    print("ok")
""")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_cuda_tensors_are_staged_through_the_pinned_buffer(tmp_path, fmt):
    pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    run = subprocess.run([sys.executable, "-c", _GPU_SCRIPT, fmt, str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=False)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ok" in run.stdout


_GPU_STATE = textwrap.dedent("""
    import sys
    import torch
    import ckptvar as cv
    out = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device="cuda")
    for _ in range(3):
        opt.zero_grad(); model(x).square().mean().backward(); opt.step()
    ck = cv.Checkpoint(model=model, optimizer=opt)
    path = ck.save(out + "/s")
    h = ck.save(out + "/bg", blocking=False)  # the snapshot is a copy on the GPU
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # after the snapshot: not in the background save
    bg = h.wait(timeout=120)
    model2 = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                 torch.nn.Linear(512, 10)).cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    ptrs = [p.data_ptr() for p in model2.parameters()]
    cv.Checkpoint(model=model2, optimizer=opt2).restore(bg).assert_consumed()
    assert ptrs == [p.data_ptr() for p in model2.parameters()]  # filled in place
    for k, v in model2.state_dict().items():
        assert v.is_cuda and torch.equal(v, before[k]), k
    assert opt2.state_dict()["state"][0]["exp_avg"].is_cuda
    cv.Checkpoint(model=model2, optimizer=opt2).restore(path).assert_consumed()
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    print("ok")
""")


@pytest.mark.gpu
def test_a_cuda_model_and_optimizer_round_trip_and_background_saves_snapshot_on_the_device(
        tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    run = subprocess.run([sys.executable, "-c", _GPU_STATE, str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ok" in run.stdout
