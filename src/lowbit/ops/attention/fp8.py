"""FP8 attention (the recipes' ``fp8_dpa=True``): q, k, v, the probabilities s and the output o
in the forward format (E4M3), do, dp, dq, dk, dv in the backward format (E5M2 under HYBRID), with
per-tensor scales from the recipe (:mod:`.fp8_scales`).

On a GPU it is cuDNN's FP8 SDPA through lowbit's handler (forward and backward, amaxes reported
by the kernels). Elsewhere an emulation of that kernel in float32 ``jnp``: q, k, v
quantize-dequantized; ``P = softmax(scale q k^T)`` (masked; dropout ``P' = P keep / (1 - rate)``)
quantize-dequantized with s's scale before ``o = P' v``, o quantize-dequantized; backward: do
quantize-dequantized, ``dv = P'^T do``, ``dp = P (dP' - D)`` with ``dP = do v^T`` and
``D = rowsum(do * o)``, dp quantize-dequantized before ``dq = scale dp k`` and
``dk = scale dp^T q``, each gradient quantize-dequantized with its scale. The output and the
gradients come back in q's dtype.

DelayedScaling's state goes in as an argument; its cotangent is the state advanced by this step's
amaxes (as :func:`lowbit.dense` does), which Flax's ``_overwrite_with_gradient`` collection
writes back. Runs on one device (a mesh plan makes :func:`unsupported` say so).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.capabilities import compute_capability
from lowbit.ops import fused_attention as fa
from lowbit.ops._ffi import attention as ffi
from lowbit.ops.attention import fp8_scales as fs
from lowbit.ops.attention.fp8_sharded import sharded_bwd, sharded_fwd
from lowbit.recipe import DelayedScaling
from lowbit.sharding import plan_heads

_HI = jax.lax.Precision.HIGHEST
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Config:
    recipe: Any
    causal: bool
    scale: float
    rate: float
    cudnn: bool
    plan: Any = None  # (mesh, batch entry, head entry): the kernels run per shard (fp8_sharded)

    @property
    def delayed(self) -> bool:
        return isinstance(self.recipe, DelayedScaling)

    def flags(self) -> int:
        f = ffi.FP8 | (ffi.CAUSAL if self.causal else 0)
        return f | (ffi.DROPOUT if self.rate > 0 else 0)


# --- the float32 emulation -----------------------------------------------------------------
def _groups(x, g):  # (b, s, h, d) -> (b, s, g, h // g, d)
    return x.reshape(x.shape[:2] + (g, x.shape[2] // g, x.shape[3]))


def _probs(cfg, qd, kd, rng):
    """``(P, P')`` (b, g, r, sq, sk) float32: softmax and its dropped, rescaled copy."""
    g = kd.shape[2]
    s = jnp.einsum("bqgrd,bkgd->bgrqk", _groups(qd, g), kd, precision=_HI) * cfg.scale
    if cfg.causal:
        sq, sk = s.shape[-2:]
        s = jnp.where(jnp.arange(sk)[None, :] > jnp.arange(sq)[:, None], -jnp.inf, s)
    p = jax.nn.softmax(s, axis=-1)
    if cfg.rate <= 0:
        return p, p
    keep = jax.random.bernoulli(rng, 1.0 - cfg.rate, p.shape)
    return p, jnp.where(keep, p / (1.0 - cfg.rate), 0.0)


def _emulate_fwd(cfg, q, k, v, sc, rng):
    f, _ = fs.dtypes(cfg.recipe)
    qd, kd, vd = (fa._fake_quantize(x, sc[r], f) for x, r in ((q, "q"), (k, "k"), (v, "v")))
    _, pd = _probs(cfg, qd, kd, rng)
    p8 = fa._fake_quantize(pd, sc["s"], f)
    o = jnp.einsum("bgrqk,bkgd->bqgrd", p8, vd, precision=_HI).reshape(q.shape[:3] + (v.shape[-1],))
    od = fa._fake_quantize(o, sc["o"], f)
    return od, (qd, kd, vd, od), fs.amax(pd), fs.amax(o)


def _emulate_bwd(cfg, res, sc, ct, rng):
    f, b = fs.dtypes(cfg.recipe)
    qd, kd, vd, od = res
    g = kd.shape[2]
    dod = fa._fake_quantize(ct, sc["do"], b)
    p, pd = _probs(cfg, qd, kd, rng)
    p8 = fa._fake_quantize(pd, sc["s"], f)
    dog = _groups(dod, g)
    dv = jnp.einsum("bgrqk,bqgrd->bkgd", p8, dog, precision=_HI)
    dpp = jnp.einsum("bqgrd,bkgd->bgrqk", dog, vd, precision=_HI)
    if cfg.rate > 0:  # the kept entries (pd != 0 where p != 0) scaled as the forward did
        dpp = jnp.where(pd != 0, dpp / (1.0 - cfg.rate), 0.0)
    dsum = jnp.sum(dog * _groups(od, g), axis=-1).transpose(0, 2, 3, 1)[..., None]  # (b, g, r, sq, 1)
    ds = p * (dpp - dsum)
    ds8 = fa._fake_quantize(ds, sc["dp"], b)
    dq = cfg.scale * jnp.einsum("bgrqk,bkgd->bqgrd", ds8, kd, precision=_HI).reshape(qd.shape)
    dk = cfg.scale * jnp.einsum("bgrqk,bqgrd->bkgd", ds8, _groups(qd, g), precision=_HI)
    grads = {"dq": dq, "dk": dk, "dv": dv}
    amaxes = {r: fs.amax(x) for r, x in grads.items()} | {"dp": fs.amax(ds)}
    return tuple(fa._fake_quantize(grads[r], sc[r], b) for r in ("dq", "dk", "dv")), amaxes


# --- cuDNN ---------------------------------------------------------------------------------
def _seed_offset(cfg, rng):
    if cfg.rate <= 0:
        return None, None
    bits = jax.random.bits(rng, (4,), jnp.uint32)
    return bits[:2], bits[2:]


def _cudnn_fwd(cfg, q, k, v, sc, rng):
    f, _ = fs.dtypes(cfg.recipe)
    q8, k8, v8 = (fa._quantize(x, sc[r], f) for x, r in ((q, "q"), (k, "k"), (v, "v")))
    rows = fa._rows([1 / sc["q"], 1 / sc["k"], 1 / sc["v"], 1 / sc["s"], sc["s"], sc["o"]])
    seed, offset = _seed_offset(cfg, rng)
    o8, stats, am = ffi.attention_fwd(
        q8, k8, v8, None, None, None, None, seed, offset, None, rows, flags=cfg.flags(),
        scale=cfg.scale, dropout_rate=cfg.rate, max_sq=q.shape[1], max_skv=k.shape[1], o_dtype=f,
        dv=v.shape[-1],
    )  # fmt: skip
    return o8.astype(F32) / sc["o"], (q8, k8, v8, o8, stats, seed, offset), am[0, 0], am[1, 0]


def _cudnn_bwd(cfg, res, sc, ct, rng):
    del rng  # the forward's seed and offset are residuals
    _, b = fs.dtypes(cfg.recipe)
    q8, k8, v8, o8, stats, seed, offset = res
    do8 = fa._quantize(ct, sc["do"], b)
    inv = [1 / sc[r] for r in ("q", "k", "v", "o", "do", "s", "dp")]
    rows = fa._rows(inv + [sc[r] for r in ("s", "dq", "dk", "dv", "dp")])
    dq8, dk8, dv8, _, _, am = ffi.attention_bwd(
        q8, k8, v8, o8, do8, stats, None, None, None, None, seed, offset, None, rows,
        flags=cfg.flags(), scale=cfg.scale, dropout_rate=cfg.rate, max_sq=q8.shape[1],
        max_skv=k8.shape[1], grad_dtype=b, want_dbias=False, want_dsink=False,
    )  # fmt: skip
    grads = tuple(g.astype(F32) / sc[r] for g, r in ((dq8, "dq"), (dk8, "dk"), (dv8, "dv")))
    return grads, {"dq": am[0, 0], "dk": am[1, 0], "dv": am[2, 0], "dp": am[3, 0]}


# --- the op --------------------------------------------------------------------------------
def _fwd_scales(cfg, state, a):
    """Scales of q, k, v, s, o and (current scaling) the bounds-derived backward ones."""
    f, _ = fs.dtypes(cfg.recipe)
    if cfg.delayed:
        sc = {r: state[f"{r}_scale"][0] for r in fs.ROLES}
        # cuDNN quantizes the flash kernel's running-max-relative exp(s - m) (up to 1, over the
        # keep rate after dropout), not the normalized probabilities the amax history records:
        # a scale from a non-causal history (amax ~ 1/3) saturated it (rel error 0.41 on the H200).
        sc["s"] = jnp.minimum(sc["s"], jnp.float32(fs.fmax(f) * (1.0 - cfg.rate)))
        return sc
    return {r: fs.encode_scale(a[r], fs.fmax(f)) for r in ("q", "k", "v")}


def _bwd_scales(cfg, sc, a, a_do, q_shape):
    if cfg.delayed:
        return sc
    _, b = fs.dtypes(cfg.recipe)
    out = dict(sc, do=fs.encode_scale(a_do, fs.fmax(b)))
    bound = fs.current_output_scales(
        cfg.recipe, dict(a, do=a_do), scale=cfg.scale, rate=cfg.rate, sq=q_shape[1], d=q_shape[3]
    )
    return out | {r: bound[r] for r in fs.BWD_ROLES if r != "do"}


def _current_fwd_outputs(cfg, sc, a, q_shape):
    if cfg.delayed:
        return sc
    bound = fs.current_output_scales(
        cfg.recipe, dict(a, do=jnp.float32(1)), scale=cfg.scale, rate=cfg.rate, sq=q_shape[1], d=q_shape[3]
    )
    return dict(sc, s=bound["s"], o=bound["o"])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8(cfg: _Config, q, k, v, state, rng):
    return _fp8_fwd(cfg, q, k, v, state, rng)[0]


def _fp8_fwd(cfg, q, k, v, state, rng):
    a = {"q": fs.amax(q), "k": fs.amax(k), "v": fs.amax(v)}
    sc = _current_fwd_outputs(cfg, _fwd_scales(cfg, state, a), a, q.shape)
    run = _cudnn_fwd if cfg.cudnn else _emulate_fwd
    if cfg.plan is not None:
        out, res, a["s"], a["o"] = sharded_fwd(cfg, run, cfg.plan, q, k, v, sc, rng)
    else:
        out, res, a["s"], a["o"] = run(cfg, q, k, v, sc, rng)
    return out.astype(q.dtype), (res, sc, a, state, rng)


def _fp8_bwd(cfg, res, ct):
    kernel_res, sc, a, state, rng = res
    a_do = fs.amax(ct)
    sc = _bwd_scales(cfg, sc, a, a_do, kernel_res[0].shape)
    run = _cudnn_bwd if cfg.cudnn else _emulate_bwd
    if cfg.plan is not None:
        (dq, dk, dv), a_bwd = sharded_bwd(cfg, run, cfg.plan, kernel_res, sc, ct, rng)
    else:
        (dq, dk, dv), a_bwd = run(cfg, kernel_res, sc, ct, rng)
    dt = ct.dtype
    state_ct = fs.step_state(cfg.recipe, state, a | a_bwd | {"do": a_do}) if cfg.delayed else None
    return dq.astype(dt), dk.astype(dt), dv.astype(dt), state_ct, None


_fp8.defvjp(_fp8_fwd, _fp8_bwd)


def fp8_head_dim_unsupported(head_dim: int) -> Optional[str]:
    """Why cuDNN's FP8 attention cannot train with this head_dim (None: it can). Its FP8
    backward takes head_dim 128 only (cuDNN 9.19 on an H200, session 12: "hidden_dim should be
    equal to 128"); the forward takes more, but a training step needs both."""
    if head_dim != 128:
        return f"head_dim {head_dim} (cuDNN's FP8 attention backward needs 128)"
    return None


def cudnn_fp8_available(q, k) -> Optional[str]:
    """None when cuDNN's FP8 attention can run these shapes here, else why not."""
    if jax.default_backend() != "gpu":
        return "no GPU backend"
    why = fp8_head_dim_unsupported(q.shape[-1])
    if why is not None:
        return why
    ok, reason = ffi.cudnn_status()
    return None if ok else reason


def unsupported(
    *,
    bias=False,
    softmax_type="vanilla",
    segments=False,
    window=None,
    cp=False,
    mask=False,
    mask_type="no_mask",
    sq=0,
    sk=0,
) -> Optional[str]:
    """Why FP8 attention cannot take a call (None: it can). These fall back to high precision."""
    if bias:
        return "an attention bias (cuDNN's FP8 attention has no bias gradient)"
    if softmax_type != "vanilla":
        return f"softmax_type={softmax_type!r} (attention sinks)"
    if segments or mask:
        return "packed or padded sequences (a SequenceDescriptor or a mask)"
    if window is not None:
        return "a sliding window"
    if cp:
        return "context parallelism"
    if mask_type not in ("no_mask", "causal") or (mask_type == "causal" and sq != sk):
        return f"attn_mask_type={mask_type!r} with sq={sq}, sk={sk} (no_mask, or causal with sq == sk)"
    return None  # a mesh split runs per shard (fp8_sharded)


def config(q, k, *, recipe, causal, scale, dropout_rate, rng, implementation) -> _Config:
    """The op's static configuration after the checks of everything but the state (q, k: arrays
    or ``jax.ShapeDtypeStruct``)."""
    fs.check_recipe(recipe)
    for name, x in (("q", q), ("k", k)):
        if len(getattr(x, "shape", ())) != 4 or not jnp.issubdtype(
            getattr(x, "dtype", np.int32), jnp.floating
        ):
            got = getattr(x, "shape", x)
            raise ValueError(f"{name} must be a float (batch, seq, heads, head_dim) array, got {got}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"k and v must be (batch, sk, groups dividing q's heads, head_dim), got {k.shape}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal FP8 attention needs sq == sk, got {q.shape[1]} and {k.shape[1]}")
    scale, rate = fa.check_scale_and_rate(q.shape[-1], scale, dropout_rate, rng)
    if implementation not in (None, "cudnn", "emulate"):
        raise ValueError(f"implementation must be None, 'cudnn' or 'emulate', got {implementation!r}")
    why = cudnn_fp8_available(q, k) if implementation != "emulate" else "emulation asked for"
    if implementation == "cudnn" and why is not None:
        raise ValueError(f"implementation='cudnn' cannot run FP8 attention here: {why}")
    if why is None:
        warn_if_hopper()
    plan = plan_heads(q.shape[0], q.shape[2], k.shape[2])
    return _Config(recipe, bool(causal), scale, rate, why is None, plan)


HOPPER_WARNING = (
    "lowbit: FP8 attention (fp8_dpa / fp8_mha) on a Hopper GPU runs cuDNN's FP8 kernels, which "
    "measured 0.89-0.94x the speed of BF16 attention (cuDNN 9.19, H200) and diverged in 3 of 17 "
    "2000-step training runs: cuDNN on Hopper writes the attention output in FP8 only, and its "
    "backward's D = rowsum(dO * O) carries that rounding into dS. fp8_dpa=False is faster and "
    "stable there; docs/numerics.md, 'FP8 attention on Hopper'."
)
_warned = []


def _sm_major() -> int:
    cc = compute_capability(jax.devices()[0])
    return cc[0] if cc else 0


def warn_if_hopper() -> None:
    """Logs HOPPER_WARNING once per process when FP8 attention takes cuDNN's kernels on an
    sm_90 device (a log record, not a Python warning: code that turns warnings into errors to
    catch a BF16 fallback keeps working)."""
    if not _warned and _sm_major() == 9:
        _warned.append(True)
        logging.getLogger("lowbit").warning(HOPPER_WARNING)


def fp8_attention(
    q,
    k,
    v,
    *,
    recipe,
    state: Optional[dict] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    dropout_rate: float = 0.0,
    rng=None,
    implementation: Optional[str] = None,
) -> jax.Array:
    """FP8 scaled dot-product attention of ``q (b, sq, h, d)`` over ``k``/``v (b, sk, g, d)``
    (``h % g == 0``) under ``recipe`` (DelayedScaling with ``state`` from
    :func:`lowbit.ops.attention.fp8_scales.init_state`, or Float8CurrentScaling). ``causal``:
    key ``j > i`` masked (needs ``sq == sk``). ``implementation``: None (cuDNN on a GPU where it
    applies, else the emulation), "cudnn" (an error if it cannot run) or "emulate". Returns
    ``(b, sq, h, d)`` in q's dtype; differentiable in q, k, v (and in ``state``: its cotangent is
    the next state)."""
    fs.check_recipe(recipe)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4 or not jnp.issubdtype(x.dtype, jnp.floating):
            got = getattr(x, "shape", x)
            raise ValueError(f"{name} must be a float (batch, seq, heads, head_dim) array, got {got}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must be (batch, sk, groups dividing q's heads, head_dim), got {k.shape}, {v.shape}"
        )
    kw = dict(causal=causal, scale=scale, dropout_rate=dropout_rate, rng=rng, implementation=implementation)
    cfg = config(q, k, recipe=recipe, **kw)
    state = fs.check_state(recipe, state)
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    k, v, v_mean = _centered(k, v, dropout_rate)
    return _uncentered(_fp8(cfg, q, k, v, state, rng), v_mean)


def _centered(k, v, rate):
    """k and v less their means over the sequence (per batch, group and channel), and v's mean.

    Exact in real arithmetic: a row-constant shift of the scores leaves the softmax unchanged,
    and o = P (v - m) + m where P's rows sum to one. In FP8 it is what keeps the gradients:
    trained keys and values share a large common component, dS's row sums (zero in exact
    arithmetic) are not zero once dS is rounded, and dq = scale dS k then carries that error
    times k's common component (dq 3x its norm off on a diverging run's checkpoint; V's
    component does the same to dP - D). Dropout's rescaled rows do not sum to one: v stays."""
    k = _rounded(k.astype(F32) - _seq_mean(k), k.dtype)
    if rate > 0:
        return k, v, None
    v_mean = _seq_mean(v)
    return k, _rounded(v.astype(F32) - v_mean, v.dtype), v_mean


def _seq_mean(x):
    """x's mean over the sequence (float32), rounded to x's format: any vector common to all
    positions would do, and a rounded one does not move the codes when a mesh sums in another
    order."""
    return _rounded(jnp.mean(x.astype(F32), axis=1, keepdims=True), x.dtype).astype(F32)


def _uncentered(o, v_mean):
    """The output of centered v back: o plus v's mean (each KV group's mean on its heads), in o's
    dtype; o itself when v was not centered (``v_mean`` None)."""
    if v_mean is None:
        return o
    v_mean = jnp.repeat(v_mean, o.shape[2] // v_mean.shape[2], axis=2)
    return (o.astype(F32) + v_mean).astype(o.dtype)


def _rounded(x, dtype):
    """float32 ``x`` in ``dtype``, rounded explicitly: XLA may otherwise keep a float32 value
    it converts down and back up (excess precision), and then the FP8 codes of k and v depend on
    how the surrounding graph was fused."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant).astype(dtype)


__all__ = ["config", "cudnn_fp8_available", "fp8_attention", "fp8_head_dim_unsupported", "unsupported"]
