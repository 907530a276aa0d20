"""Grouped GEMM (mixture of experts): lowbit.grouped_gemm (BF16, FP8) next to jax.lax.ragged_dot
and one dense jnp.dot of the same total size, forward and forward+backward, in one process.

TFLOP/s counts the GEMM work only (2*M*K*N per GEMM, three GEMMs for forward+backward); the FP8
times include the per-group quantization of every operand (current scaling reads each operand
twice: amax, then cast; delayed scaling once), except the "fp8 gemm only" rows, which time the
FP8 GEMM on operands quantized beforehand, and the "primary" rows, which read the weights' FP8 copies
made outside the call (``lowbit.moe.quantize_experts``: once per optimizer step, FP8 primary
weights) and quantize the tokens and gradients in it; "fp8 block" is Float8BlockScaling (1x128 activations
and gradients, 128x128 expert weights, split accumulation). Forward+backward returns the output and both
gradients. A dense GEMM reads one (K, N) matrix where the grouped one reads G of them: where
G*K*N dominates the bytes (G=128) the grouped GEMM is bandwidth-bound, the dense one is not.
``speedup`` is against ragged_dot in the same pass. Group sizes: balanced, or Dirichlet(1) draws
(any value: FP8's weight-gradient GEMM then copies the groups that do not start at a multiple of 16
to aligned slots first); ``dirichlet16`` (scripts/grouped_goal_probe.py) is the same draw in whole
16-row units, the layout lowbit's MoE dispatch hands the grouped GEMM under an FP8 recipe (each
group padded to 16 rows), where no group needs realigning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import lowbit
from lowbit import moe
from lowbit.bench.common import time_fn
from lowbit.ops import grouped_gemm as gg_mod
from lowbit.ops.accumulation import config_fields

# (G, M, K, N): the MoE shapes of the issue.
GPU_SHAPES = [(8, 32768, 4096, 14336), (64, 65536, 2048, 1536), (128, 16384, 4096, 1024)]
CPU_SHAPES = [(4, 256, 128, 256), (16, 512, 64, 128)]
DISTS = ("balanced", "dirichlet")
CASES = (
    "ragged_dot bf16",
    "lowbit bf16",
    "lowbit fp8",
    "lowbit fp8 delayed",
    "lowbit fp8 gemm only",
    "lowbit fp8 block",
    "lowbit fp8 delayed primary",
    "lowbit fp8 block primary",
    "dense bf16",
)
PASSES = ("fwd", "fwd+bwd")


def group_sizes(G: int, M: int, dist: str, seed: int = 0) -> np.ndarray:
    if dist == "balanced":
        s = np.full(G, M // G, np.int64)
        s[-1] += M - s.sum()
        return s.astype(np.int32)
    unit = 16 if dist == "dirichlet16" else 1  # dirichlet16: whole 16-row units (M a multiple of 16)
    w = np.random.default_rng(seed).dirichlet(np.ones(G))
    s = np.floor(w * M / unit).astype(np.int64) * unit
    s[np.argmax(w)] += M - s.sum()
    return s.astype(np.int32)


def _fwd_bwd(f):
    """fwd+bwd: the output and both input gradients for a ones cotangent. Returning the output
    keeps the forward GEMM alive (a gradient alone of a linear map does not need it)."""

    def step(a, b, *rest):
        y, vjp = jax.vjp(lambda a, b: f(a, b, *rest), a, b)
        return y, *vjp(jnp.ones_like(y))

    return jax.jit(step)


def _fp8_gemm_only(lhs, rhs, gs, bwd: bool):
    """The FP8 GEMMs alone: operands quantized outside the timed function."""
    recipe = lowbit.Float8CurrentScaling()
    cfg = gg_mod._Fp8Config(
        recipe=recipe,
        out_dtype=np.dtype(jnp.bfloat16),
        lhs_dtype=np.dtype(lhs.dtype),
        rhs_dtype=np.dtype(rhs.dtype),
        **config_fields(True),
    )
    (M, K), (G, _, N) = lhs.shape, rhs.shape
    qx = gg_mod._quantize(cfg, "x", lhs, gs, None, "both")
    qw = gg_mod._quantize(cfg, "kernel", rhs.reshape(G * K, N), gg_mod._expert_sizes(rhs), None, "both")
    qg = gg_mod._quantize(cfg, "grad", jnp.ones((M, N), jnp.bfloat16), gs, None, "both")

    def fwd(qx, qw, gs):
        return gg_mod.fp8_fprop(
            qx.data, qx.scale_inv, qw.colwise_data, qw.colwise_scale_inv, gs, cfg.fast_accum
        )

    def all3(qx, qw, qg, gs):
        y = fwd(qx, qw, gs)
        dl = gg_mod.ragged_dgrad(qg.data, qg.scale_inv, qw.data, qw.scale_inv, gs, cfg.fast_accum_dgrad)
        dr = gg_mod.fp8_wgrad(
            qx.colwise_data,
            qx.colwise_scale_inv,
            qg.colwise_data,
            qg.colwise_scale_inv,
            gs,
            cfg.fast_accum_wgrad,
        )
        return y, dl, dr

    if bwd:
        return jax.jit(all3), (qx, qw, qg, gs)
    return jax.jit(fwd), (qx, qw, gs)


def _case(name: str, pas: str, lhs, rhs, gs):
    bwd = pas == "fwd+bwd"
    if name == "ragged_dot bf16":
        f = lambda a, b, s: jax.lax.ragged_dot(a, b, s)
    elif name == "lowbit bf16":
        f = lambda a, b, s: lowbit.grouped_gemm(a, b, s)
    elif name == "lowbit fp8":
        f = lambda a, b, s: lowbit.grouped_gemm(a, b, s, recipe=lowbit.Float8CurrentScaling())
    elif name == "lowbit fp8 block":
        f = lambda a, b, s: lowbit.grouped_gemm(a, b, s, recipe=lowbit.Float8BlockScaling())
    elif name == "lowbit fp8 delayed":
        recipe = lowbit.DelayedScaling()
        state = lowbit.init_grouped_delayed_state(recipe, rhs.shape[0])
        f = lambda a, b, s, st: lowbit.grouped_gemm(a, b, s, recipe=recipe, state=st)
        return (_fwd_bwd(f) if bwd else jax.jit(f)), (lhs, rhs, gs, state)
    elif name.endswith(" primary"):  # FP8 primary weights: the copies made by the optimizer step
        delayed = "delayed" in name
        recipe = lowbit.DelayedScaling() if delayed else lowbit.Float8BlockScaling()
        state = lowbit.init_grouped_delayed_state(recipe, rhs.shape[0]) if delayed else None
        qw = jax.jit(lambda b, st: moe.quantize_experts(b, recipe, st))(rhs, state)  # untimed

        def f(a, b, s, q, st):
            return moe.grouped_gemm_prequantized(a, b, q, s, recipe=recipe, state=st)

        return (_fwd_bwd(f) if bwd else jax.jit(f)), (lhs, rhs, gs, qw, state)
    elif name == "lowbit fp8 gemm only":
        return _fp8_gemm_only(lhs, rhs, gs, bwd)
    else:  # one dense GEMM of the same total size: (M, K) . (K, N)
        f = lambda a, w: jnp.dot(a, w)
        return (_fwd_bwd(f) if bwd else jax.jit(f)), (lhs, rhs[0])
    return (_fwd_bwd(f) if bwd else jax.jit(f)), (lhs, rhs, gs)


def operands(G: int, M: int, K: int, N: int):
    """The bench's tokens (M, K) and expert weights (G, K, N), BF16."""
    key = jax.random.PRNGKey(0)
    lhs = jax.random.normal(key, (M, K), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.fold_in(key, 1), (G, K, N), jnp.float32) * 0.02).astype(jnp.bfloat16)
    return lhs, rhs


def build_case(spec: str):
    """``"G<experts> <sizes> <case>"`` (e.g. ``"G128 dirichlet16 lowbit fp8 delayed primary"``) at
    the full shape with that expert count -> (jitted fwd+bwd, args), for lowbit.bench.profile."""
    g_part, dist, name = spec.split(" ", 2)
    G, M, K, N = next(s for s in GPU_SHAPES if f"G{s[0]}" == g_part)
    lhs, rhs = operands(G, M, K, N)
    return _case(name, "fwd+bwd", lhs, rhs, jnp.asarray(group_sizes(G, M, dist)))


def run(small: bool, progress=None) -> list[dict]:
    rows = []
    iters = 3 if small else 10
    for G, M, K, N in CPU_SHAPES if small else GPU_SHAPES:
        lhs, rhs = operands(G, M, K, N)
        for dist in DISTS:
            gs = jnp.asarray(group_sizes(G, M, dist))
            base = {}
            for pas in PASSES:
                flops = 2.0 * M * K * N * (3 if pas == "fwd+bwd" else 1)
                for name in CASES:
                    fn, args = _case(name, pas, lhs, rhs, gs)
                    ms = time_fn(fn, *args, warmup=2, iters=iters, repeats=3)
                    if name == "ragged_dot bf16":
                        base[pas] = ms
                    rows.append(
                        {
                            "name": f"G{G} {dist} {pas} {name}",
                            "shape": f"G={G} {M}x{K}x{N}",
                            "sizes": dist,
                            "pass": pas,
                            "case": name,
                            "ms": ms,
                            "TFLOPs": flops / (ms * 1e-3) / 1e12,
                            "speedup": base[pas] / ms,
                        }
                    )
                    if progress:
                        progress()
                    del fn, args
    return rows


def count(small: bool) -> int:
    return len(CPU_SHAPES if small else GPU_SHAPES) * len(DISTS) * len(PASSES) * len(CASES)
