"""Dense and transformer-layer forward+backward: plain Flax, Flax's FP8 op, and lowbit.

Models are the seeds' (a single Dense block; the plain-Flax transformer layer) with only their
``dot_general_cls`` changed. Each case is one JIT-compiled value_and_grad over all variables and
the input, timed after warm-up (median of repeats). Rows also carry the speedup over plain Flax
with bf16 params and over the seeds' float32-params setting. The per-GEMM rows time the layer's
four GEMM shapes: lowbit's FP8 GEMM on pre-quantized operands next to a BF16 ``jnp.dot``.

On Hopper, MXFP8/NVFP4 run lowbit's study path (exact decode + BF16 GEMM): numerics only.
"""

from __future__ import annotations

from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

import lowbit
from lowbit import flax as lowbit_flax
from lowbit.bench.common import case_named, on_gpu, time_fn

FULL = dict(
    tokens_dense=(4, 2048),
    dense_in=4096,
    dense_out=16384,
    batch=4,
    seq=2048,
    hidden=4096,
    ffn=16384,
    heads=32,
)
SMALL = dict(
    tokens_dense=(2, 128), dense_in=256, dense_out=1024, batch=2, seq=64, hidden=256, ffn=1024, heads=4
)


# ---- the seeds' models (plain Flax; only dot_general_cls varies) -----------------------------
class DenseBlock(nn.Module):
    features: int
    dot_general_cls: Callable = lambda: None

    @nn.compact
    def __call__(self, x):
        return nn.Dense(features=self.features, use_bias=True, dot_general=self.dot_general_cls())(x)


class DocsDenseBlock(nn.Module):
    """TransformerEngine's JAX Dense tutorial block (the issue's "seed Dense" row): float32
    params computed in bf16 (Flax casts the kernel), no bias; its harness takes ``vdot(out, dy)``
    with a bf16 ``dy``."""

    features: int
    dot_general_cls: Callable = lambda: None

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(
            self.features, use_bias=False, dtype=jnp.bfloat16, dot_general=self.dot_general_cls()
        )
        return dense(x)


class MLP(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    dot_general_cls: Callable = lambda: None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(features=self.ffn_hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)
        x = nn.gelu(x, approximate=True)
        return nn.Dense(features=self.hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)


class TransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1
    dot_general_cls: Callable = lambda: None

    @nn.compact
    def __call__(self, x, attention_mask: Optional[jax.Array] = None, deterministic: bool = False):
        kv = self.hidden_size // self.num_attention_heads
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)
        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)
        qkv = nn.Dense(features=3 * self.hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * kv)
        q, k, v = jnp.split(qkv, 3, axis=3)
        rng = self.make_rng("dropout") if (not deterministic and self.attention_dropout > 0) else None
        x = nn.dot_product_attention(
            query=q,
            key=k,
            value=v,
            mask=attention_mask,
            dropout_rng=rng,
            dropout_rate=self.attention_dropout,
            deterministic=deterministic,
            broadcast_dropout=True,
        )
        x = x.reshape(x.shape[0], x.shape[1], self.hidden_size)
        x = nn.Dense(features=self.hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)
        x = res + x
        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)
        x = MLP(self.hidden_size, self.ffn_hidden_size, dot_general_cls=self.dot_general_cls)(x)
        return x + res


# ---- cases -----------------------------------------------------------------------------------
def _cases():
    """(name, dot_general_cls, params dtype, recipe, note)."""
    hopper_note = "numerics-only on Hopper (study path)"
    out = [
        ("flax f32 params", lambda: None, jnp.float32, None, "the seeds' setting"),
        ("flax bf16 params", lambda: None, jnp.bfloat16, None, "baseline"),
        ("flax Fp8DotGeneralOp", nn.Fp8DotGeneralOp, jnp.float32, None, "Flax's FP8 peer"),
    ]
    for label, recipe, note in (
        ("delayed", lowbit.DelayedScaling(), ""),
        ("current", lowbit.Float8CurrentScaling(), ""),
        ("mxfp8", lowbit.MXFP8BlockScaling(), hopper_note),
        (
            "fp8 block",
            lowbit.Float8BlockScaling(),
            "block-scaled FP8 (1x128 / 128x128), GEMM routed per shape",
        ),
        ("nvfp4", lowbit.NVFP4BlockScaling(), hopper_note),
    ):
        cls = lowbit_flax.make_dot_general_cls(recipe)
        out.append((f"lowbit {label}", cls, jnp.float32, recipe, note or "dot_general_cls swapped only"))
        if label in ("delayed", "current", "fp8 block"):
            out.append((f"lowbit {label} bf16 params", cls, jnp.bfloat16, recipe, note))
    return out


def _fwd_bwd(model, variables, x, dy, rngs, kwargs, out_dtype=jnp.float32):
    # dy and the RNG keys are arguments, not closure constants: XLA would otherwise constant-fold
    # work on them at compile time (slow, and it prints "Constant folding ... is taking > 1s").
    # out_dtype None: the loss takes the output as it comes (the tutorial's harness).
    def loss(v, x, dy, rngs):
        y = model.apply(v, x, rngs=rngs, **kwargs)
        return jnp.vdot(y if out_dtype is None else y.astype(out_dtype), dy)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (variables, x, dy, rngs)


def _cast_params(variables, dtype):
    return dict(variables, params=jax.tree_util.tree_map(lambda a: a.astype(dtype), variables["params"]))


def _model(kind: str, cfg: dict):
    """(make(dot_general_cls) -> module, input shape, output shape, apply kwargs, row label)."""
    if kind == "dense":
        shape = cfg["tokens_dense"] + (cfg["dense_in"],)
        out_shape = cfg["tokens_dense"] + (cfg["dense_out"],)
        make = lambda cls: DenseBlock(features=cfg["dense_out"], dot_general_cls=cls)
        return (
            make,
            shape,
            out_shape,
            {},
            f"dense {shape[0] * shape[1]}x{cfg['dense_in']}->{cfg['dense_out']}",
        )
    shape = (cfg["batch"], cfg["seq"], cfg["hidden"])
    make = lambda cls: TransformerLayer(cfg["hidden"], cfg["ffn"], cfg["heads"], dot_general_cls=cls)
    return (
        make,
        shape,
        shape,
        {"attention_mask": None, "deterministic": False},
        f"layer b{cfg['batch']} s{cfg['seq']} h{cfg['hidden']} ffn{cfg['ffn']}",
    )


def _docs_cases():
    """(name, dot_general_cls, recipe) of the tutorial block (float32 params, bf16 compute)."""
    out = [("flax", lambda: None, None)]
    for label, recipe in (("delayed", lowbit.DelayedScaling()), ("current", lowbit.Float8CurrentScaling())):
        out.append((f"lowbit {label}", lowbit_flax.make_dot_general_cls(recipe), recipe))
    return out


def build_case(kind: str, name: str, cfg: dict, key, drop):
    """The jitted fwd+bwd of one case (a ``_cases()`` name, or a ``_docs_cases()`` name for kind
    "docs dense") and its arguments."""
    if kind == "docs dense":
        shape = cfg["tokens_dense"] + (cfg["dense_in"],)
        x = jax.random.normal(key, shape).astype(jnp.bfloat16)
        dy = jax.random.normal(key, cfg["tokens_dense"] + (cfg["dense_out"],)).astype(jnp.bfloat16)
        model = DocsDenseBlock(cfg["dense_out"], case_named(_docs_cases(), name, kind)[1])
        return _fwd_bwd(model, model.init(key, x), x, dy, {}, {}, out_dtype=None)
    make, shape, out_shape, kwargs, _ = _model(kind, cfg)
    _, cls, pdtype, _, _ = case_named(_cases(), name, kind)
    x = jax.random.normal(key, shape).astype(jnp.bfloat16)
    dy = jax.random.normal(key, out_shape, jnp.float32)
    model = make(cls)
    rngs = {"dropout": drop, "sr_rng": jax.random.PRNGKey(0)}
    v = _cast_params(model.init(key, x, **kwargs), pdtype)
    return _fwd_bwd(model, v, x, dy, rngs, kwargs)


def _model_rows(kind: str, cfg: dict, small: bool, progress) -> list[dict]:
    key, drop = jax.random.split(jax.random.PRNGKey(42))
    label = _model(kind, cfg)[-1]
    rows = []
    for name, _, _, _, note in _cases():
        fn, args = build_case(kind, name, cfg, key, drop)
        clocks = {}
        ms = time_fn(fn, *args, warmup=2, iters=2 if small else 10, repeats=3 if small else 5, clocks=clocks)
        rows.append(dict(model=label, name=f"{kind}: {name}", ms=ms, note=note, **clocks))
        del fn, args
        if progress:
            progress()
    base = {r["name"].split(": ", 1)[1]: r["ms"] for r in rows}
    for r in rows:
        r["speedup"] = base["flax bf16 params"] / r["ms"]
        r["speedup_vs"] = "flax bf16 params"
        r["speedup_vs_f32_params"] = base["flax f32 params"] / r["ms"]
    return rows


def _docs_dense_rows(cfg: dict, small: bool, progress) -> list[dict]:
    """TransformerEngine's Dense tutorial (``DocsDenseBlock``, its harness); speedup against the
    same block in plain Flax."""
    key = jax.random.PRNGKey(42)
    tokens = cfg["tokens_dense"][0] * cfg["tokens_dense"][1]
    label = f"docs dense {tokens}x{cfg['dense_in']}->{cfg['dense_out']} (f32 params, bf16 compute, no bias)"
    rows = []
    for name, _, _ in _docs_cases():
        step, args = build_case("docs dense", name, cfg, key, key)
        clocks = {}
        ms = time_fn(
            step, *args, warmup=2, iters=2 if small else 20, repeats=3 if small else 5, clocks=clocks
        )
        note = "TE's JAX Dense tutorial harness"
        rows.append(dict(model=label, name=f"docs dense: {name}", ms=ms, note=note, **clocks))
        if progress:
            progress()
    for r in rows:
        r["speedup"] = rows[0]["ms"] / r["ms"]
        r["speedup_vs"] = "docs dense: flax"
    return rows


def _gemm_rows(cfg: dict, small: bool, progress) -> list[dict]:
    """The layer's GEMMs, (M, K) x (K, N): QKV, output projection, FFN up, FFN down."""
    m = cfg["batch"] * cfg["seq"]
    h, f = cfg["hidden"], cfg["ffn"]
    rows = []
    for label, k, n in (("qkv", h, 3 * h), ("proj", h, h), ("fc1", h, f), ("fc2", f, h)):
        ka, kb = jax.random.split(jax.random.PRNGKey(n + k))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        w = jax.random.normal(kb, (k, n), jnp.bfloat16)
        qa = lowbit.quantize(a, lowbit.ScalingMode.CURRENT_TENSOR_SCALING)
        qw = lowbit.quantize(w, lowbit.ScalingMode.CURRENT_TENSOR_SCALING, layout="colwise")  # (N, K)
        flops = 2.0 * m * n * k
        cases = (
            ("bf16 jnp.dot", jax.jit(lambda a, w: jnp.dot(a, w)), (a, w)),
            ("lowbit fp8", jax.jit(lambda qa, qw: lowbit.gemm(qa, qw, out_dtype=jnp.bfloat16)), (qa, qw)),
            (
                "lowbit fp8 fast-accum",
                jax.jit(lambda qa, qw: lowbit.gemm(qa, qw, out_dtype=jnp.bfloat16, fast_accum=True)),
                (qa, qw),
            ),
        )
        base = None
        for name, fn, args in cases:
            ms = time_fn(fn, *args, warmup=2, iters=3 if small else 20, repeats=3 if small else 5)
            base = base or ms
            rows.append(
                dict(
                    model=f"gemm {label} {m}x{k}x{n}",
                    name=f"gemm {label}: {name}",
                    ms=ms,
                    TFLOPs=flops / (ms * 1e-3) / 1e12,
                    speedup=base / ms,
                    speedup_vs="bf16 jnp.dot",
                )
            )
            if progress:
                progress()
    return rows


def run(small: bool, progress=None) -> list[dict]:
    cfg = SMALL if small else FULL
    rows = _model_rows("dense", cfg, small, progress)
    rows += _docs_dense_rows(cfg, small, progress)
    rows += _model_rows("layer", cfg, small, progress)
    rows += _gemm_rows(cfg, small, progress)
    if not on_gpu():
        for r in rows:
            r["note"] = (r.get("note", "") + "; CPU: lowbit runs its reference kernels").lstrip("; ")
    return rows


def count(small: bool) -> int:
    return 2 * len(_cases()) + len(_docs_cases()) + 4 * 3
