"""Where FP8 attention's dq goes wrong on sharp softmax rows (docs/numerics.md, "FP8 attention
on Hopper"): the backward's D = rowsum(dO * O) computed from the FP8-rounded output.

A CPU emulation of cuDNN's FP8 attention on one head (seq 512, head_dim 128): q, k, v in E4M3,
the probabilities quantized as cuDNN does (exp(s - rowmax) in E4M3 at scale 448, normalized by
the unquantized sum), dO in E5M2, dS = P (dP - D) in E5M2. dq is compared per row with the
float64 gradient of softmax(q8 k8^T) v8 (the function the FP8 forward computes, so that only
the backward's roundings count) for three sources of D:

  o8     rowsum(dO * O) with O rounded to E4M3 (cuDNN's FP8 forward writes O in FP8 only on Hopper)
  o32    the same with O unrounded (what a BF16 O would give: cuDNN on Blackwell)
  exact  sum_j P_ij dP_ij (D consistent with dP by construction)

    python scripts/attn_fp8_d_consistency.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops import fused_attention as fa

jax.config.update("jax_enable_x64", True)
E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _q(x, dt, scale=None):
    """x rounded to dt with a per-tensor scale (amax to the format's max unless given)."""
    x = jnp.asarray(x, jnp.float32)
    if scale is None:
        scale = float(jnp.finfo(dt).max) / jnp.max(jnp.abs(x))
    return fa._fake_quantize(x, jnp.float32(scale), dt).astype(jnp.float64)


def dq_errors(q, k, v, do, d_source: str):
    """(dq error over all rows, over rows with max P > 0.9), relative Frobenius."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    q8, k8, v8 = _q(q, E4), _q(k, E4), _q(v, E4)
    s = scale * q8 @ k8.T
    p = jax.nn.softmax(s, axis=-1)
    _, vjp = jax.vjp(lambda q: jax.nn.softmax(scale * q @ k8.T, axis=-1) @ v8, q8)
    want = vjp(jnp.asarray(do, jnp.float64))[0]
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p8 = _q(e, E4, 448.0) / jnp.sum(e, axis=-1, keepdims=True)
    o = p8 @ v8
    do8 = _q(do, E5)
    dp = do8 @ v8.T
    if d_source == "exact":
        dsum = jnp.sum(p * dp, axis=-1, keepdims=True)
    else:
        dsum = jnp.sum(do8 * (_q(o, E4) if d_source == "o8" else o), axis=-1, keepdims=True)
    dq = scale * _q(p * (dp - dsum), E5) @ k8
    sharp = np.asarray(jnp.max(p, axis=-1) > 0.9)

    def rel(rows):
        return float(jnp.linalg.norm((dq - want)[rows]) / jnp.linalg.norm(want[rows]))

    return rel(slice(None)), rel(sharp) if sharp.any() else float("nan"), float(sharp.mean())


def main() -> None:
    rng = np.random.default_rng(0)
    s, d = 512, 128
    print("| q gain | sharp rows | D from | dq error, all rows | dq error, sharp rows |")
    print("|---|---|---|---|---|")
    for gain in (3.0, 6.0):
        q = rng.standard_normal((s, d)) * gain  # larger logits: more rows near one-hot
        k, v = rng.standard_normal((s, d)), 2.0 * rng.standard_normal((s, d))
        do = 1e-3 * rng.standard_normal((s, d))
        for src in ("o8", "o32", "exact"):
            err, err_sharp, frac = dq_errors(q, k, v, do, src)
            print(f"| {gain} | {frac:.2f} | {src} | {err:.3f} | {err_sharp:.3f} |")


if __name__ == "__main__":
    main()
