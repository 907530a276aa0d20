"""Quantization bandwidth: GB/s moved by lowbit's fused casts next to the device's copy rate.

Bytes counted are the floor: each input element read once, each output written once (the
current-scaling amax pass re-reads the input, which is part of what the fraction shows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import lowbit
from lowbit.bench.common import time_fn
from lowbit.quantization.scaling_modes import ScalingMode

GPU_SHAPES = [(8192, 16384), (8192, 4096), (16384, 4096), (4096, 12288)]
CPU_SHAPES = [(256, 512), (512, 1024)]


def _xla_current_both(x):
    # The plain-XLA peer: amax, scale, cast, and a transposed cast.
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, 448.0 / amax, 1.0)
    y = x.astype(jnp.float32) * scale
    y = jnp.clip(y, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return y, y.T, 1.0 / scale, amax


def _cases(x):
    n, c = x.size, x.shape[1]
    m = ScalingMode
    scale = jnp.float32(0.5)

    def q(mode, layout="both", **kw):
        return jax.jit(lambda x: lowbit.quantize(x, mode, layout=layout, **kw))

    return [
        ("copy (-x, bf16)", jax.jit(lambda x: -x), 4 * n),
        ("xla fp8 current both", jax.jit(_xla_current_both), 4 * n),
        (
            "lowbit fp8 delayed rowwise",
            jax.jit(lambda x: lowbit.quantize(x, m.DELAYED_TENSOR_SCALING, scale=scale)),
            3 * n,
        ),
        (
            "lowbit fp8 delayed both",
            jax.jit(lambda x: lowbit.quantize(x, m.DELAYED_TENSOR_SCALING, scale=scale, layout="both")),
            4 * n,
        ),
        ("lowbit fp8 current both (+amax)", q(m.CURRENT_TENSOR_SCALING), 4 * n),
        (
            "lowbit fp8 current both +dbias",
            jax.jit(
                lambda x: lowbit.quantize_dbias(x, m.CURRENT_TENSOR_SCALING, jnp.float8_e5m2, layout="both")
            ),
            4 * n + 2 * c,
        ),
        ("lowbit mxfp8 both", q(m.MXFP8_1D_SCALING), 4 * n + 2 * (n // 32)),
        (
            "lowbit fp8 block 1x128 both",
            jax.jit(lambda x: lowbit.quantize(x, m.BLOCK_1D_SCALING, layout="both", power_2_scale=True)),
            4 * n + 8 * (n // 128),
        ),
        (
            "lowbit fp8 block 128x128 both",
            jax.jit(lambda x: lowbit.quantize(x, m.BLOCK_2D_SCALING, layout="both", power_2_scale=True)),
            4 * n,
        ),
        ("lowbit nvfp4 1d both", q(m.NVFP4_1D_SCALING), 3 * n + 2 * (n // 16)),
    ]


def run(small: bool, progress=None) -> list[dict]:
    shapes = CPU_SHAPES if small else GPU_SHAPES
    rows = []
    for shape in shapes:
        x = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32).astype(jnp.bfloat16)
        copy_gbs = None
        for name, fn, nbytes in _cases(x):
            ms = time_fn(fn, x, iters=5 if small else 20)
            gbs = nbytes / (ms * 1e-3) / 1e9
            if copy_gbs is None:
                copy_gbs = gbs
            rows.append(
                dict(
                    shape=f"{shape[0]}x{shape[1]}",
                    case=name,
                    ms=ms,
                    GBps=gbs,
                    frac_of_copy=gbs / copy_gbs,
                    bytes=nbytes,
                )
            )
            if progress:
                progress()
    return rows


def count(small: bool) -> int:
    return len(CPU_SHAPES if small else GPU_SHAPES) * 8
