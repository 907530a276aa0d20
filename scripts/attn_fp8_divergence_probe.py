"""FP8 attention on the real activations of a convergence run (issue 26): cuDNN against the
emulation, each against float64, layer by layer.

    python3 scripts/attn_fp8_divergence_probe.py CKPT.npz [CKPT.npz ...] [--state warm]

CKPT: a checkpoint of ``examples/convergence.py --save-at S --save-dir DIR`` (dense model, any
size; the parameters and DelayedScaling state after S steps and the batch step S trains on). For
each checkpoint:

1. Capture. The model's forward and backward on the saved batch with BF16 attention (lowbit's
   DotProductAttention, no fp8_dpa; the GEMMs under the run's recipe and state): every layer's
   attention inputs q, k, v and the cotangent dO its output receives from the training loss
   (the attention calls are intercepted; dO is the gradient of a zero added to each output).
2. Per layer, FP8 attention (``lowbit.ops.attention.fp8``: the op's own forward and backward
   steps, so the scales and the amaxes each kernel reports come out too) with implementation
   "cudnn" (where it can run; else skipped with the reason) and "emulate", under DelayedScaling
   (the checkpoint's state of that layer's attention, or ``--state warm``: two steps of the same
   implementation on these tensors from a fresh state) and under Float8CurrentScaling.
3. Against float64 attention of the same q, k, v, dO, per row:
   ``err``  relative error (Frobenius) of o, dq, dk, dv;
   ``cos``  cosine of dq, dk, dv with float64's (a bias shows there when the norm does not) and
   ``nrm``  their norm over float64's;
   ``uf``   fraction of the entries (float64 value nonzero) that are zero or subnormal in FP8:
            dq, dk, dv as the kernel wrote them; dS from float64's dS quantized with this
            implementation's dp scale (cuDNN quantizes scale * dS, the emulation dS), the FP8 dS
            itself never leaves the kernel; ``z``: the part flushed to zero;
   ``amax`` what the op reports for s, o, dp, dq, dk, dv (cuDNN's dp is amax(dS) * scale), with
            float64's (P, o, dS, dq, dk, dv) on the layer's first line;
   ``hr``   headroom in binades: log2(fp8 max / (scale x float64 amax)) of dp, dq, dk, dv (0:
            the largest entry at the format's max; negative: saturated).
   Then one summary line per recipe and implementation.

The checkpoint's DelayedScaling state was written by one implementation (``attention`` in its
meta). cuDNN's dp history holds amax(dS) * scale, the emulation's amax(dS), so the other
implementation runs with the dp scale converted (x scale to the emulation, / scale to cuDNN);
``--raw-dp`` keeps it as stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import lowbit
from lowbit.flax import OVERWRITE_WITH_GRADIENT, SR_RNG, DotProductAttention
from lowbit.ops.attention import fp8
from lowbit.ops.attention import fp8_scales as fs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = ("cudnn", "emulate")
GRADS = ("dq", "dk", "dv")


def convergence():
    """examples/convergence.py as a module (its model, recipes and checkpoint reader)."""
    if "convergence" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "convergence", os.path.join(REPO, "examples", "convergence.py")
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules["convergence"]


# --- 1. capture --------------------------------------------------------------------------------
def capture(variables: dict, batch: np.ndarray, meta: dict):
    """([(q, k, v), ...], [dO, ...], loss): every layer's attention inputs and output cotangent
    under the training loss, BF16 attention, the GEMMs under the run's recipe."""
    cfg = dataclasses.replace(meta["config"], lowbit_attention=True, fp8_attention=False)
    if cfg.moe_experts:
        raise ValueError("the probe takes the dense model's checkpoints (moe_experts=0)")
    recipe = convergence().RECIPES[meta["recipe"]]()
    if getattr(recipe, "fp8_dpa", False):
        recipe = dataclasses.replace(recipe, fp8_dpa=False)
    shape = (cfg.batch, cfg.seq, cfg.n_heads, cfg.d_model // cfg.n_heads)
    zeros = [jnp.zeros(shape, jnp.bfloat16) for _ in range(cfg.n_layers)]
    dos, (qkv, loss) = _capture_fn(cfg, recipe)(zeros, variables, jnp.asarray(batch))
    if len(qkv) != cfg.n_layers:
        raise RuntimeError(f"captured {len(qkv)} attention calls, the model has {cfg.n_layers} layers")
    return qkv, dos, float(loss)


@functools.cache
def _capture_fn(cfg, recipe):
    """The jitted gradient of the training loss in zeros added to the attention outputs (one
    compile per model and recipe, shared by the checkpoints)."""
    conv = convergence()
    model = conv.ByteLM(cfg, recipe)

    def loss_fn(deltas, variables, batch):
        seen = []

        def spy(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if isinstance(context.module, DotProductAttention) and context.method_name == "__call__":
                seen.append(tuple(args[:3]))
                out = out + deltas[len(seen) - 1]  # + 0: its cotangent is the output's
            return out

        with lowbit.autocast(recipe=recipe, enabled=recipe is not None), nn.intercept_methods(spy):
            logits, aux = model.apply(variables, batch[:, :-1], rngs={SR_RNG: jax.random.PRNGKey(0)})
        loss = conv.xent(logits, batch[:, 1:])
        return loss + aux, (seen, loss)  # the training loss's gradient, as the run's step

    return jax.jit(jax.grad(loss_fn, has_aux=True))


# --- 2. FP8 attention, the op's own steps --------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("recipe", "impl"))
def fp8_step(q, k, v, do, state, *, recipe, impl):
    """The FP8 op's forward and backward (as its custom_vjp runs them) with what it does not
    return: ({o, dq, dk, dv} float32, {role: amax}, {role: scale used}, next state or None)."""
    cfg = fp8.config(
        q, k, recipe=recipe, causal=True, scale=None, dropout_rate=0.0, rng=None, implementation=impl
    )
    state = fs.check_state(recipe, state)
    # k and v centered and v's mean added back as the op does (their vjps give the gradients
    # the centering's part)
    (k, v, v_mean), centering = jax.vjp(lambda k, v: fp8._centered(k, v, cfg.rate), k, v)
    o, (res, sc, a, _, _) = fp8._fp8_fwd(cfg, q, k, v, state, None)
    o, uncentering = jax.vjp(fp8._uncentered, o, v_mean)
    do, d_mean = uncentering(do.astype(o.dtype))
    a = a | {"do": fs.amax(do)}
    sc = fp8._bwd_scales(cfg, sc, a, a["do"], res[0].shape)
    (dq, dk, dv), a_bwd = (fp8._cudnn_bwd if cfg.cudnn else fp8._emulate_bwd)(cfg, res, sc, do, None)
    dk, dv = centering((dk.astype(k.dtype), dv.astype(v.dtype), d_mean))
    amaxes = a | a_bwd
    nxt = fs.step_state(recipe, state, amaxes) if cfg.delayed else None
    f32 = jnp.float32
    return dict(o=o.astype(f32), dq=dq.astype(f32), dk=dk.astype(f32), dv=dv.astype(f32)), amaxes, sc, nxt


def layer_state(variables: dict, layer: int):
    """The checkpoint's DelayedScaling state of layer ``layer``'s attention, or None."""
    attn = variables.get(OVERWRITE_WITH_GRADIENT, {}).get(f"block{layer}", {}).get("attn")
    return None if attn is None else {k: jnp.asarray(attn[k]) for k in fs.STATE_KEYS}


def convert_dp(state: dict, scale: float, origin: str, impl: str) -> dict:
    """``state`` with its dp scale moved from ``origin``'s convention to ``impl``'s (cuDNN's dp
    amax is amax(dS) * scale)."""
    if origin not in IMPLS or origin == impl:
        return state
    factor = scale if impl == "emulate" else 1.0 / scale
    return state | {"dp_scale": state["dp_scale"] * jnp.float32(factor)}


def warm_state(recipe, q, k, v, do, impl):
    state = fs.init_state(recipe)
    for _ in range(2):
        state = fp8_step(q, k, v, do, state, recipe=recipe, impl=impl)[3]
    return state


# --- 3. float64 and the comparison (jitted under jax.enable_x64: on the GPU where there is one) ---
@jax.jit
def _reference(q, k, v, do, scale):
    q, k, v, do = (x.astype(jnp.float64) for x in (q, k, v, do))
    sq = q.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((sq, sq), bool)), s, -jnp.inf), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    rows = jnp.sum(do * o, axis=-1).transpose(0, 2, 1)[..., None]  # D = rowsum(dO o), (b, h, sq, 1)
    ds = p * (jnp.einsum("bqhd,bkhd->bhqk", do, v) - rows)
    return dict(
        o=o,
        dq=scale * jnp.einsum("bhqk,bkhd->bqhd", ds, k),
        dk=scale * jnp.einsum("bhqk,bqhd->bkhd", ds, q),
        dv=jnp.einsum("bhqk,bqhd->bkhd", p, do),
        ds=ds,
        p=p,
    )


def reference(q, k, v, do, scale: float) -> dict:
    """Causal attention and its backward in float64: o, dq, dk, dv (b, s, h, d), and dS, P
    (b, h, sq, sk)."""
    with jax.enable_x64(True):
        return _reference(q, k, v, do, jnp.float64(scale))


def _small(codes, live, tiny, step):
    """(zero or subnormal, zero) fractions of FP8 ``codes`` (FP8 values, or values about to be
    rounded to FP8) over the ``live`` entries: round to nearest puts below ``tiny - step / 2`` on
    a subnormal or zero and below ``step / 2`` on zero (``tiny``: the smallest normal, ``step``:
    the subnormals' spacing)."""
    n = jnp.maximum(jnp.sum(live), 1)
    mag = jnp.abs(codes)
    return jnp.sum((mag < tiny - step / 2) & live) / n, jnp.sum((mag < step / 2) & live) / n


@jax.jit
def _metrics(out, sc, ref, ds_factor, top, tiny, step):
    row = {}
    for r in ("o",) + GRADS:
        x, y = out[r].astype(jnp.float64), ref[r]
        nx, ny = jnp.linalg.norm(x), jnp.linalg.norm(y)
        row[f"err_{r}"] = jnp.linalg.norm(x - y) / ny
        if r != "o":
            row[f"cos_{r}"] = jnp.vdot(x, y) / (nx * ny)
            row[f"nrm_{r}"] = nx / ny
            row[f"uf_{r}"], row[f"z_{r}"] = _small(x * sc[r], y != 0, tiny, step)
    # The FP8 dS never leaves the kernel: float64's dS as this implementation quantizes it
    # (cuDNN: scale * dS with the dp scale, the emulation dS).
    dp = ref["ds"] * ds_factor
    row["uf_ds"], row["z_ds"] = _small(dp * sc["dp"], ref["ds"] != 0, tiny, step)
    for r, a in (("dp", jnp.max(jnp.abs(dp))),) + tuple((g, jnp.max(jnp.abs(ref[g]))) for g in GRADS):
        row[f"hr_{r}"] = jnp.where(a > 0, jnp.log2(top / (sc[r] * a)), jnp.nan)
    return row


def compare(out: dict, amaxes: dict, sc: dict, ref: dict, recipe, impl: str, scale: float) -> dict:
    """One row: errors, cosines, norms, underflow, amaxes and headroom against float64."""
    _, bwd = fs.dtypes(recipe)
    info = jnp.finfo(bwd)
    tiny = float(info.smallest_normal)
    sc = {r: jnp.asarray(sc[r], jnp.float32) for r in ("dp",) + GRADS}
    with jax.enable_x64(True):
        factor, top = (jnp.float64(x) for x in (scale if impl == "cudnn" else 1.0, fs.fmax(bwd)))
        row = _metrics(
            out, sc, ref, factor, top, jnp.float64(tiny), jnp.float64(tiny * 2.0 ** -int(info.nmant))
        )
        row = {k: float(v) for k, v in jax.device_get(row).items()}
    return row | {f"amax_{r}": float(amaxes[r]) for r in ("s", "o", "dp") + GRADS}


def ref_amaxes(ref: dict) -> dict:
    """float64's amaxes, and the mean probability on key 0 (an attention sink shows there)."""
    roles = (("P", "p"), ("o", "o"), ("dS", "ds"), *((g, g) for g in GRADS))
    with jax.enable_x64(True):
        out = {r: float(jnp.max(jnp.abs(ref[k]))) for r, k in roles}
        return out | {"P[:,0]": float(jnp.mean(ref["p"][..., 0]))}


def _fmt(row: dict, keys, prefix: str, spec: str) -> str:
    return f"{prefix} " + " ".join(f"{k} {row[f'{prefix}_{k}']:{spec}}" for k in keys)


def print_row(name: str, row: dict, log=print) -> None:
    log(
        f"  {name:16s} {_fmt(row, ('o',) + GRADS, 'err', '.4f')} | {_fmt(row, GRADS, 'cos', '.5f')} | "
        f"{_fmt(row, GRADS, 'nrm', '.4f')}"
    )
    log(
        f"  {'':16s} {_fmt(row, GRADS + ('ds',), 'uf', '.2e')} | {_fmt(row, GRADS + ('ds',), 'z', '.2e')} | "
        f"{_fmt(row, ('s', 'o', 'dp') + GRADS, 'amax', '.3g')} | {_fmt(row, ('dp',) + GRADS, 'hr', '.1f')}"
    )


SUMMARY_MEAN = tuple(f"err_{r}" for r in ("o",) + GRADS)
SUMMARY_MIN = tuple(f"cos_{r}" for r in GRADS)
SUMMARY_MAX = tuple(f"{m}_{r}" for m in ("uf", "z") for r in GRADS + ("ds",))


def summary(rows: list[dict]) -> dict:
    """Mean errors, least cosines, most underflow over the layers."""
    out = {k: float(np.mean([r[k] for r in rows])) for k in SUMMARY_MEAN}
    out |= {k: min(r[k] for r in rows) for k in SUMMARY_MIN}
    return out | {k: max(r[k] for r in rows) for k in SUMMARY_MAX}


# --- the probe -----------------------------------------------------------------------------------
def probe(path: str, state_mode: str = "checkpoint", raw_dp: bool = False, log=print) -> list[dict]:
    """Rows {checkpoint, layer, recipe, impl, err_*, cos_*, ...} of one checkpoint."""
    conv = convergence()
    variables, batch, meta = conv.load_checkpoint(path)
    origin = meta.get("attention", "bf16")
    qkv, dos, loss = capture(variables, batch, meta)
    name = os.path.basename(path)
    log(f"{name}: {meta['recipe']} seed {meta['seed']} step {meta['step']}, attention {origin}")
    log(f"  captured loss {loss:.4f} (BF16 attention), {len(qkv)} layers, q {qkv[0][0].shape}")
    run_recipe = conv.RECIPES[meta["recipe"]]()  # its history length fits the stored state
    delayed = run_recipe if isinstance(run_recipe, lowbit.DelayedScaling) else lowbit.DelayedScaling()
    recipes = {
        "delayed": dataclasses.replace(delayed, fp8_dpa=True),
        "current": lowbit.Float8CurrentScaling(fp8_dpa=True),
    }
    skip = fp8.cudnn_fp8_available(qkv[0][0], qkv[0][1])
    if skip is not None:
        log(f"  cudnn rows skipped: {skip}")
    impls = [i for i in IMPLS if i != "cudnn" or skip is None]
    rows = []
    for layer, ((q, k, v), do) in enumerate(zip(qkv, dos)):
        scale = 1.0 / float(np.sqrt(q.shape[-1]))
        ref = reference(q, k, v, do, scale)
        ra = ref_amaxes(ref)
        log(
            f" layer {layer}: amax "
            + " ".join(f"{n} {float(fs.amax(x)):.3g}" for n, x in zip(("q", "k", "v", "dO"), (q, k, v, do)))
            + "; float64 "
            + " ".join(f"{r} {a:.3g}" for r, a in ra.items())
        )
        for rname, recipe in recipes.items():
            for impl in impls:
                state = None
                if rname == "delayed":
                    stored = layer_state(variables, layer)
                    if stored is None or state_mode == "warm":
                        state = warm_state(recipe, q, k, v, do, impl)
                    else:
                        state = stored if raw_dp else convert_dp(stored, scale, origin, impl)
                out, amaxes, sc, _ = fp8_step(q, k, v, do, state, recipe=recipe, impl=impl)
                row = compare(out, amaxes, sc, ref, recipe, impl, scale)
                print_row(f"{rname} {impl}", row, log)
                rows.append(dict(checkpoint=path, layer=layer, recipe=rname, impl=impl, **row))
    for rname in recipes:
        for impl in impls:
            s = summary([r for r in rows if (r["recipe"], r["impl"]) == (rname, impl)])
            log(
                f" summary {rname} {impl}: mean err "
                + " ".join(f"{k[4:]} {s[k]:.4f}" for k in SUMMARY_MEAN)
                + " | min cos "
                + " ".join(f"{k[4:]} {s[k]:.5f}" for k in SUMMARY_MIN)
                + " | max uf "
                + " ".join(f"{k[3:]} {s[k]:.2e}" for k in SUMMARY_MAX if k.startswith("uf"))
            )
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="+", metavar="CKPT", help="examples/convergence.py --save-at files")
    p.add_argument(
        "--state",
        choices=("checkpoint", "warm"),
        default="checkpoint",
        help="DelayedScaling rows: the checkpoint's state, or two steps on these tensors from a fresh one",
    )
    p.add_argument("--raw-dp", action="store_true", help="keep the stored dp scale across implementations")
    a = p.parse_args(argv)
    for path in a.checkpoints:
        if not os.path.isfile(path):
            p.error(f"checkpoint {path!r} does not exist")
    rows = []
    for path in a.checkpoints:
        rows += probe(path, a.state, a.raw_dp)
    return rows


if __name__ == "__main__":
    main()
