"""Framework arrays: cv.save takes torch/JAX/CuPy arrays without copies, cv.load(like=...)
gives them back, cv.Variable takes them as initial values (one copy).

Zero copies are proven by data pointers (the NumPy view starts where the tensor's memory
does) and by tracemalloc: NumPy reports its allocations to tracemalloc, so a hidden copy
of a 32 MiB value would show as a 32 MiB peak.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import gpu_test

import ckptvar as cv
from ckptvar import _frameworks as fw

MiB = 1 << 20


def _torch() -> Any:
    return pytest.importorskip("torch", reason="PyTorch is not installed (the test extra has it)")


def _jax() -> Any:
    return pytest.importorskip("jax", reason="JAX is not installed (the test extra has it)")


def test_import_ckptvar_imports_no_framework(tmp_path: Path) -> None:
    code = ("import sys, ckptvar as cv, numpy as np; cv.save('x.h5', {'a': np.ones(2)}); "
            "cv.load('x.h5'); cv.Variable(np.ones(2)); "
            "print(sorted(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, check=True)
    assert out.stdout.strip() == "[]"


def test_like_is_checked(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "a.h5", {"w": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match=r"like= must be one of .*'torch'.*got 'tensorflow'"):
        cv.load(p, like="tensorflow")
    assert isinstance(cv.load(p, like="numpy")["w"], np.ndarray)


# --------------------------------------------------------------------------- torch


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "uint8", "bool",
                                   "complex64", "float8_e4m3fn"])
def test_torch_cpu_tensor_is_viewed_not_copied(dtype: str) -> None:
    torch = _torch()
    t = torch.arange(12).reshape(3, 4).to(getattr(torch, dtype))
    a = fw.to_numpy(t)
    assert isinstance(a, np.ndarray) and a.shape == (3, 4)
    assert a.ctypes.data == t.data_ptr()  # the same memory: zero copies
    if dtype in ("bfloat16", "float8_e4m3fn"):
        assert a.dtype == np.dtype(getattr(ml_dtypes, dtype))
    want = t.to(torch.complex128 if t.is_complex() else torch.float64).numpy()
    np.testing.assert_array_equal(a.astype(want.dtype), want)


def test_torch_parameter_with_grad_and_conj_views() -> None:
    torch = _torch()
    p = torch.nn.Parameter(torch.ones(4))
    assert fw.to_numpy(p).ctypes.data == p.data_ptr()
    z = torch.tensor([1 + 2j, 3 - 1j]).conj()  # a lazy conjugate: resolved, values right
    np.testing.assert_array_equal(fw.to_numpy(z), [1 - 2j, 3 + 1j])


def test_torch_unsupported_dtype_is_a_clear_error(tmp_path: Path) -> None:
    torch = _torch()
    with pytest.raises(cv.CkptError, match=r"Cannot convert 'sp' \(torch.Tensor.*Sparse"):
        cv.save(tmp_path / "a.h5", {"ok": torch.ones(2), "sp": torch.zeros(2).to_sparse()})
    assert not (tmp_path / "a.h5").exists()


def test_save_dict_of_torch_tensors_round_trips_with_bfloat16(tmp_path: Path, fmt: str) -> None:
    torch = _torch()
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(7, dtype=torch.int64),
        "emb": torch.nn.Parameter(torch.randn(8, 4, generator=g)),
    }
    p = cv.save(tmp_path / f"m.{fmt}", state)
    plain = cv.load(p)
    assert plain["b"].dtype == np.dtype(ml_dtypes.bfloat16)
    back = cv.load(p, like="torch")
    for k, t in state.items():
        assert isinstance(back[k], torch.Tensor) and back[k].dtype == t.dtype
        assert torch.equal(back[k], t.detach())
    # bfloat16 bits are kept exactly, not rounded through another type
    assert torch.equal(back["b"].view(torch.int16), state["b"].view(torch.int16))


def test_save_of_torch_tensors_makes_no_host_copy(tmp_path: Path) -> None:
    torch = _torch()
    t = torch.ones(8 * MiB, dtype=torch.float32)  # 32 MiB
    tb = torch.ones(8 * MiB, dtype=torch.bfloat16)  # 16 MiB
    cv.save(tmp_path / "warm.h5", {"x": np.ones(4)})  # imports and first-call costs
    tracemalloc.start()
    try:
        cv.save(tmp_path / "t.h5", {"t": t, "tb": tb})
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        # the check sees a copy when there is one: a non-contiguous tensor must be copied
        cv.save(tmp_path / "nc.h5", {"t": t.view(2, -1).t()})
        _, peak_copy = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MiB, f"saving 48 MiB of tensors allocated {peak / MiB:.1f} MiB"
    assert peak_copy >= 30 * MiB
    assert np.array_equal(cv.load_variable(tmp_path / "t.h5", "tb").view(np.int16),
                          tb.view(torch.int16).numpy())


def test_load_like_torch_shares_numpy_memory() -> None:
    torch = _torch()
    a = np.arange(10, dtype=np.float32)
    t = fw.from_numpy(a, "torch")
    assert t.data_ptr() == a.ctypes.data
    b = np.ones(5, ml_dtypes.bfloat16)
    tb = fw.from_numpy(b, "torch")
    assert tb.dtype == torch.bfloat16 and tb.data_ptr() == b.ctypes.data
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False  # never aliased: a torch tensor is writable
    tr = fw.from_numpy(ro, "torch")
    assert tr.data_ptr() != ro.ctypes.data and torch.equal(tr, torch.ones(3))
    with pytest.raises(cv.CkptError, match=r"'q'.*int4.*like='numpy'"):
        fw.from_numpy(np.zeros(2, ml_dtypes.int4), "torch", what="'q'")


def test_load_like_torch_adds_no_copy(tmp_path: Path) -> None:
    _torch()
    p = cv.save(tmp_path / "big.h5", {"x": np.ones(8 * MiB // 4, np.float32)})
    cv.load(p, like="torch")
    tracemalloc.start()
    try:
        cv.load(p)
        _, peak_np = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        out = cv.load(p, like="torch")
        _, peak_t = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert float(out["x"].sum()) == 8 * MiB // 4
    assert peak_t < peak_np + 2 * MiB, (peak_np, peak_t)


def test_variable_from_torch_tensor_copies_once(fresh_graph: cv.Graph) -> None:
    torch = _torch()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    v = cv.Variable(t, name="w")
    assert v.dtype == np.float32 and v.shape == (2, 3)
    t += 100  # the variable holds its own copy
    np.testing.assert_array_equal(v.numpy(), np.arange(6).reshape(2, 3))
    vb = cv.Variable(torch.ones(3, dtype=torch.bfloat16, requires_grad=True), name="b")
    assert vb.dtype == np.dtype(ml_dtypes.bfloat16)
    vf = cv.Variable(lambda: torch.zeros(2, dtype=torch.float16), name="f")
    assert vf.dtype == np.float16
    src = torch.ones(3)  # an initial-value function called later, at the first read
    vl = cv.Variable(lambda: src, dtype="float32", shape=(3,), name="later")
    np.testing.assert_array_equal(vl.numpy(), [1, 1, 1])
    src += 1
    np.testing.assert_array_equal(vl.numpy(), [1, 1, 1])
    tracemalloc.start()
    try:
        big = torch.ones(8 * MiB)
        cv.Variable(big, name="big")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 31 * MiB < peak < 34 * MiB  # exactly one 32 MiB copy


# --------------------------------------------------------------------------- jax
# JAX starts threads and warns at every later os.fork(); the suite turns warnings into errors
# and other tests fork, so the JAX checks run in a fresh interpreter each.


def _run_jax(tmp_path: Path, body: str) -> None:
    _jax()
    code = "import numpy as np, ml_dtypes, jax, jax.numpy as jnp, ckptvar as cv\n" \
           "from ckptvar import _frameworks as fw\n" + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_jax_cpu_array_is_viewed_not_copied(tmp_path: Path) -> None:
    _run_jax(tmp_path, """
        x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
        a = fw.to_numpy(x)
        assert a.ctypes.data == x.unsafe_buffer_pointer()  # the same memory: zero copies
        xb = jnp.ones(7, dtype=jnp.bfloat16)
        ab = fw.to_numpy(xb)
        assert ab.dtype == np.dtype(ml_dtypes.bfloat16)
        assert ab.ctypes.data == xb.unsafe_buffer_pointer()
    """)


@pytest.mark.parametrize("suffix", ["h5", "zarr"])
def test_save_dict_of_jax_arrays_round_trips(tmp_path: Path, suffix: str) -> None:
    _run_jax(tmp_path, f"""
        state = {{"w": jnp.linspace(0, 1, 40, dtype=jnp.float32).reshape(8, 5),
                  "b": jnp.arange(5, dtype=jnp.bfloat16), "i": jnp.array([1, 2], jnp.int32)}}
        p = cv.save("j.{suffix}", state)
        back = cv.load(p, like="jax")
        for k, x in state.items():
            assert isinstance(back[k], jax.Array) and back[k].dtype == x.dtype, k
            assert bool(jnp.array_equal(back[k], x)), k
        v = cv.Variable(state["w"], name="jw")
        np.testing.assert_array_equal(v.numpy(), np.asarray(state["w"]))
    """)


def test_load_like_jax_shares_aligned_memory_and_copies_unaligned(tmp_path: Path) -> None:
    _run_jax(tmp_path, """
        def aligned(n):
            raw = np.empty(4 * n + 64, np.uint8)
            off = (-raw.ctypes.data) % 64
            return raw[off : off + 4 * n].view(np.float32)
        a = aligned(1 << 14)
        a[:] = 3
        x = fw.from_numpy(a, "jax")
        assert x.unsafe_buffer_pointer() == a.ctypes.data  # 64-byte aligned: zero copies
        u = aligned((1 << 14) + 4)[4:]  # 16 bytes past an aligned start: copied once
        u[:] = 2
        y = fw.from_numpy(u, "jax")
        assert y.unsafe_buffer_pointer() != u.ctypes.data and float(y.sum()) == 2 * u.size
        assert isinstance(fw.from_numpy(np.ones(2, ml_dtypes.bfloat16), "jax"), jax.Array)
    """)


# --------------------------------------------------------------------------- cupy / GPU


@gpu_test
def test_save_cupy_and_torch_cuda_then_load_like_cupy(tmp_path: Path) -> None:
    import cupy as cp

    a = cp.arange(1000, dtype=cp.float32)
    state: dict[str, Any] = {"a": a}
    try:
        import torch

        if torch.cuda.is_available():
            state["t"] = torch.arange(10, device="cuda", dtype=torch.bfloat16)
    except ImportError:
        pass
    p = cv.save(tmp_path / "g.h5", state)
    np.testing.assert_array_equal(cv.load(p)["a"], np.arange(1000, dtype=np.float32))
    back = cv.load(p, like="cupy", keys=["a"])
    assert isinstance(back["a"], cp.ndarray) and bool((back["a"] == a).all())
    v = cv.Variable(a, name="ga")
    np.testing.assert_array_equal(v.numpy(), a.get())
    if "t" in state:
        t = cv.load(p, keys=["t"], like="torch")["t"]
        assert torch.equal(t, state["t"].cpu())


def test_variable_writes_take_torch_and_jax_arrays(fresh_graph: cv.Graph) -> None:
    """assign/assign_add/slice/scatter accept a tensor as the constructor does; they raised
    DTypeLockError 'Not a dtype: torch.int64' for any torch tensor."""
    torch, jnp = _torch(), _jax().numpy
    v = cv.Variable(np.zeros((2, 2), np.float32), name="w")
    v.assign(torch.ones(2, 2))
    v.assign_add(jnp.ones((2, 2)))
    v[0].assign(torch.tensor([5.0, 5.0], dtype=torch.float64))
    v.scatter_add(torch.tensor([1]), torch.ones(1, 2))
    np.testing.assert_array_equal(v.numpy(), [[5, 5], [3, 3]])
    src = torch.zeros(2, 2)
    v.assign(src)
    src += 1  # no memory shared with the tensor
    np.testing.assert_array_equal(v.numpy(), np.zeros((2, 2)))
    iv = cv.Variable(np.zeros(2, np.int32), name="i")
    np.testing.assert_array_equal(iv.assign(torch.tensor([1, 2])).numpy(), [1, 2])
    with pytest.raises(cv.CkptError, match="int32"):  # the dtype lock still holds
        iv.assign(torch.tensor([1.5, 2.0]))
    np.testing.assert_array_equal(iv.numpy(), [1, 2])
