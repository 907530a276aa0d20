"""The integration tutorial: a plain Flax transformer layer whose Dense layers take a
`dot_general_cls`, timed before and after swapping in lowbit's quantized dot_general.

    python examples/transformer_layer.py --recipe current   # seed shapes on a GPU, small on CPU
    python examples/transformer_layer.py --recipe mxfp8 --small

Seed shapes: hidden 4096, sequence 2048, batch 4, FFN 16384, 32 heads, bf16 inputs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dense import RECIPES, dot_general_cls_for, make_recipe, on_gpu, rngs_for, speedometer  # noqa: E402


class FlaxMLP(nn.Module):
    """Feed-forward block of the layer, plain Flax."""

    hidden_size: int
    ffn_hidden_size: int
    dot_general_cls: Callable = lambda: None

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = nn.Dense(features=self.ffn_hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)
        x = nn.gelu(x, approximate=True)
        x = nn.Dense(features=self.hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)
        return x


class FlaxTransformerLayer(nn.Module):
    """Pre-LayerNorm transformer layer built from plain Flax modules."""

    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1
    dot_general_cls: Callable = lambda: None

    def setup(self):
        self.kv_channels = self.hidden_size // self.num_attention_heads

    @nn.compact
    def __call__(
        self, x: jnp.ndarray, attention_mask: Optional[jnp.ndarray] = None, deterministic: bool = False
    ) -> jnp.ndarray:
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)

        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)

        # One projection for q, k and v.
        qkv = nn.Dense(features=3 * self.hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)

        dropout_rng = None
        if not deterministic and self.attention_dropout > 0:
            dropout_rng = self.make_rng("dropout")
        x = nn.dot_product_attention(
            query=q,
            key=k,
            value=v,
            mask=attention_mask,
            dropout_rng=dropout_rng,
            dropout_rate=self.attention_dropout,
            deterministic=deterministic,
            broadcast_dropout=True,
        )
        x = x.reshape(x.shape[0], x.shape[1], self.hidden_size)

        x = nn.Dense(features=self.hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)
        x = res + x

        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)
        x = FlaxMLP(
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            dot_general_cls=self.dot_general_cls,
        )(x)
        return x + res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=list(RECIPES), default="delayed")
    ap.add_argument("--small", action="store_true", help="tiny shapes (default without a GPU)")
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args(argv)
    small = args.small or not on_gpu()

    if small:
        hidden_size, sequence_length, batch_size, ffn_hidden_size, num_attention_heads = 128, 32, 2, 512, 4
    else:
        hidden_size, sequence_length, batch_size, ffn_hidden_size, num_attention_heads = (
            4096,
            2048,
            4,
            16384,
            32,
        )
    dtype = jnp.bfloat16

    key, dropout_key = jax.random.split(jax.random.PRNGKey(42))
    x = jax.random.normal(key, (batch_size, sequence_length, hidden_size)).astype(dtype)
    dy = jax.random.normal(key, (batch_size, sequence_length, hidden_size)).astype(dtype)

    recipe = make_recipe(args.recipe)
    layer = FlaxTransformerLayer(
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=num_attention_heads,
        dot_general_cls=dot_general_cls_for(recipe),
    )
    var_collect = layer.init(key, x, attention_mask=None, deterministic=False)
    print(f"recipe: {args.recipe}   x {tuple(x.shape)}   device: {jax.devices()[0].device_kind}")
    print("params:", jax.tree_util.tree_map(lambda a: a.shape, var_collect["params"]))
    extra = {k: v for k, v in var_collect.items() if k != "params"}
    if extra:
        print("additional state:", jax.tree_util.tree_map(lambda a: a.shape, extra))

    rngs = rngs_for(recipe, dropout_key)
    y = layer.apply(var_collect, x, attention_mask=None, deterministic=True, rngs=rngs)
    print(f"output {tuple(y.shape)} {y.dtype}")
    ms = speedometer(
        layer.apply,
        var_collect,
        x,
        dy,
        forward_kwargs={"attention_mask": None, "deterministic": False},
        rngs=rngs,
        timing_iters=args.iters or (3 if small else 10),
    )
    return {"recipe": args.recipe, "ms": ms}


if __name__ == "__main__":
    main()
