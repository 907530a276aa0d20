"""The relative position table's gradient against float64 (issue 25: TE's test_layer found
lowbit's ``relpos_bias/rel_embedding`` gradient 8-40% away from TE's bf16 reference). Each bucket
sums ~s*s/buckets bias gradients: lowbit contracts a one-hot (float32 accumulation) and lands
within a bf16 rounding of float64; a gather's transpose accumulated in bf16 (a scatter-add) is
~20% off at these sizes, the size of the gap TE's test reported, so the gap is the reference's."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowbit.flax.positions import RelativePositionBiases, relative_position_buckets


def test_table_gradient_matches_float64_and_beats_a_bf16_scatter_add():
    h, nb, md, s = 4, 32, 128, 512
    m = RelativePositionBiases(num_buckets=nb, max_distance=md, num_attention_heads=h, dtype=jnp.bfloat16)
    v = m.init(jax.random.PRNGKey(0), s, s)
    g = jax.random.normal(jax.random.PRNGKey(1), (1, h, s, s), jnp.float32).astype(jnp.bfloat16)

    def loss(v):
        return jnp.sum(m.apply(v, s, s).astype(jnp.float32) * g.astype(jnp.float32))

    got = np.asarray(nn.unbox(jax.grad(loss)(v))["params"]["rel_embedding"], np.float64)
    bucket = relative_position_buckets(s, s, nb, md, True)
    g64 = np.asarray(g, np.float64)[0]
    ref = np.stack([g64[:, bucket == b].sum(axis=1) for b in range(nb)], axis=1)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < 2.0**-7, rel
    scatter = jnp.zeros((h, nb), jnp.bfloat16).at[:, bucket.reshape(-1)].add(g[0].reshape(h, -1))
    rel_scatter = np.linalg.norm(np.asarray(scatter, np.float64) - ref) / np.linalg.norm(ref)
    assert rel_scatter > 10 * rel, (rel_scatter, rel)
