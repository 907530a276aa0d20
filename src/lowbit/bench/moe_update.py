"""The MoE block's full training step: forward + backward + the optax.adamw update of float32
masters, one jit, for lowbit.bench.moe's ``... + adamw`` rows (their ``vs_bf16`` is against
``lowbit bf16 + adamw``).

Cases (every parameter has a float32 master and AdamW's two float32 moments):

* ``lowbit bf16 + adamw``: the step reads bf16 compute weights that the previous update wrote
  (``master.astype(bf16)``, one more output of the update's fusion).
* ``fp8 delayed primary in-update + adamw``: the expert weights' FP8 copies (both layouts, the
  per-expert amax) written by the update itself (:func:`lowbit.moe.apply_update_with_fp8_copies`,
  jnp that XLA fuses into the AdamW fusion) with the DelayedScaling state the backward returned;
  the step reads the copies and casts no weight.
* ``fp8 delayed primary refresh + adamw``: the same copies made by lowbit's cast kernel
  (``quantize_experts``) after the update: a separate pass over the new masters.

In the FP8 cases the step differentiates through ``master.astype(bf16)`` of the expert weights
(the GEMMs never read it, so XLA drops the convert): dW is bf16 as in the BF16 case, and the
update converts it. The router's gate is a bf16 compute copy in every case.

Weight bytes per expert parameter (the floor of these rows; ``weight_GB`` in the table):

=====================  ==========================================  ==================  =====
case                   update (AdamW: master, m, v read+write)     fwd+bwd GEMMs       total
=====================  ==========================================  ==================  =====
bf16 + adamw           read 4+4+4 + dW 2; write 4+4+4 + bf16 2: 28  read 2+2, dW 2: 6   34
fp8 in-update + adamw  read 14; write 12 + row 1; col: +1 +1: 29    read 1+1, dW 2: 4   33
fp8 refresh + adamw    read 14; write 12: 26; cast: read 4, 1+1: 6  read 1+1, dW 2: 4   36
=====================  ==========================================  ==================  =====

(the colwise copy: XLA transposes the rowwise one, +1 read +1 write, unless it writes it from
the update's fusion directly: 28). At 64 experts of hidden 4096 / ffn 1536 (1.2 G expert
parameters) the update alone moves ~34 GB, ~7 ms on an H200 (~10 ms on an H100), the same in
every case: the full step's FP8 / BF16 ratio is the fwd+bwd ratio diluted by it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import lowbit
from lowbit.moe import apply_update_with_fp8_copies, quantize_experts
from lowbit.moe.block import moe_block

CASES = (
    "lowbit bf16 + adamw",
    "fp8 delayed primary in-update + adamw",
    "fp8 delayed primary refresh + adamw",
)
BASE = CASES[0]
#: Bytes per expert parameter of (the update, the fwd+bwd GEMMs): the table above.
WEIGHT_BYTES = {CASES[0]: (28, 6), CASES[1]: (29, 4), CASES[2]: (32, 4)}
_EXPERTS = ("wi", "wo")


def _loss(k, recipe):
    def loss(x, compute, params, state, qws):
        if recipe is None:
            wi, wo = compute["wi"], compute["wo"]
        else:  # carry the gradients only (bf16, as BF16's): the GEMMs read the copies
            wi, wo = (params[n].astype(jnp.bfloat16) for n in _EXPERTS)
        y = moe_block(
            x,
            compute["gate"],
            wi,
            wo,
            num_experts_per_tok=k,
            recipe=recipe,
            state=state,
            quantized_weights=qws,
        )[0]
        return jnp.sum(y.astype(jnp.float32))

    return loss


def _copies(case, recipe, params, updates, states):
    """(new params, new FP8 copies or None) from the masters and AdamW's updates."""
    import optax

    if "in-update" not in case:
        new = optax.apply_updates(params, updates)
        qws = (
            None
            if recipe is None
            else tuple(quantize_experts(new[n], recipe, s) for n, s in zip(_EXPERTS, states))
        )
        return new, qws
    new = {"gate": optax.apply_updates(params["gate"], updates["gate"])}
    qws = []
    for n, s in zip(_EXPERTS, states):
        new[n], q = apply_update_with_fp8_copies(params[n], updates[n], recipe, s)
        qws.append(q)
    return new, tuple(qws)


def build(case, k, x, gate, wi, wo):
    """``(jitted full step, its args)`` for ``case`` at the bench's operands (bf16; their float32
    values become the masters)."""
    import optax

    if case not in CASES:
        raise ValueError(f"moe_update: case must be one of {CASES}, got {case!r}")
    recipe = None if case == BASE else lowbit.DelayedScaling()
    tx = optax.adamw(1e-4)
    params = {n: a.astype(jnp.float32) for n, a in (("gate", gate), ("wi", wi), ("wo", wo))}
    names = ("gate", "wi", "wo") if recipe is None else ("gate",)
    loss = jax.value_and_grad(_loss(k, recipe), argnums=(0, 1, 2, 3))

    def step(x, params, opt, compute, state, qws):
        val, (dx, dc, dp, new_state) = loss(x, compute, params, state, qws)
        grads = {n: dc[n] if n in compute else dp[n] for n in params}
        updates, opt = tx.update(grads, opt, params)
        new, qws = _copies(case, recipe, params, updates, (None, None) if state is None else new_state)
        compute = {n: new[n].astype(jnp.bfloat16) for n in names}
        return val, dx, new, opt, compute, new_state, qws

    state = qws = None
    if recipe is not None:
        state = (lowbit.init_grouped_delayed_state(recipe, wi.shape[0]),) * 2
        qws = jax.jit(lambda p: tuple(quantize_experts(p[n], recipe, s) for n, s in zip(_EXPERTS, state)))(
            params
        )
    compute = {n: params[n].astype(jnp.bfloat16) for n in names}
    return jax.jit(step), (x, params, tx.init(params), compute, state, qws)


def weight_bytes(case, E, H, F) -> float:
    """The expert weights' bytes of one full step (update + GEMMs)."""
    return E * 3 * H * F * sum(WEIGHT_BYTES[case])


__all__ = ["BASE", "CASES", "build", "weight_bytes"]
