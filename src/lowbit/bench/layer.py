"""Transformer layer forward+backward: lowbit's ``TransformerLayer`` next to the seed's plain
Flax layer (from :mod:`lowbit.bench.dense`), on the seed shapes (batch 4, seq 2048, hidden 4096,
ffn 16384, 32 heads, causal).

Each case is one JIT-compiled value_and_grad over all variables and the input (bf16), timed
after warm-up (median of repeats). lowbit's layer is configured as the seed layer: bf16
parameters, a GELU MLP with biases, LayerNorm epsilon 1e-5, logits scaled by 1/sqrt(head_dim)
(query init unscaled), no relative position bias, no hidden or MLP dropout. The plain cases
have no attention dropout (so attention can take cuDNN's fused kernel); "lowbit delayed,
attention dropout 0.1" is the seed layer as the seed measures it (attention dropout 0.1) through
lowbit's modules with default XLA_FLAGS: on a GPU the dropout runs in lowbit's own cuDNN-frontend
attention (lowbit.ops.fused_attention, not command-buffer compatible, so XLA's command buffers
cannot capture it); the "cuDNN dropout" case is the same layer timed in a child process whose
XLA_FLAGS keep custom calls out of command buffers (the workaround jax's own cuDNN dropout needed).
``speedup`` is against plain Flax with bf16 params
(which keeps the seed's attention dropout of 0.1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

import lowbit
from lowbit import flax as lowbit_flax
from lowbit.bench.common import case_named, env_names, on_gpu, time_fn
from lowbit.bench.dense import FULL, SMALL, _cast_params, _fwd_bwd
from lowbit.bench.dense import TransformerLayer as SeedLayer


def _cases():
    """(name, builder(cfg) -> module, params dtype, recipe, note)."""
    seed = lambda cfg: SeedLayer(cfg["hidden"], cfg["ffn"], cfg["heads"])

    def ours(attention_dropout):
        return lambda cfg: lowbit_flax.TransformerLayer(
            hidden_size=cfg["hidden"],
            mlp_hidden_size=cfg["ffn"],
            num_attention_heads=cfg["heads"],
            layernorm_epsilon=1e-5,
            hidden_dropout=0.0,
            attention_dropout=attention_dropout,
            intermediate_dropout=0.0,
            mlp_activations=("gelu",),
            use_bias=True,
            self_attn_mask_type="causal",
            enable_relative_embedding=False,
            scale_attn_logits=True,
            scaled_query_init=False,
            dtype=jnp.bfloat16,
        )

    return [
        ("flax f32 params", seed, jnp.float32, None, "the seed's setting"),
        ("flax bf16 params", seed, jnp.bfloat16, None, "baseline"),
        ("lowbit bf16 (no recipe)", ours(0.0), jnp.bfloat16, None, "no attention dropout"),
        ("lowbit delayed", ours(0.0), jnp.bfloat16, lowbit.DelayedScaling(), "no attention dropout"),
        ("lowbit current", ours(0.0), jnp.bfloat16, lowbit.Float8CurrentScaling(), "no attention dropout"),
        ("lowbit fp8 block", ours(0.0), jnp.bfloat16, lowbit.Float8BlockScaling(), "1x128 / 128x128 FP8"),
        (
            _BLOCK_UNFUSED_CHILD,
            ours(0.0),
            jnp.bfloat16,
            lowbit.Float8BlockScaling(),
            "LOWBIT_BLOCK_FUSION=0: norm/activation write BF16, then quantize (before issue 28's fusion)",
        ),
        ("lowbit mxfp8", ours(0.0), jnp.bfloat16, lowbit.MXFP8BlockScaling(), "Hopper: exact BF16 path"),
        (
            "lowbit delayed, attention dropout 0.1",
            ours(0.1),
            jnp.bfloat16,
            lowbit.DelayedScaling(),
            "the seed layer's attention dropout (default XLA_FLAGS: lowbit's cuDNN-frontend attention)",
        ),
        (
            _SPLIT_ACC_CHILD,
            ours(0.0),
            jnp.bfloat16,
            lowbit.DelayedScaling(),
            "NVTE_JAX_FP8_2X_ACC_DGRAD=1 NVTE_JAX_FP8_2X_ACC_WGRAD=1 (TE's switches; default: fast)",
        ),
        (
            _DROPOUT_CHILD,
            ours(0.1),
            jnp.bfloat16,
            lowbit.DelayedScaling(),
            "XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL",
        ),
    ]


# Cases timed in a child process with these environment variables (XLA reads XLA_FLAGS once per
# process): command buffers without CUDNN, so cuDNN's dropout can run.
_CHILD_ENV = {
    "lowbit delayed, attention dropout 0.1, cuDNN dropout": {
        "XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL",
    },
}
_DROPOUT_CHILD = "lowbit delayed, attention dropout 0.1, cuDNN dropout"
# The gradients' FP8 GEMMs with split accumulation (TransformerEngine's environment switches;
# TE < 2.10's and lowbit's earlier default; fast is TE 2.20's).
_SPLIT_ACC_CHILD = "lowbit delayed, split accumulation in dgrad/wgrad"
_CHILD_ENV[_SPLIT_ACC_CHILD] = {"NVTE_JAX_FP8_2X_ACC_DGRAD": "1", "NVTE_JAX_FP8_2X_ACC_WGRAD": "1"}
# Float8BlockScaling without the norm/activation kernels' block-scaled outputs (before/after).
_BLOCK_UNFUSED_CHILD = "lowbit fp8 block, unfused norm/activation"
_CHILD_ENV[_BLOCK_UNFUSED_CHILD] = {"LOWBIT_BLOCK_FUSION": "0"}


def build_case(name: str, cfg: dict, key, drop):
    """The jitted fwd+bwd of one case (a ``_cases()`` name) and its arguments."""
    _, build, pdtype, recipe, _ = case_named(_cases(), name, "layer")
    shape = (cfg["batch"], cfg["seq"], cfg["hidden"])
    x = jax.random.normal(key, shape).astype(jnp.bfloat16)
    dy = jax.random.normal(key, shape, jnp.float32)
    model = build(cfg)
    seed = isinstance(model, SeedLayer)
    if seed:
        kwargs = {"attention_mask": None, "deterministic": False}
    else:  # dropout only where the case has attention dropout (its other rates are 0)
        kwargs = {"deterministic": model.attention_dropout == 0}
    rngs = {"dropout": drop}
    with lowbit.autocast(recipe):
        v = _cast_params(nn.unbox(model.init({"params": key, "dropout": drop}, x, **kwargs)), pdtype)
    step, args = _fwd_bwd(model, v, x, dy, rngs, kwargs)

    def fn(*a):
        # The recipe is part of jit's cache key (issue 11): every call runs under it, or jit would
        # trace the step again without one.
        with lowbit.autocast(recipe):
            return step(*a)

    jax.block_until_ready(fn(*args))  # trace and compile
    return fn, args


def time_case(name: str, small: bool, clocks: Optional[dict] = None) -> float:
    """Milliseconds per step of one case in this process (``clocks``: see ``time_fn``)."""
    cfg = SMALL if small else FULL
    key, drop = jax.random.split(jax.random.PRNGKey(42))
    fn, args = build_case(name, cfg, key, drop)
    return time_fn(fn, *args, warmup=2, iters=2 if small else 10, repeats=3 if small else 5, clocks=clocks)


def _time_in_child(name: str, small: bool, clocks: dict) -> float:
    env = dict(os.environ, **_CHILD_ENV[name])
    cmd = [sys.executable, "-m", "lowbit.bench.layer", name] + (["--small"] if small else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"layer case {name!r} failed in its child process:\n{out.stderr[-2000:]}")
    result = json.loads(lines[-1])
    clocks.update({k: v for k, v in result.items() if k != "ms"})
    return result["ms"]


def run(small: bool, progress=None) -> list[dict]:
    cfg = SMALL if small else FULL
    label = f"layer b{cfg['batch']} s{cfg['seq']} h{cfg['hidden']} ffn{cfg['ffn']} heads{cfg['heads']}"
    rows = []
    for name, _, _, _, note in _picked():
        clocks = {}
        ms = _time_in_child(name, small, clocks) if name in _CHILD_ENV else time_case(name, small, clocks)
        rows.append(dict(model=label, name=name, ms=ms, note=note, **clocks))
        if progress:
            progress()
    base = {r["name"]: r["ms"] for r in rows}
    for r in rows:
        r["speedup"] = base["flax bf16 params"] / r["ms"]
        r["speedup_vs"] = "flax bf16 params"
        r["speedup_vs_f32_params"] = base["flax f32 params"] / r["ms"]
    if not on_gpu():
        for r in rows:
            r["note"] = (r["note"] + "; CPU: lowbit runs its reference kernels").lstrip("; ")
    return rows


def _picked():
    """The cases named in LOWBIT_LAYER_CASES (";"-separated; the two Flax baselines always run:
    the speed-ups are against them), or all."""
    names = env_names("LOWBIT_LAYER_CASES", [c[0] for c in _cases()], "layer")
    if not names:
        return _cases()
    return [c for c in _cases() if c[0] in names or c[0].startswith("flax ")]


def count(small: bool) -> int:
    return len(_picked())


if __name__ == "__main__":  # one case, for a child process: prints {"ms": ..., clocks}
    _clocks = {}
    _ms = time_case(sys.argv[1], "--small" in sys.argv[2:], _clocks)
    print(json.dumps({"ms": _ms, **_clocks}))
