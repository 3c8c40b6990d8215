"""The workloads' tensors: names, shapes and deterministic values.

``big`` is a GPT-style model (149 float32 tensors, ~1 GiB; ~1 MiB in quick mode),
``small`` is many tensors of 64-4096 elements, ``lazy`` reads one tensor of ``big``.
Values come from one pool of normal floats, so every process builds the same inputs.
NumPy is the only import: this module also runs under another interpreter.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

MiB = 1 << 20
GiB = 1 << 30

#: The workloads the driver knows (``--only``).
WORKLOADS = ("big", "small", "lazy", "init", "bgsave", "verify", "gpu", "counts", "open",
             "frameworks", "scale", "paths")
FULL_SMALL_COUNT = 20_000
QUICK_SMALL_COUNT = 200

Spec = list[tuple[str, tuple[int, ...]]]


def model_spec(quick: bool) -> Spec:
    """149 float32 tensors with GPT-style transformer shapes: ~1 GiB (full) or ~1 MiB (quick).

    12 blocks of 12 tensors (layer norms, fused QKV, attention projection, MLP), token and
    position embeddings, the final layer norm and an untied output projection.
    """
    d, layers, vocab, pos = (32, 12, 512, 64) if quick else (1024, 12, 56752, 1024)
    spec: Spec = [("wte", (vocab, d)), ("wpe", (pos, d))]
    for i in range(layers):
        p = f"h/{i}/"
        spec += [
            (p + "ln_1/gamma", (d,)),
            (p + "ln_1/beta", (d,)),
            (p + "attn/c_attn/kernel", (d, 3 * d)),
            (p + "attn/c_attn/bias", (3 * d,)),
            (p + "attn/c_proj/kernel", (d, d)),
            (p + "attn/c_proj/bias", (d,)),
            (p + "ln_2/gamma", (d,)),
            (p + "ln_2/beta", (d,)),
            (p + "mlp/c_fc/kernel", (d, 4 * d)),
            (p + "mlp/c_fc/bias", (4 * d,)),
            (p + "mlp/c_proj/kernel", (4 * d, d)),
            (p + "mlp/c_proj/bias", (d,)),
        ]
    spec += [("ln_f/gamma", (d,)), ("ln_f/beta", (d,)), ("lm_head/kernel", (d, vocab))]
    return spec


#: The tensor the lazy workload reads (16 MiB in the full model).
LAZY_KEY = "h/5/mlp/c_fc/kernel"


def small_spec(count: int) -> Spec:
    """``count`` float32 tensors of 64-4096 elements (~8 KiB each; 20,000 make ~159 MiB)."""
    rng = np.random.default_rng(1234)
    sizes = rng.integers(64, 4097, size=count)
    spec: Spec = []
    for i, n in enumerate(sizes.tolist()):
        shape = (n,) if i % 2 else (n // 16, 16) if n % 16 == 0 else (n,)
        spec.append((f"blocks/{i // 100}/v{i % 100}", shape))
    return spec


def spec_for(job: dict[str, Any]) -> Spec:
    from benchmarks import round2, round3  # noqa: PLC0415 - they build on this module

    if (spec := round2.spec_for(job)) is not None or (spec := round3.spec_for(job)) is not None:
        return spec
    if job["workload"] == "small":
        return small_spec(job["count"])
    if job.get("alone"):
        return [s for s in model_spec(job["quick"]) if s[0] == LAZY_KEY]
    return model_spec(job["quick"])


def spec_nbytes(spec: Spec) -> int:
    return sum(4 * int(np.prod(s)) for _, s in spec)


_POOL: np.ndarray | None = None


def value_pool() -> np.ndarray:
    """16 Mi normal floats (scale 0.02, like trained weights); inputs are slices of it."""
    global _POOL
    if _POOL is None:
        _POOL = np.random.default_rng(0).standard_normal(16 * MiB // 4 * 4, dtype=np.float32)
        _POOL *= np.float32(0.02)
    return _POOL


def fill(key: str, a: np.ndarray) -> np.ndarray:
    """Write ``key``'s deterministic values into ``a`` (float32, any shape) from the pool."""
    pool = value_pool()
    i = zlib.crc32(key.encode())
    flat = a.reshape(-1)
    pos, j = 0, 0
    while pos < flat.size:
        n = min(flat.size - pos, pool.size // 2)
        off = (i * 7919 + j * 104729) % (pool.size - n + 1)
        flat[pos : pos + n] = pool[off : off + n]
        pos += n
        j += 1
    return a


def make_arrays(spec: Spec) -> dict[str, np.ndarray]:
    """Deterministic inputs: each tensor is filled from the pool at its own offsets."""
    return {key: fill(key, np.empty(shape, np.float32)) for key, shape in spec}
