"""The MoE block (lowbit.moe.moe_block: router, dispatch, two grouped GEMMs with a SwiGLU,
combine), forward+backward, next to an all-XLA block (jax.lax.ragged_dot, the same sort-based
dispatch) in one process.

Cases (the ``weights`` column says where the weights' FP8 copies come from): ``xla bf16``;
``lowbit bf16``; ``fp8 current`` / ``fp8 delayed`` / ``fp8 block`` (``cast in step``: every
cast inside the step, the old default); ``... primary`` (``copies, untimed``: the copies made
outside the timed step, as an optimizer kernel that writes them would; the step casts tokens
and gradients only); ``... primary refresh`` (``copies + refresh``: the Flax MoEBlock's
default with ``lowbit.flax.refresh_fp8_weights`` in the loop: the step reads the copies and
then remakes them, the refresh's cast timed with it; the optimizer update itself is in no row);
``... fused`` rows trace the block under ``lowbit.moe.kernels("fused")``, FP8 ones with the
fused FP8 dispatch feeding fc1 (``lowbit.moe.permute_quantize``: no bf16 gather, no token
cast in fc1). TFLOP/s counts the expert GEMMs: 2 * T * k * H * 3F per forward (fc1 with
its two halves, fc2), three times that for forward+backward; ``floor_ms`` is that work at the
card's dense peak for the case's operand type (H100 SXM: 989 TFLOP/s BF16, 1979 FP8), and
``weight_GB`` the expert weights' bytes one step moves (BF16: read by fprop and dgrad, dW
written; FP8 with casts: read once by the cast, both copies written and read, dW written;
primary: the copies read, dW written): at 128 experts of 128 tokens the step is
bandwidth-bound on them.

``te-api moe none`` / ``delayed`` / ``current``: TE's ``moe()`` API, one row per peer that runs
it (``... [lowbit.te]``, ``... [transformer_engine]``; lowbit.bench.moe_peers says where TE's runs).

The ``... + adamw`` rows (lowbit.bench.moe_update) time the full training step, the optax.adamw
update of float32 masters included, and the FP8 expert copies written by that update; their
``vs_bf16`` is against ``lowbit bf16 + adamw``, their ``weight_GB`` counts the update's bytes.

The ``pieces`` rows time the block's non-GEMM steps alone, forward+backward in BF16 (the gate
and top-k router with the aux loss; the dispatch plan and the permutation of the tokens; the
weighted combine: these two return their output and their vjp at a random cotangent, as in
the layer, not the gradient of a sum), each twice: ``xla`` (plain JAX) and ``fused`` (lowbit's kernels,
``impl="fused"``). The ``... fused`` block cases run the whole block with the fused router,
plan, permutation and combine (``lowbit.moe.kernels("fused")``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import lowbit
from lowbit.bench import moe_peers, moe_update
from lowbit.bench.common import env_names, time_fn
from lowbit.moe import kernels, quantize_experts
from lowbit.moe.block import moe_block
from lowbit.moe.permutation import permute, plan_dispatch, unpermute
from lowbit.moe.router import topk_routing

# (name, tokens, hidden, experts, ffn, top-k): the layers and its G=128 grouped shape.
GPU_SHAPES = [
    ("G8 mixtral", 16384, 4096, 8, 14336, 2),
    ("G64 deepseek", 16384, 4096, 64, 1536, 6),
    ("G128", 4096, 4096, 128, 1024, 4),
]
CPU_SHAPES = [("G4 small", 128, 128, 4, 128, 2)]
CASES = (
    "xla bf16",
    "lowbit bf16",
    "lowbit bf16 fused",
    "fp8 current",
    "fp8 delayed",
    "fp8 block",
    "fp8 delayed primary",
    "fp8 block primary",
    "fp8 delayed primary fused",
    "fp8 delayed fused",
    "fp8 current primary refresh",
    "fp8 delayed primary refresh",
    "fp8 block primary refresh",
) + moe_update.CASES
PIECE_IMPLS = ("xla", "fused")
PEAK = {"bf16": 989e12, "fp8": 1979e12}  # H100 SXM dense


def _xla_block(x, gate, wi, wo, k):
    """The all-XLA baseline: the same router and dispatch, jax.lax.ragged_dot GEMMs."""
    logits = jnp.dot(x.astype(jnp.float32), gate.astype(jnp.float32))
    w, ex = topk_routing(logits, k)
    plan = plan_dispatch(ex, wi.shape[0])
    xs = permute(x.astype(jnp.bfloat16), plan)
    h = jax.lax.ragged_dot(xs, wi.astype(jnp.bfloat16), plan.group_sizes)
    a, b = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    h = (jax.nn.silu(a) * b).astype(jnp.bfloat16)
    y = jax.lax.ragged_dot(h, wo.astype(jnp.bfloat16), plan.group_sizes)
    return unpermute(y, plan, w, x.dtype)


def _recipe(case):
    if "block" in case:
        return lowbit.Float8BlockScaling()
    if "delayed" in case:
        return lowbit.DelayedScaling()
    return lowbit.Float8CurrentScaling() if "current" in case else None


def _step(case, k):
    """jit(fwd+bwd) of the block for ``case``: (fn, extra args after x, gate, wi, wo)."""
    recipe = _recipe(case)

    def loss(x, gate, wi, wo, state, qws):
        if case == "xla bf16":
            y = _xla_block(x, gate, wi, wo, k)
        else:
            with kernels("fused" if "fused" in case else "xla"):  # entered while tracing
                y = moe_block(
                    x, gate, wi, wo, num_experts_per_tok=k, recipe=recipe, state=state, quantized_weights=qws
                )[0]
        return jnp.sum(y.astype(jnp.float32))

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    if not case.endswith("refresh"):
        return jax.jit(grad), recipe

    def refreshed(x, gate, wi, wo, state, qws):  # the step, then the next step's copies
        s1, s2 = (None, None) if state is None else state
        return grad(x, gate, wi, wo, state, qws), (
            quantize_experts(wi, recipe, s1),
            quantize_experts(wo, recipe, s2),
        )

    return jax.jit(refreshed), recipe


def weights_source(case) -> str:
    if case in moe_update.CASES:
        return "bf16 by update" if case == moe_update.BASE else f"fp8 by {case.split()[3]}"
    if recipe_free(case):
        return "bf16"
    if case.endswith("refresh"):
        return "copies + refresh"
    return "copies, untimed" if "primary" in case else "cast in step"


def recipe_free(case) -> bool:
    return case.startswith(("xla bf16", "lowbit bf16"))


def _extras(case, recipe, wi, wo):
    E = wi.shape[0]
    state = None
    if isinstance(recipe, lowbit.DelayedScaling):
        state = (lowbit.init_grouped_delayed_state(recipe, E),) * 2
    qws = None
    if "primary" in case:
        s1, s2 = (None, None) if state is None else state
        qws = jax.jit(lambda a, b: (quantize_experts(a, recipe, s1), quantize_experts(b, recipe, s2)))(wi, wo)
    return state, qws


def _pieces(x, gate, E, k, impl):
    """(name, jitted fwd+bwd fn, args) of the router, the dispatch and the combine alone, with
    ``impl``'s kernels."""
    from lowbit.moe.block import RouterConfig, route_tokens
    from lowbit.moe.router import aux_loss

    cfg = RouterConfig(num_experts=E, topk=k, aux_loss=True)

    def router(x, gate):
        with kernels(impl):
            w, ex, (s, c) = route_tokens(cfg, x, gate)
        return jnp.sum(w) + aux_loss(s[None], c, k, 0.01)

    _, ex, _ = route_tokens(cfg, x, gate)
    plan = plan_dispatch(ex, E)
    w = jnp.full(ex.shape, 1.0 / k, jnp.float32)
    y = permute(x, plan)
    dy = jax.random.normal(jax.random.PRNGKey(5), y.shape, y.dtype)  # the cotangents
    dout = jax.random.normal(jax.random.PRNGKey(6), x.shape, x.dtype)

    def dispatch(x, ex, dy):
        return _fwd_bwd(lambda x: permute(x, plan_dispatch(ex, E, impl=impl), impl=impl), dy, x)

    def combine(y, w, dout):
        return _fwd_bwd(lambda y, w: unpermute(y, plan, w, impl=impl), dout, y, w)

    g = lambda f, n: jax.jit(jax.value_and_grad(f, argnums=n))  # noqa: E731
    return [
        ("router+aux", g(router, (0, 1)), (x, gate)),
        ("dispatch", jax.jit(dispatch), (x, ex, dy)),
        ("combine", jax.jit(combine), (y, w, dout)),
    ]


def _fwd_bwd(f, ct, *args):
    """f's output and its vjp at the cotangent ``ct`` (an array), as the layer has them: the
    output materialized (a jit result, as the GEMM that reads it needs), the cotangent an array
    (the GEMM's dgrad). A scalar loss would let XLA fuse its gathers into the loss's sum and
    the constant ones cotangent into the backward gather, which a custom call cannot."""
    out, vjp = jax.vjp(f, *args)
    return out, vjp(ct)


def weight_bytes(case, E, H, F) -> float:
    if case in moe_update.CASES:
        return moe_update.weight_bytes(case, E, H, F)
    n = E * 3 * H * F  # wi (H, 2F) and wo (F, H) per expert
    if recipe_free(case):
        return n * (2 + 2 + 2)  # fprop read, dgrad read, dW write (bf16)
    if "primary" in case and not case.endswith("refresh"):
        return n * (1 + 1 + 2)  # the two FP8 copies read, dW write
    return n * (2 + 1 + 1 + 1 + 1 + 2)  # cast: read bf16, write both copies; GEMMs read them; dW


def _selected(names, env: str):
    """``names`` narrowed to the ';'-separated ones in the environment variable ``env`` (all when
    it is unset); ``lowbit bf16`` always stays (every row's vs_bf16 is against it), and
    ``lowbit bf16 + adamw`` with any ``+ adamw`` case (theirs is against it)."""
    want = env_names(env, names, "moe")
    keep = {"lowbit bf16"} | ({moe_update.BASE} if set(want) & set(moe_update.CASES) else set())
    return [n for n in names if not want or n in want or n in keep]


def _operands(T, H, E, F):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (T, H), jnp.bfloat16)
    gate = (jax.random.normal(keys[1], (H, E), jnp.float32) * 0.02).astype(jnp.bfloat16)
    wi = (jax.random.normal(keys[2], (E, H, 2 * F), jnp.float32) * 0.02).astype(jnp.bfloat16)
    wo = (jax.random.normal(keys[3], (E, F, H), jnp.float32) * 0.02).astype(jnp.bfloat16)
    return x, gate, wi, wo


def build_case(label: str):
    """``(fn, args)`` of the row named ``label`` ("<shape> <case>", e.g. "G64 deepseek fp8
    delayed"): the step ``python -m lowbit.bench.profile moe LABEL`` traces."""
    for name, T, H, E, F, k in GPU_SHAPES + CPU_SHAPES:
        case = label[len(name) + 1 :] if label.startswith(name + " ") else None
        if case in CASES:
            return _fn_args(case, k, *_operands(T, H, E, F))[:2]
    shapes = ", ".join(s[0] for s in GPU_SHAPES + CPU_SHAPES)
    raise ValueError(
        f"moe case must be '<shape> <case>' with a shape of {shapes} and a case of {CASES}, got {label!r}"
    )


def _fn_args(case, k, x, gate, wi, wo):
    """(jitted step, its args, whether it runs FP8) of ``case``."""
    if case in moe_update.CASES:
        return (*moe_update.build(case, k, x, gate, wi, wo), "fp8" in case)
    fn, recipe = _step(case, k)
    return fn, (x, gate, wi, wo, *_extras(case, recipe, wi, wo)), recipe is not None


def run(small: bool, progress=None) -> list[dict]:
    """LOWBIT_MOE_CASES / LOWBIT_MOE_SHAPES (';'-separated case / shape names) run a subset."""
    rows = []
    iters = 2 if small else 10
    shapes = CPU_SHAPES if small else GPU_SHAPES
    picked = _selected([s[0] for s in shapes], "LOWBIT_MOE_SHAPES")
    for name, T, H, E, F, k in [s for s in shapes if s[0] in picked]:
        x, gate, wi, wo = _operands(T, H, E, F)
        flops = 3 * 2.0 * T * k * H * 3 * F
        base = None
        selected = _selected(CASES + moe_peers.CASES, "LOWBIT_MOE_CASES")
        for case in [c for c in selected if c in CASES]:
            fn, args, fp8 = _fn_args(case, k, x, gate, wi, wo)
            try:
                ms = time_fn(fn, *args, warmup=2, iters=iters, repeats=3)
            except jax.errors.JaxRuntimeError as e:  # XLA's ragged_dot at 64+ experts: out of memory
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                ms = float("nan")
            base = ms if case == "xla bf16" else base
            peak = PEAK["fp8" if fp8 else "bf16"]
            rows.append(
                {
                    "name": f"{name} {case}",
                    "shape": f"T={T} H={H} E={E} F={F} k={k}",
                    "case": case,
                    "ms": ms,
                    "TFLOPs": flops / (ms * 1e-3) / 1e12,
                    "vs_xla": base / ms if base is not None and base == base else float("nan"),
                    "floor_ms": flops / peak * 1e3,
                    "weight_GB": weight_bytes(case, E, H, F) / 1e9,
                    "weights": weights_source(case),
                }
            )
            if progress:
                progress()
            del fn, args
        te_cases = [c for c in selected if c in moe_peers.CASES]
        for r in moe_peers.rows(name, (T, H, E, F, k), (x, gate, wi, wo), te_cases, iters, progress):
            like = "lowbit bf16" if r["case"].endswith("none") else "fp8 delayed"  # its casts in step
            r["floor_ms"] = flops / PEAK["bf16" if like == "lowbit bf16" else "fp8"] * 1e3
            rows.append(dict(r, weight_GB=weight_bytes(like, E, H, F) / 1e9))
        for impl in PIECE_IMPLS:
            for piece, fn, args in _pieces(x, gate, E, k, impl):
                ms = time_fn(fn, *args, warmup=2, iters=iters, repeats=3)
                shape, case = f"T={T} H={H} E={E} F={F} k={k}", f"pieces {piece} {impl}"
                rows.append({"name": f"{name} {case}", "shape": shape, "case": case, "ms": ms})
                if progress:
                    progress()
    for r in rows:  # against lowbit's own BF16 block, the goal
        base = moe_update.BASE if r["case"] in moe_update.CASES else "lowbit bf16"
        bf = next(b for b in rows if b["shape"] == r["shape"] and b["case"] == base)
        r["vs_bf16"] = None if r["case"].startswith("pieces") else bf["ms"] / r["ms"]
        for key in ("TFLOPs", "vs_xla", "floor_ms", "weight_GB", "weights", "note"):
            r.setdefault(key, None)
    return rows


def count(small: bool) -> int:
    shapes = _selected([s[0] for s in (CPU_SHAPES if small else GPU_SHAPES)], "LOWBIT_MOE_SHAPES")
    cases = _selected(CASES + moe_peers.CASES, "LOWBIT_MOE_CASES")
    te_cases = [c for c in cases if c in moe_peers.CASES]
    return len(shapes) * (len(cases) - len(te_cases) + 3 * len(PIECE_IMPLS) + moe_peers.count(te_cases))
