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
    conv = convergence()
    cfg = dataclasses.replace(meta["config"], lowbit_attention=True, fp8_attention=False)
    if cfg.moe_experts:
        raise ValueError("the probe takes the dense model's checkpoints (moe_experts=0)")
    recipe = conv.RECIPES[meta["recipe"]]()
    if getattr(recipe, "fp8_dpa", False):
        recipe = dataclasses.replace(recipe, fp8_dpa=False)
    model = conv.ByteLM(cfg, recipe)
    tokens, targets = jnp.asarray(batch[:, :-1]), jnp.asarray(batch[:, 1:])
    shape = (cfg.batch, cfg.seq, cfg.n_heads, cfg.d_model // cfg.n_heads)
    zeros = [jnp.zeros(shape, jnp.bfloat16) for _ in range(cfg.n_layers)]

    def loss_fn(deltas):
        seen = []

        def spy(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if isinstance(context.module, DotProductAttention) and context.method_name == "__call__":
                seen.append(tuple(args[:3]))
                out = out + deltas[len(seen) - 1]  # + 0: its cotangent is the output's
            return out

        with lowbit.autocast(recipe=recipe, enabled=recipe is not None), nn.intercept_methods(spy):
            logits, aux = model.apply(variables, tokens, rngs={SR_RNG: jax.random.PRNGKey(0)})
        loss = conv.xent(logits, targets)
        return loss + aux, (seen, loss)  # the training loss's gradient, as the run's step

    dos, (qkv, loss) = jax.jit(jax.grad(loss_fn, has_aux=True))(zeros)
    if len(qkv) != cfg.n_layers:
        raise RuntimeError(f"captured {len(qkv)} attention calls, the model has {cfg.n_layers} layers")
    return qkv, dos, float(loss)


# --- 2. FP8 attention, the op's own steps --------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("recipe", "impl"))
def fp8_step(q, k, v, do, state, *, recipe, impl):
    """The FP8 op's forward and backward (as its custom_vjp runs them) with what it does not
    return: ({o, dq, dk, dv} float32, {role: amax}, {role: scale used}, next state or None)."""
    cfg = fp8.config(
        q, k, recipe=recipe, causal=True, scale=None, dropout_rate=0.0, rng=None, implementation=impl
    )
    state = fs.check_state(recipe, state)
    o, (res, sc, a, _, _) = fp8._fp8_fwd(cfg, q, k, v, state, None)
    a = a | {"do": fs.amax(do)}
    sc = fp8._bwd_scales(cfg, sc, a, a["do"], res[0].shape)
    (dq, dk, dv), a_bwd = (fp8._cudnn_bwd if cfg.cudnn else fp8._emulate_bwd)(cfg, res, sc, do, None)
    amaxes = a | a_bwd
    nxt = fs.step_state(recipe, state, amaxes) if cfg.delayed else None
    return dict(o=o.astype(jnp.float32), dq=dq, dk=dk, dv=dv), amaxes, sc, nxt


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


# --- 3. float64 and the comparison ---------------------------------------------------------------
def reference(q, k, v, do, scale: float) -> dict:
    """Causal attention and its backward in float64 (numpy), (b, s, h, d) in and out; ds and p
    (b, h, sq, sk)."""
    q, k, v, do = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, do))
    s = scale * (q @ k.transpose(0, 1, 3, 2))
    s[..., np.triu(np.ones(s.shape[-2:], bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    ds = p * (do @ v.transpose(0, 1, 3, 2) - (do * o).sum(-1, keepdims=True))
    out = dict(
        o=o, dq=scale * (ds @ k), dk=scale * (ds.transpose(0, 1, 3, 2) @ q), dv=p.transpose(0, 1, 3, 2) @ do
    )
    return {r: x.transpose(0, 2, 1, 3) for r, x in out.items()} | {"ds": ds, "p": p}


def _fp8_small(codes, ref, tiny):
    """(zero or subnormal, zero) fractions of ``codes`` over the entries where ``ref`` != 0."""
    live = ref != 0
    n = max(int(live.sum()), 1)
    mag = np.abs(codes)
    return float(((mag < tiny) & live).sum() / n), float(((mag == 0) & live).sum() / n)


def compare(out: dict, amaxes: dict, sc: dict, ref: dict, recipe, impl: str, scale: float) -> dict:
    """One row: errors, cosines, norms, underflow, amaxes and headroom against float64."""
    _, bwd = fs.dtypes(recipe)
    tiny, top = float(jnp.finfo(bwd).smallest_normal), fs.fmax(bwd)
    row = {}
    for r in ("o",) + GRADS:
        x, y = np.asarray(out[r], np.float64), ref[r]
        row[f"err_{r}"] = float(np.linalg.norm(x - y) / np.linalg.norm(y))
        if r != "o":
            row[f"cos_{r}"] = float(np.vdot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y)))
            row[f"nrm_{r}"] = float(np.linalg.norm(x) / np.linalg.norm(y))
            row[f"uf_{r}"], row[f"z_{r}"] = _fp8_small(x * float(sc[r]), y, tiny)
    # The FP8 dS never leaves the kernel: float64's dS rounded to FP8 as this implementation
    # quantizes it (cuDNN: scale * dS with the dp scale).
    dp = ref["ds"] * (scale if impl == "cudnn" else 1.0)
    codes = np.clip(dp * float(sc["dp"]), -top, top).astype(jnp.dtype(bwd)).astype(np.float64)
    row["uf_ds"], row["z_ds"] = _fp8_small(codes, ref["ds"], tiny)
    row |= {f"amax_{r}": float(amaxes[r]) for r in ("s", "o", "dp") + GRADS}
    dp_ref = np.abs(dp).max()
    for r, a in (("dp", dp_ref),) + tuple((g, np.abs(ref[g]).max()) for g in GRADS):
        row[f"hr_{r}"] = float(np.log2(top / (float(sc[r]) * a))) if a > 0 else float("nan")
    return row


def ref_amaxes(ref: dict) -> dict:
    """float64's amaxes, and the mean probability on key 0 (an attention sink shows there)."""
    roles = (("P", "p"), ("o", "o"), ("dS", "ds"), *((g, g) for g in GRADS))
    return {r: float(np.abs(ref[k]).max()) for r, k in roles} | {"P[:,0]": float(ref["p"][..., 0].mean())}


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
