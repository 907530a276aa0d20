"""GEMM alone: ``lowbit.gemm`` on operands quantized beforehand, per recipe format, next to the
BF16 GEMM of the same shape, in one process.

Shapes: 8192^3 and the seed layer's GEMMs (8192 tokens, hidden 4096, ffn 16384: QKV, out
projection, fc1, fc2 forward, and the two weight gradients). TFLOP/s counts 2*M*N*K. Formats:
BF16; per-tensor FP8 (E4M3, as DelayedScaling/Float8CurrentScaling hand it to cuBLASLt);
Float8BlockScaling's pairs (1x128 activations with 128x128 weights for fprop and dgrad, 1x128 with
1x128 for wgrad); MXFP8 and NVFP4 (on Hopper their exact path: dequantize to BF16, BF16 GEMM,
whose cost the time includes). ``vs_bf16`` and ``vs_fp8`` are the BF16 and per-tensor FP8 times
over this row's time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit.bench.common import time_fn
from lowbit.ops.gemm import gemm
from lowbit.ops.quantize import quantize
from lowbit.quantization.scaling_modes import ScalingMode

# (label, M, N, K)
GPU_SHAPES = [
    ("8192^3", 8192, 8192, 8192),
    ("qkv fprop", 8192, 12288, 4096),
    ("out proj fprop", 8192, 4096, 4096),
    ("fc1 fprop", 8192, 16384, 4096),
    ("fc2 fprop", 8192, 4096, 16384),
    ("fc1 wgrad", 16384, 4096, 8192),
    ("fc2 wgrad", 4096, 16384, 8192),
]
CPU_SHAPES = [("small", 256, 384, 256), ("small ragged", 192, 256, 320)]

_E4M3 = jnp.float8_e4m3fn


def _formats():
    """(name, a scaling mode, b scaling mode, q_dtype); None modes = BF16 operands."""
    out = [("bf16", None, None, None), ("fp8 per-tensor", ScalingMode.CURRENT_TENSOR_SCALING, None, _E4M3)]
    block_1d = getattr(ScalingMode, "BLOCK_1D_SCALING", None)
    if block_1d is not None:
        out += [
            ("fp8 1x128 x 128x128", block_1d, ScalingMode.BLOCK_2D_SCALING, _E4M3),
            ("fp8 1x128 x 1x128", block_1d, block_1d, _E4M3),
        ]
    out += [
        ("mxfp8", ScalingMode.MXFP8_1D_SCALING, None, _E4M3),
        ("nvfp4", ScalingMode.NVFP4_1D_SCALING, None, jnp.float4_e2m1fn),
    ]
    return out


def _operand(x, mode, q_dtype):
    if mode is None:
        return x
    return quantize(x, mode, q_dtype, layout="rowwise")


def run(small: bool, progress=None) -> list[dict]:
    rows = []
    key = jax.random.PRNGKey(0)
    for label, M, N, K in CPU_SHAPES if small else GPU_SHAPES:
        ka, kb = jax.random.split(jax.random.fold_in(key, M * 7 + N * 3 + K))
        a = jax.random.normal(ka, (M, K), jnp.float32).astype(jnp.bfloat16)
        b = jax.random.normal(kb, (N, K), jnp.float32).astype(jnp.bfloat16)
        times = {}
        for name, mode_a, mode_b, q in _formats():
            qa = jax.block_until_ready(_operand(a, mode_a, q))
            qb = jax.block_until_ready(_operand(b, mode_b or mode_a, q))
            fn = jax.jit(lambda x, y: gemm(x, y, out_dtype=jnp.bfloat16))
            jax.block_until_ready(fn(qa, qb))
            ms = time_fn(fn, qa, qb, warmup=2, iters=2 if small else 20, repeats=3 if small else 5)
            times[name] = ms
            rows.append(
                dict(shape=f"{label} {M}x{N}x{K}", format=name, ms=ms, tflops=2.0 * M * N * K / ms / 1e9)
            )
            del qa, qb, fn
            if progress:
                progress()
        for r in rows[-len(times) :]:
            r["vs_bf16"] = times["bf16"] / r["ms"]
            r["vs_fp8"] = times["fp8 per-tensor"] / r["ms"]
    return rows


def count(small: bool) -> int:
    return len(CPU_SHAPES if small else GPU_SHAPES) * len(_formats())
