"""A framework integration as MaxText builds one on TransformerEngine, ported by import: a
``TransformerEngineBase`` subclass whose quantizer sets come through ``super()`` into the
collection the framework names, ``te.dense.dense`` with a collective-op set, the batch-first
attention of ``flax.transformer``, and the module under Flax NNX's Linen bridge."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel

import lowbit
import lowbit.te as te
import lowbit.te.cpp_extensions as tex
from lowbit import recipe
from lowbit.te.flax.module import TransformerEngineBase
from lowbit.te.flax.transformer import DotProductAttention

# The comparisons below hold lowbit's float32 math to float64 at float32 bounds (1e-6, 1e-5). On a
# GPU, XLA computes float32 dots in TF32 by default (10-bit mantissa, rel ~1e-3), which would
# measure XLA's default rather than lowbit: the compared computations run under "highest"
# matmul precision (true float32), and the references are float64 numpy. The FP8 recipes' bound
# (0.1) is far above either.
F32_DOTS = "highest"

RECIPES = {
    "none": (None, 1e-6),
    "delayed": (recipe.DelayedScaling(amax_history_len=8), 0.1),
    "current": (recipe.Float8CurrentScaling(), 0.1),
    "mxfp8": (recipe.MXFP8BlockScaling(), 0.1),
}


class FrameworkDense(TransformerEngineBase):
    features: int

    def generate_quantizer_set(
        self,
        postfix="",
        variable_collection=None,
        quantization_checkpoint_name=None,
        fp8_recipe=None,
        n_groups=None,
    ):
        return super().generate_quantizer_set(
            postfix=postfix,
            variable_collection="_overwrite_with_gradient",
            quantization_checkpoint_name=quantization_checkpoint_name,
            fp8_recipe=fp8_recipe,
            n_groups=n_groups,
        )

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        qs = self.generate_quantizer_set()
        op_set = tex.CollectiveOpSet.create(forward_collective_op=tex.CollectiveOp.NONE)
        return te.dense.dense(
            x, kernel, contracting_dims=((x.ndim - 1,), (0,)), quantizer_set=qs, collective_op_set=op_set
        )


@pytest.mark.parametrize("name", list(RECIPES))
def test_transformer_engine_base_subclass(name):
    r, tol = RECIPES[name]
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 32, 64), jnp.float32)
    m = FrameworkDense(features=64)
    with te.autocast(enabled=r is not None, recipe=r), jax.default_matmul_precision(F32_DOTS):
        v = m.init(jax.random.PRNGKey(1), x)
        y = m.apply(v, x)
        grads = jax.grad(lambda v: (m.apply(v, x) ** 2).sum())(v)
    ref = np.asarray(x, np.float64) @ np.asarray(v["params"]["kernel"], np.float64)
    assert rel(y, ref) < tol
    state = v.get("_overwrite_with_gradient", {})
    if isinstance(r, recipe.DelayedScaling):
        assert set(state) == {f"{t}_{k}" for t in ("x", "kernel", "grad") for k in ("amax_history", "scale")}
        assert state["x_amax_history"].shape == (8,)
    else:
        assert not state
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))


def test_collective_gemms_are_refused_by_name():
    x = jnp.ones((2, 64))
    k = jnp.ones((64, 32))
    ag = tex.CollectiveOpSet.create(tex.CollectiveOp.ALL_GATHER)
    assert ag.backward is tex.CollectiveOp.REDUCE_SCATTER
    with pytest.raises(NotImplementedError, match="collective_op_set"):
        te.dense.dense(x, k, collective_op_set=ag)
    with pytest.raises(NotImplementedError, match="collective_gemm_bootstrap"):
        tex.collective_gemm_bootstrap(8, 8, 0, 2)


def test_batch_first_attention_from_flax_transformer():
    b, s, h, d = 2, 8, 2, 16
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (b, s, h, d)) for i in range(3))
    with jax.default_matmul_precision(F32_DOTS):
        out = DotProductAttention(head_dim=d, num_attention_heads=h, attn_mask_type="no_mask").apply(
            {}, q, k, v
        )
    q64, k64, v64 = (np.asarray(t, np.float64) for t in (q, k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q64, k64) / np.sqrt(d)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert rel(out, np.einsum("bhqk,bkhd->bqhd", p, v64)) < 1e-5


def test_nnx_bridge():
    nnx = pytest.importorskip("flax.nnx")
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 64), jnp.float32)
    with lowbit.autocast(recipe.Float8CurrentScaling()):
        model = nnx.bridge.ToNNX(FrameworkDense(features=32), rngs=nnx.Rngs(0)).lazy_init(x)
        y = model(x)
    kernel = np.asarray(nnx.state(model, nnx.Param)["kernel"][...], np.float64)
    assert rel(y, np.asarray(x, np.float64) @ kernel) < 0.1
