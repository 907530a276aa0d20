"""FP8 attention on the GPU: per-kernel times of BF16 vs FP8 cuDNN attention (fwd and fwd+bwd),
and the delayed-scaling state and errors per step against float64 (the non-causal failure of
tests/test_attention_fp8.py). python3 scripts/attn_fp8_probe.py [--profile] [--state]"""

import collections
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import DelayedScaling, Float8CurrentScaling
from lowbit.bench.common import time_fn
from lowbit.bench.profile import _gpu_events, _trace
from lowbit.ops.attention import fp8_scales as fs
from lowbit.ops.attention.fp8 import fp8_attention
from lowbit.ops.fused_attention import fused_attention


def _qkv(shape, seed=0):
    r = np.random.default_rng(seed)
    return [jnp.asarray(r.standard_normal(shape), jnp.bfloat16) for _ in range(4)]


def profile():
    b, s, h, d = 2, 4096, 32, 128
    q, k, v, do = _qkv((b, s, h, d))
    cur = Float8CurrentScaling(fp8_dpa=True)
    cases = {
        "bf16": lambda q, k, v: fused_attention(q, k, v, causal=True),
        "fp8 current": lambda q, k, v: fp8_attention(q, k, v, recipe=cur, causal=True),
    }
    for name, f in cases.items():
        fwd = jax.jit(f)
        both = jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
        print(f"{name}: fwd {time_fn(fwd, q, k, v):.3f} ms, fwd+bwd {time_fn(both, q, k, v, do):.3f} ms")
        with tempfile.TemporaryDirectory() as tmp:
            jax.block_until_ready(both(q, k, v, do))
            jax.profiler.start_trace(tmp)
            for _ in range(3):
                jax.block_until_ready(both(q, k, v, do))
            jax.profiler.stop_trace()
            ev = _gpu_events(_trace(tmp))
        tot = collections.Counter()
        for _, dur, nm, _ in ev:
            tot[nm[:110]] += dur / 3e6
        for nm, ms in tot.most_common(12):
            print(f"   {ms:8.3f} ms  {nm}")


def _rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def state_errors():
    """Per step of a DelayedScaling state, cuDNN against the emulation: the output's and the
    gradients' errors against BF16 cuDNN attention and every amax each reports (a disagreement
    in what an amax describes shows here), for diffuse (q x 1) and peaked (q x 4) logits."""
    b, s, h, g, d = 2, 256, 4, 2, 128
    r = np.random.default_rng(0)
    shapes = ((b, s, h, d), (b, s, g, d), (b, s, g, d), (b, s, h, d))
    q0, k, v, do = (jnp.asarray(r.standard_normal(x), jnp.bfloat16) for x in shapes)
    for causal, peak in ((False, 1.0), (True, 1.0), (True, 4.0)):
        q = (q0.astype(jnp.float32) * peak).astype(jnp.bfloat16)
        rec = DelayedScaling(fp8_dpa=True, amax_history_len=4)
        ref, ref_vjp = jax.vjp(
            lambda q, k, v: fused_attention(q, k, v, causal=causal, implementation="cudnn"), q, k, v
        )
        ref_g = ref_vjp(do)
        for impl in ("cudnn", "emulate"):
            st = fs.init_state(rec)
            for step in range(3):
                out, vjp = jax.vjp(
                    lambda q, k, v, st: fp8_attention(
                        q, k, v, recipe=rec, state=st, causal=causal, implementation=impl
                    ),
                    q,
                    k,
                    v,
                    st,
                )
                dq, dk, dv, nxt = vjp(do.astype(out.dtype))
                errs = " ".join(
                    f"{n} {_rel(x, y):.4f}"
                    for n, x, y in zip(("o", "dq", "dk", "dv"), (out, dq, dk, dv), (ref, *ref_g))
                )
                am = " ".join(f"{r_} {float(nxt[f'{r_}_amax_history'][0]):.4g}" for r_ in fs.ROLES)
                print(f"causal={causal} q x{peak:g} {impl:7s} step {step}: err vs bf16 {errs} | amax {am}")
                st = nxt


if __name__ == "__main__":
    if "--state" in sys.argv:
        state_errors()
    if "--profile" in sys.argv:
        profile()
