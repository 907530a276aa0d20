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


def state_errors():
    b, s, h, g, d = 2, 256, 4, 2, 128
    r = np.random.default_rng(0)
    shapes = ((b, s, h, d), (b, s, g, d), (b, s, g, d), (b, s, h, d))
    q, k, v, do = (jnp.asarray(r.standard_normal(x), jnp.bfloat16) for x in shapes)
    for causal in (False, True):
        rec = DelayedScaling(fp8_dpa=True, amax_history_len=4)
        st = fs.init_state(rec)
        ref = fused_attention(q, k, v, causal=causal, implementation="cudnn")
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
                nxt = vjp(do.astype(out.dtype))[3]
                err = float(
                    jnp.linalg.norm((out - ref).astype(jnp.float32))
                    / jnp.linalg.norm(ref.astype(jnp.float32))
                )
                am = {r_: float(nxt[f"{r_}_amax_history"][0]) for r_ in fs.ROLES}
                sc = {r_: float(st[f"{r_}_scale"][0]) for r_ in ("s", "o")}
                print(f"causal={causal} {impl} step {step}: err vs bf16 {err:.4f} amax {am} scales {sc}")
                st = nxt
    print("true amax o", float(jnp.max(jnp.abs(ref.astype(jnp.float32)))))


if __name__ == "__main__":
    if "--state" in sys.argv:
        state_errors()
    if "--profile" in sys.argv:
        profile()
