"""A small mixture-of-experts MLP trained BF16 vs FP8 with lowbit's grouped GEMM.

    python examples/moe.py            # GPU size: 8192 tokens, d=1024, ffn=2048, 8 experts, top-2
    python examples/moe.py --small    # CPU size, a few seconds a recipe

The layer: router (top-k of a softmax), permute (tokens sorted by expert, group sizes by bincount,
all inside jit), grouped fc1, GELU, grouped fc2, unpermute (weighted sum of each token's k expert
outputs). The grouped GEMMs are lowbit.flax.make_ragged_dot_cls(recipe) modules standing where
a model would call jax.lax.ragged_dot. The task: fit a fixed random teacher MLP on fresh inputs
each step. Each recipe trains from the same initialization; the losses should track each other.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import lowbit
from lowbit.flax.ragged_dot import OVERWRITE_WITH_GRADIENT, make_ragged_dot_cls


class MoeMlp(nn.Module):
    d_model: int
    d_ff: int
    experts: int
    top_k: int
    ragged_dot_cls: Any  # None: jax.lax.ragged_dot

    def _ragged(self, name, x, w, sizes):
        if self.ragged_dot_cls is None:
            return jax.lax.ragged_dot(x, w, sizes)
        return self.ragged_dot_cls(name=name)(x, w, sizes)

    @nn.compact
    def __call__(self, x):
        T, d = x.shape
        E, k = self.experts, self.top_k
        # Router: top-k experts per token, weights renormalised over the chosen k.
        logits = nn.Dense(E, use_bias=False, name="router")(x.astype(jnp.float32))
        probs = jax.nn.softmax(logits, axis=-1)
        weight, expert = jax.lax.top_k(probs, k)
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
        # Permute: the T*k (token, expert) pairs sorted by expert; group sizes on the device.
        flat_expert = expert.reshape(-1)
        order = jnp.argsort(flat_expert)
        token = order // k
        sizes = jnp.bincount(flat_expert, length=E).astype(jnp.int32)
        xs = x[token].astype(jnp.bfloat16)
        w1 = self.param("w1", nn.initializers.lecun_normal(batch_axis=(0,)), (E, d, self.d_ff), jnp.float32)
        w2 = self.param("w2", nn.initializers.lecun_normal(batch_axis=(0,)), (E, self.d_ff, d), jnp.float32)
        h = nn.gelu(self._ragged("fc1", xs, w1.astype(jnp.bfloat16), sizes))
        ys = self._ragged("fc2", h.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), sizes)
        # Unpermute: back to (T, k, d) and the weighted sum over k.
        y = jnp.zeros((T * k, d), ys.dtype).at[order].set(ys).reshape(T, k, d)
        return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weight)


def teacher(key, d):
    k1, k2 = jax.random.split(key)
    a = jax.random.normal(k1, (d, 2 * d)) / jnp.sqrt(d)
    b = jax.random.normal(k2, (2 * d, d)) / jnp.sqrt(2 * d)
    return lambda x: jnp.tanh(x @ a) @ b


def train(name, recipe, cfg, steps, tokens, seed=0):
    cls = "xla" if recipe == "xla" else make_ragged_dot_cls(recipe)
    model = MoeMlp(cfg["d_model"], cfg["d_ff"], cfg["experts"], cfg["top_k"], None if cls == "xla" else cls)
    target = teacher(jax.random.PRNGKey(123), cfg["d_model"])
    x0 = jnp.zeros((tokens, cfg["d_model"]), jnp.float32)
    variables = model.init(jax.random.PRNGKey(seed), x0)
    params = variables["params"]
    state = variables.get(OVERWRITE_WITH_GRADIENT, {})
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, state, opt_state, key):
        x = jax.random.normal(key, (tokens, cfg["d_model"]))
        y = target(x)

        def loss_fn(params, state):
            v = {"params": params, **({OVERWRITE_WITH_GRADIENT: state} if state else {})}
            return jnp.mean((model.apply(v, x) - y) ** 2)

        loss, (g, new_state) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, state)
        updates, opt_state = opt.update(g, opt_state, params)
        # DelayedScaling: the state's "gradient" is its new value (overwrite, never optimize).
        return optax.apply_updates(params, updates), new_state, opt_state, loss

    key = jax.random.PRNGKey(7)
    losses = []
    step(params, state, opt_state, key)[3].block_until_ready()  # compile
    t0 = time.perf_counter()
    for i in range(steps):
        params, state, opt_state, loss = step(params, state, opt_state, jax.random.fold_in(key, i))
        losses.append(loss)
    losses = [float(v) for v in jax.device_get(losses)]
    ms = (time.perf_counter() - t0) * 1e3 / steps
    return losses, ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="CPU-sized model and fewer steps")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    if args.small:
        cfg = dict(d_model=64, d_ff=128, experts=8, top_k=2)
        tokens, steps = 256, args.steps or 200
    else:
        cfg = dict(d_model=1024, d_ff=2048, experts=8, top_k=2)
        tokens, steps = 8192, args.steps or 300
    runs = {
        "xla ragged_dot (bf16)": "xla",
        "lowbit bf16": None,
        "lowbit fp8 current": lowbit.Float8CurrentScaling(),
        "lowbit fp8 delayed": lowbit.DelayedScaling(amax_history_len=16),
    }
    print(f"device: {jax.devices()[0].device_kind}; {tokens} tokens, {cfg}, {steps} steps")
    results = {}
    for name, recipe in runs.items():
        losses, ms = train(name, recipe, cfg, steps, tokens)
        results[name] = losses
        marks = [losses[i] for i in (0, steps // 4, steps // 2, 3 * steps // 4, steps - 1)]
        print(f"{name:24s} {ms:8.2f} ms/step   loss " + " -> ".join(f"{v:.4f}" for v in marks))
    base = results["lowbit bf16"]
    tail = max(1, steps // 10)
    ref = sum(base[-tail:]) / tail
    for name, losses in results.items():
        mean = sum(losses[-tail:]) / tail
        print(f"{name:24s} final loss (mean of last {tail}) {mean:.4f}  ({mean / ref:.3f}x lowbit bf16)")


if __name__ == "__main__":
    main()
