"""lowbit's ops, in three layers; each imports from the layers below it, never from one above,
and all stand on lowbit.quantization (ScalingMode, ScaledTensor, the argument checks), which
imports nothing from ops (tests/test_structure.py checks both):

* ``ops/_ffi/<family>.py``: one module per handler file ``csrc/ffi/<family>.cc`` (quantize,
  gemm, grouped_gemm, norm, activation, softmax). Thin functions: arrays and ints/flags in,
  arrays out, one :func:`lowbit._native.ffi_call` each, with the family's codes and flag bits
  (their values from :mod:`lowbit.abi`). No checks, no ScaledTensor, no gradients.
* ``ops/<op>.py``: the differentiable ops (quantize, gemm, dense, grouped_gemm, norm,
  activation, softmax) and their helpers (fused_quantize, nonfinite, dense_sharded): argument
  checks with errors naming the argument, ScaledTensor in and out, custom VJPs.
* ``ops/fused/``: compositions of several ops under one custom VJP whose kernels hand each other
  FP8 operands (mlp, split_dense, the norm in front of either).

One template for a differentiable op (see norm.py, activation.py, dense.py)::

    @dataclasses.dataclass(frozen=True)
    class _OpConfig:                  # everything static: codes, dtypes, shapes, flags
        ...

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def _op(cfg: _OpConfig, x, ...):  # arrays (or None) only after cfg
        ...

    def _op_fwd(cfg, x, ...):         # -> (out, residuals)
        ...

    def _op_bwd(cfg, res, ct):        # -> one cotangent (or None) per array argument
        ...

    _op.defvjp(_op_fwd, _op_bwd)

    def op(x, ...):                   # public: checks, builds cfg, calls _op
        ...

The ``custom_vjp`` is built once, at module level, never inside a function; the config is a
frozen (hashable) dataclass passed as a non-differentiable argument, so JAX caches one trace per
config. Arrays never go into the config: an encode scale or a mask is an argument (its
cotangent zeros or None).

Where a sharded path lives: beside its op, in the same module (``_<op>_sharded``), or in
``<op>_sharded.py`` when it is large (dense_sharded.py). The op asks lowbit.sharding for a plan
(``plan_rows`` for row-wise ops, ``plan_dense`` for GEMMs; None: run unsharded) and passes it
on. The FFI calls have no partitioning rule, so without a plan XLA would gather their operands.
An op whose backward needs no collective is wrapped whole: ``shard_map`` around ``_op``
(activation). An op whose backward sums over shards (a replicated parameter's gradient, a split
contraction) is a custom VJP of its own whose forward and backward each run one ``shard_map``
(``_layernorm_sharded``, ``dense_sharded._sharded_2d``), the plan a second non-differentiable
argument next to the config.
"""
