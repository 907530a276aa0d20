"""Issue 26's headline table in one process: TransformerEngine's fused Flax TransformerLayer and
the same code on lowbit.te (only the import differs), TE's field defaults (relative position
bias, pre-LayerNorm, GELU MLP), the seed shapes (b4 s2048 h4096 ffn16384, 32 heads, causal),
DelayedScaling, fwd+bwd, with attention dropout 0 and 0.1 and default XLA flags.

    python scripts/te_layer_dropout.py [--small] [--out FILE.json]

TE's rows appear where ``transformer_engine`` imports (the device, after
``source scripts/device_setup.sh te``); a peer that cannot run is left out, never faked.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from lowbit.bench.common import time_fn
from lowbit.bench.peers import lowbit_peer, te_peer

SEED = dict(batch=4, seq=2048, hidden=4096, ffn=16384, heads=32)
SMALL = dict(batch=2, seq=64, hidden=128, ffn=256, heads=4)


def _layer(peer, cfg, dropout):
    return peer.flax.TransformerLayer(
        hidden_size=cfg["hidden"],
        mlp_hidden_size=cfg["ffn"],
        num_attention_heads=cfg["heads"],
        hidden_dropout=0.0,
        attention_dropout=dropout,
        intermediate_dropout=0.0,
        self_attn_mask_type="causal",
        dtype=jnp.bfloat16,
    )


def time_layer(peer, cfg, dropout, iters):
    """Median ms of one jitted fwd+bwd (grads of the parameters and the input)."""
    layer = _layer(peer, cfg, dropout)
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (cfg["batch"], cfg["seq"], cfg["hidden"]), jnp.bfloat16)
    rngs = {"params": key, "dropout": jax.random.PRNGKey(1)}
    with peer.context(recipe=peer.make_recipe("delayed")):
        variables = layer.init(rngs, x, deterministic=dropout == 0)

        def loss(params, x, rng):
            v = dict(variables, params=params)
            y = layer.apply(v, x, deterministic=dropout == 0, rngs={"dropout": rng})
            return jnp.mean(y.astype(jnp.float32) ** 2)

        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return time_fn(step, variables["params"], x, jax.random.PRNGKey(2), iters=iters)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny shapes (default without a GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    small = args.small or jax.default_backend() != "gpu"
    cfg = SMALL if small else SEED
    peers = [p for p in (te_peer(), lowbit_peer()) if p is not None]
    rows = []
    for peer in peers:
        for dropout in (0.0, 0.1):
            ms = time_layer(peer, cfg, dropout, iters=3 if small else 20)
            rows.append(dict(peer=peer.name, attention_dropout=dropout, ms=ms))
            print(f"{peer.name:7s} attention dropout {dropout:.1f}: {ms:8.3f} ms", flush=True)
    out = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, shapes=cfg, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
