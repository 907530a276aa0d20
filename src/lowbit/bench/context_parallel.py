"""Context parallelism: causal attention forward+backward with the sequence split over every
device (issue 26's goal: 4 GPUs, batch 1, 32 heads x 128, seq 32k >= 3x one GPU; seq 128k runs
where one GPU runs out of memory). The ``cp`` stage of ``python -m lowbit.bench multi_device``.

Rows: one device at 32k (lowbit's cuDNN handler, :func:`lowbit.ops.fused_attention.fused_attention`),
context parallelism (:func:`lowbit.ops.attention.context_parallel_fused.fused_context_parallel`,
cuDNN per block) all-gather and ring with DualChunkSwap load balancing and the ring without it
at 32k (``scaling`` = one device's ms / this row's ms), the ring at 128k, and one device at 128k
twice: the fused handler and the unfused jnp attention (its scores alone are 2 TB), each
recorded as "OOM" where XLA reports resource exhaustion. The inputs arrive split (and, load
balanced, reordered): a training step reorders its tokens once, outside attention.

``tflops``: the causal attention's FLOPs (``4 b h s^2 d / 2`` forward, 2.5x that forward+backward)
per second over all devices; ``rel_diff``: the largest relative norm difference of dQ/dK/dV
against the one-device row (32k only); ``temp_GB``: XLA's scratch per device for the step;
``impl``: the implementation :func:`lowbit.ops.attention.attention` picks for this spec (a
DotProductAttention with ``context_parallel_axis`` takes that route). ``--small`` (the default
without a GPU) runs the same rows at small shapes on the jnp block kernels.
"""

from __future__ import annotations

import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lowbit.bench.common import on_gpu, time_fn
from lowbit.ops.attention import ReorderStrategy, make_spec, pick_implementation
from lowbit.ops.attention.context_parallel import load_balance_order
from lowbit.ops.attention.context_parallel_fused import fused_context_parallel
from lowbit.ops.fused_attention import fused_attention

# heads, head_dim, the 32k sequence, the 128k one
SHAPES = {False: (32, 128, 32768, 131072), True: (4, 16, 64, 256)}
COLUMNS = ("case", "devices", "seq", "ms", "scaling", "goal", "tflops", "rel_diff", "temp_GB", "impl")


def causal_flops(b, h, s, d, fwd_bwd: bool = True) -> float:
    """Causal attention's matmul FLOPs: QK^T and PV over half the scores, x2.5 with the backward."""
    return 4.0 * b * h * s * s * d / 2 * (2.5 if fwd_bwd else 1.0)


def is_oom(err: BaseException) -> bool:
    msg = str(err)
    return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()


def _grad_step(f):
    def loss(q, k, v, dy):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _inputs(s, h, d, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return [jax.random.normal(kk, (1, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys]


def _measure(step, args, iters, quick):
    """(ms, scratch GB per device, the compiled step) of the jitted step (compiled once, XLA's
    memory analysis read from it), or ("OOM", None, None) where the device runs out of memory."""
    try:
        compiled = step.lower(*args).compile()
        mem = compiled.memory_analysis()
        temp = None if mem is None else mem.temp_size_in_bytes / 2**30
        ms = time_fn(compiled, *args, warmup=1, iters=1 if quick else iters, repeats=1 if quick else 3)
        return ms, temp, compiled
    except Exception as e:  # noqa: BLE001 - XlaRuntimeError / ValueError at compile or run
        if is_oom(e):
            return "OOM", None, None
        return f"error: {type(e).__name__}: {str(e)[:200]}", None, None  # a row, not a crashed stage


def _host(grads, order=None):
    out = [np.asarray(g, np.float32) for g in grads]
    return [g[:, np.argsort(order)] for g in out] if order is not None else out


def _rel(got, ref):
    return max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) for a, b in zip(got, ref))


def cp_rows(small: bool, quick: bool = False, progress=print) -> list[dict]:
    h, d, s, s_long = SHAPES[small]
    n = len(jax.devices())
    gpu = on_gpu()
    kernels = "cudnn" if gpu else "reference"
    mesh = Mesh(np.array(jax.devices()), ("cp",))
    split = NamedSharding(mesh, P(None, "cp"))
    rows: list[dict] = []
    base = {}

    def add(case, devices, seq, ms, temp, impl="", rel=None, goal=""):
        ref = base.get(seq)
        scaling = ref / ms if isinstance(ms, float) and isinstance(ref, float) else None
        tflops = causal_flops(1, h, seq, d) / (ms * 1e9) if isinstance(ms, float) else None
        row = dict(case=case, devices=devices, seq=seq, ms=ms, scaling=scaling, goal=goal, tflops=tflops,
                   rel_diff=rel, temp_GB=temp, impl=impl)  # fmt: skip
        rows.append(row)
        progress(f"cp row: {row}")
        return row

    # one device, 32k: the baseline (and the gradients the CP rows are compared with)
    t0 = time.perf_counter()
    args = _inputs(s, h, d)
    one = _grad_step(lambda q, k, v: fused_attention(q, k, v, causal=True))
    ms, temp, compiled = _measure(one, args, 5, quick)
    base[s] = ms
    ref = _host(compiled(*args)) if compiled is not None else None
    add("one device", 1, s, ms, temp, "cudnn handler" if gpu else "reference")

    cases = [("all_gather", True), ("ring", True), ("ring", False)]
    for strategy, balanced in cases[:2] if quick else cases:
        order = load_balance_order(ReorderStrategy.DualChunkSwap, n, s) if balanced else None
        host = [np.asarray(a) for a in args]
        cp_args = [jax.device_put(a[:, order] if balanced else a, split) for a in host]
        step, impl = _cp_step(mesh, strategy, balanced, kernels, cp_args[0])
        with jax.set_mesh(mesh):
            ms, temp, compiled = _measure(step, cp_args, 5, quick)
            rel = (
                _rel(_host(compiled(*cp_args), order), ref)
                if ref is not None and compiled is not None
                else None
            )
        name = f"cp {strategy}" + (" load balanced" if balanced else "")
        add(name, n, s, ms, temp, impl, rel, ">= 3" if n == 4 and balanced else "")
        del cp_args
    del args, ref
    gc.collect()
    progress(f"cp stage: the seq {s} rows in {time.perf_counter() - t0:.1f} s")

    # 128k: one device (fused, then unfused), then the ring over every device
    args = _inputs(s_long, h, d, seed=1)
    unfused = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")  # noqa: E731
    fused = lambda q, k, v: fused_attention(q, k, v, causal=True)  # noqa: E731
    for name, f in (("one device", fused), ("one device unfused", unfused)):
        ms, temp, _ = _measure(_grad_step(f), args, 2, quick)
        base.setdefault(s_long, ms)
        label = "xla (unfused)" if f is unfused else "cudnn handler" if gpu else "reference"
        add(name, 1, s_long, ms, temp, label, goal="OOM" if f is unfused else "")
        gc.collect()
    order = load_balance_order(ReorderStrategy.DualChunkSwap, n, s_long)
    cp_args = [jax.device_put(np.asarray(a)[:, order], split) for a in args]
    del args
    step, impl = _cp_step(mesh, "ring", True, kernels, cp_args[0])
    with jax.set_mesh(mesh):
        ms, temp, _ = _measure(step, cp_args, 2, quick)
    add("cp ring load balanced", n, s_long, ms, temp, impl, goal="runs")
    return rows


def _cp_step(mesh, strategy, balanced, kernels, q):
    """The jitted fwd+bwd of the CP attention under ``mesh``, and the implementation the
    dispatch picks for the same spec."""
    f = lambda q, k, v: fused_context_parallel(  # noqa: E731
        q, k, v, axis="cp", strategy=strategy, causal=True, load_balanced=balanced, kernels=kernels
    )
    with jax.set_mesh(mesh):
        kw = dict(context_parallel_strategy=strategy, context_parallel_load_balanced=balanced)
        spec = make_spec(
            q, q, q, scale=q.shape[-1] ** -0.5, mask_type="causal", context_parallel_axis="cp", **kw
        )
        impl = pick_implementation(spec)
    return _grad_step(f), impl


__all__ = ["COLUMNS", "causal_flops", "cp_rows", "is_oom"]
