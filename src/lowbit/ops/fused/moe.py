"""moe: a mixture-of-experts MLP on lowbit's grouped GEMM, on one device or expert-parallel.

``moe_mlp`` = router logits -> softmax -> top-k (weights renormalised over the chosen k) ->
tokens permuted by expert -> grouped fc1 -> activation -> grouped fc2 -> unpermuted and summed
with the routing weights. Group sizes stay on the device: no host sync, no data-dependent shape.
``moe_experts`` is the same engine with any router (a function run on each device's tokens:
lowbit.moe's TE-style router), expert biases, a per-expert capacity on one device, and FP8
primary weights (:mod:`lowbit.ops.fused.grouped_prequantized`); the permutation is
:mod:`lowbit.ops.fused.permutation`'s (gather-only custom VJPs).

Expert parallelism (``mesh`` and ``expert_axis``): tokens and experts are split over the axis.
Each device routes its own tokens, sends each (token, expert) pair only to the device that owns
the expert, runs the grouped GEMMs of its own experts and sends the results back; the token's
owner combines them. The rows travel one of two ways (``dispatch``):

* ``"capacity"`` (what ``"auto"`` picks): one dense ``jax.lax.all_to_all`` of fixed (capacity,
  d) bf16 blocks, one per (source, destination) pair, each followed by a row holding its
  per-expert counts (as bf16 base-256 digits), and one all-to-all of the results back: one
  collective each way, forward and backward. The receiver moves its rows into expert order by
  index maps computed from the counts (no sort); every row move has a gather-only VJP.
* ``"ragged"``: the devices first swap their per-expert counts (a small all-to-all of int32
  (devices, local experts) matrices), then ``jax.lax.ragged_all_to_all`` moves exactly the
  routed rows. Each device receives into one buffer laid out by (local expert, source device,
  token), so the rows are already grouped for the GEMMs. GPU only (XLA:CPU has no
  ragged-all-to-all).

Both are exact by default: the buffers hold the worst case (every pair a device can receive).
``capacity_factor`` f shrinks each device's receive buffer to ``ceil(f * T_local * top_k /
devices)`` rows per source device (``"capacity"``) or ``devices`` times that in all
(``"ragged"``), where ``T_local * top_k`` is what a device receives under a perfectly balanced
router. Pairs past it are dropped and contribute zero (the other pairs' weights are not
renormalised): with ``"capacity"`` the pairs a source sends to one destination past the first
``capacity`` in (expert, token) order; with ``"ragged"`` the rows past the buffer's end in the
receiver's (local expert, source, token) order. The row order inside each expert's group equals
the one-device order, so dropless results equal one device's up to the GEMMs' summation order.

``ep_chunks`` c (capacity only) splits each device's tokens into c consecutive chunks, each
dispatched, computed and combined on its own (two all-to-alls per chunk each way; no chunk reads
another's values, so the exchanges can overlap other chunks' GEMMs), with ``ceil(capacity / c)``
rows per (chunk, source, destination) block; the drop rule above then holds per chunk.

Tokens travel and enter the GEMMs as bfloat16 (the grouped GEMM rounds its operands to bfloat16 or
quantizes them); fc1's output is bfloat16, the activation runs in float32 and rounds once, the
weighted sum is float32, the result x's dtype. Gradients: every step is differentiable (the grouped
GEMM's custom VJP, all_to_all's transpose, ep_dispatch's gather-only row moves, and
:func:`_ragged_exchange`, whose backward is the reverse ragged exchange; the router's gradient is
summed over the devices, the experts' stay local).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from lowbit import delayed_scaling as ds
from lowbit.ops.activation import activation as _activation
from lowbit.ops.activation import parse_activations
from lowbit.ops.fused import ep_dispatch as ep
from lowbit.ops.fused.ep_choice import DISPATCHES, pick_dispatch
from lowbit.ops.fused.grouped_prequantized import grouped_gemm_prequantized, quantize_experts
from lowbit.ops.fused.permutation import (
    combine_pairs,
    exclusive_cumsum,
    permute,
    permute_probs,
    plan_dispatch,
    row_experts,
    unpermute,
)
from lowbit.ops.fused.permutation_fused import check_impl, permute_quantize
from lowbit.ops.grouped_gemm import grouped_gemm
from lowbit.quantization.checks import as_array
from lowbit.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from lowbit.sharding import shard_map

_BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class _MoeConfig:
    top_k: int
    experts: int  # global number of experts
    act: tuple  # lowbit.activation's activations
    recipe: Optional[Recipe]
    out_dtype: Any
    axis: Optional[str] = None  # the expert axis (None: one device)
    devices: int = 1
    dispatch: str = "local"  # "local" (one device), "ragged" or "capacity"
    rows: int = 0  # ragged: receive buffer rows; capacity: rows per (source, destination);
    # local: each expert's capacity (0: dropless); capacity with chunks: rows per chunk's block
    weights_early: bool = False  # local only: routing weights applied before fc2
    chunks: int = 1  # capacity only: independent token chunks per device (ep_chunks)
    # pad: each expert's rows padded to a multiple of it (FP8 16: the wgrad reads them in place)
    pad = property(lambda self: 16 if self.recipe is not None else 0)


# ---------------------------------------------------------------------------------------------
# Pieces shared by every path
# ---------------------------------------------------------------------------------------------
def route(x: ArrayLike, router_kernel: ArrayLike, top_k: int) -> tuple[jax.Array, jax.Array]:
    """The router: ``softmax(x @ router_kernel)`` in float32 (full-precision dot), its ``top_k``
    largest entries per token. Returns ``(weights (T, top_k) float32, renormalised to sum to 1;
    experts (T, top_k) int32)``."""
    logits = jnp.dot(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(router_kernel, jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    return weights / jnp.sum(weights, axis=-1, keepdims=True), experts.astype(jnp.int32)


def _gemm(cfg, x, w, sizes, state, qw, qx=None):
    if qw is None and qx is None:
        return grouped_gemm(x, w, sizes, recipe=cfg.recipe, preferred_element_type=_BF16, state=state)
    if qw is None:  # the casting path with a quantized lhs: the same cast grouped_gemm makes
        qw = quantize_experts(w, cfg.recipe, state)
    return grouped_gemm_prequantized(
        x, w, qw, sizes, recipe=cfg.recipe, preferred_element_type=_BF16, state=state, qlhs=qx
    )


def _dispatch_quantized(cfg: _MoeConfig, x, plan, experts, state):
    """fc1's quantized lhs from the fused FP8 dispatch (permute_quantize: the permuted rows'
    rowwise and colwise copies written in the gather's pass, bit-equal to quantizing the
    permuted bf16 rows) under the fused kernels and a per-tensor recipe; None otherwise (fc1
    quantizes the permuted rows itself)."""
    r = cfg.recipe
    if not isinstance(r, (DelayedScaling, Float8CurrentScaling)) or check_impl("moe", None) != "fused":
        return None
    scale = ds.scale_of(None if state is None else state[0], "x")
    return permute_quantize(x, plan, experts, r.scaling_mode("x"), r.q_dtype("x"), scale=scale)


def _experts(cfg: _MoeConfig, xs, w1, w2, sizes, state, extras, row_w=None, qx=None):
    """Grouped fc1 (+ b1) -> activation (x row weights, when early) -> grouped fc2 (+ b2) over
    rows grouped by expert (rows past the last group give zeros; so do their biases). ``extras``
    = (b1, b2, quantized w1, quantized w2), each None or an array (a QuantizedExperts); ``qx``:
    None or xs quantized for fc1 (the fused FP8 dispatch)."""
    s1, s2 = (None, None) if state is None else state
    b1, b2, q1, q2 = (None,) * 4 if extras is None else extras
    rows_e = None if b1 is None and b2 is None else row_experts(sizes, xs.shape[0])
    h = _gemm(cfg, xs, w1, sizes, s1, q1, qx)
    if b1 is not None:
        h = (h.astype(jnp.float32) + _bias_rows(b1, rows_e)).astype(_BF16)
    h = _activation(h, cfg.act)
    if row_w is not None:
        h = (h.astype(jnp.float32) * row_w[:, None]).astype(_BF16)
    y = _gemm(cfg, h, w2, sizes, s2, q2)
    if b2 is not None:
        y = (y.astype(jnp.float32) + _bias_rows(b2, rows_e)).astype(_BF16)
    return y


def _bias_rows(b, rows_e):
    # One bias row per expert, a zero row for the rows past the last group.
    return jnp.concatenate([b.astype(jnp.float32), jnp.zeros((1, b.shape[1]), jnp.float32)])[rows_e]


def _sort_pairs(x, experts, cfg: _MoeConfig):
    """Sorts the T * top_k (token, expert) pairs by expert (stable: token order within an
    expert). Returns (plan, xs (P, d) bf16 rows in sorted order)."""
    plan = plan_dispatch(experts, cfg.experts)
    return plan, permute(x.astype(_BF16), plan)


def _local(cfg: _MoeConfig, x, weights, experts, w1, w2, state, extras):
    plan = plan_dispatch(experts, cfg.experts, align_size=cfg.pad, capacity=cfg.rows or None, round_rows=True)
    xb = x.astype(_BF16)
    # With the fused FP8 dispatch, xs only carries fc1's lhs gradient (its gather leaves the forward).
    xs, qx = permute(xb, plan), _dispatch_quantized(cfg, xb, plan, experts, state)
    if cfg.weights_early:  # fold the weights into fc2's input (fc2 is linear): combine sums
        row_w = permute_probs(weights, plan)
        ys = _experts(cfg, xs, w1, w2, plan.group_sizes, state, extras, row_w, qx)
        return unpermute(ys, plan, None, cfg.out_dtype)
    ys = _experts(cfg, xs, w1, w2, plan.group_sizes, state, extras, qx=qx)
    return unpermute(ys, plan, weights, cfg.out_dtype)


# ---------------------------------------------------------------------------------------------
# Ragged dispatch: jax.lax.ragged_all_to_all with its reverse as the backward
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_exchange(spec, x, plan):
    """Sends ``x[in_off[i] : in_off[i] + send[i]]`` to device ``i // (len / devices)`` at its
    row ``out_off[i]``; receives ``recv`` rows per slice into zeros of ``spec = (axis, out_rows,
    in_rows)``. ``plan = (in_off, send, out_off, recv, my_recv_off, their_in_off)``: the last two
    are where the received slices sit here and where they came from on their sources, which the
    reverse exchange (the backward, and the combine step) needs."""
    axis, out_rows, _ = spec
    in_off, send, out_off, recv, _, _ = plan
    out = jnp.zeros((out_rows, *x.shape[1:]), x.dtype)
    return jax.lax.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis_name=axis)


def _ragged_exchange_fwd(spec, x, plan):
    return _ragged_exchange(spec, x, plan), plan


def _ragged_exchange_bwd(spec, plan, ct):
    axis, _, in_rows = spec
    dx = _ragged_exchange((axis, in_rows, ct.shape[0]), ct, reverse_plan(plan))
    return dx, tuple(None for _ in plan)


_ragged_exchange.defvjp(_ragged_exchange_fwd, _ragged_exchange_bwd)


def reverse_plan(plan):
    """The plan that sends every received slice back where it came from."""
    in_off, send, out_off, recv, my_off, their_off = plan
    return (my_off, recv, their_off, send, in_off, out_off)


def _ragged(cfg: _MoeConfig, x, weights, experts, w1, w2, state, extras):
    n, E = cfg.devices, cfg.experts
    El = E // n
    dplan, xs = _sort_pairs(x, experts, cfg)
    sizes = dplan.group_sizes
    starts = exclusive_cumsum(sizes)
    # Per source s and local expert e: how many rows come, and where they sit on s.
    got = jax.lax.all_to_all(jnp.stack([sizes, starts]).reshape(2, n, El), cfg.axis, 1, 1, tiled=True)
    recv, src_off = got[0], got[1]
    # This device's buffer: by local expert, then source; rows past its end are dropped.
    tot = jnp.sum(recv, axis=0)
    off = exclusive_cumsum(tot)[None, :] + exclusive_cumsum(recv, axis=0)
    keep = jnp.clip(cfg.rows - off, 0, recv)
    back = jax.lax.all_to_all(jnp.stack([off, keep]), cfg.axis, 1, 1, tiled=True)
    plan = (
        starts,
        back[1].reshape(E),
        back[0].reshape(E),
        keep.reshape(E),
        off.reshape(E),
        src_off.reshape(E),
    )
    P_ = xs.shape[0]
    xr = _ragged_exchange((cfg.axis, cfg.rows, P_), xs, plan)
    ys = _experts(cfg, xr, w1, w2, jnp.sum(keep, axis=0), state, extras)
    y_sorted = _ragged_exchange((cfg.axis, P_, cfg.rows), ys, reverse_plan(plan))
    return unpermute(y_sorted, dplan, weights, cfg.out_dtype)


# ---------------------------------------------------------------------------------------------
# Capacity dispatch: one dense all_to_all of (capacity, d) blocks each way, counts inside
# ---------------------------------------------------------------------------------------------
def _capacity(cfg: _MoeConfig, x, weights, experts, w1, w2, state, extras):
    if cfg.chunks == 1:
        return _capacity_chunk(cfg, x, weights, experts, w1, w2, state, extras)
    # ep_chunks: consecutive slices of this device's tokens, each dispatched, computed and
    # combined on its own. No value flows from one chunk to another (they share only the
    # weights), so XLA's async all-to-alls can run one chunk's exchange during another's GEMMs.
    Tc = x.shape[0] // cfg.chunks
    parts = [
        _capacity_chunk(
            cfg, *(a[i * Tc : (i + 1) * Tc] for a in (x, weights, experts)), w1, w2, state, extras
        )
        for i in range(cfg.chunks)
    ]
    return jnp.concatenate(parts)


def _capacity_chunk(cfg: _MoeConfig, x, weights, experts, w1, w2, state, extras):
    n, E, C = cfg.devices, cfg.experts, cfg.rows
    El, d = E // n, x.shape[1]
    if C >= ep.DIGIT**ep.DIGITS:
        raise ValueError(f"moe_mlp: {C} rows per capacity block; the counts' encoding holds < 2^24")
    plan = plan_dispatch(experts, E)  # dropless: dest = the pair's position sorted by expert
    plan, kept = ep.send_slots(plan, experts, n, C)
    blocks = permute(x.astype(_BF16), plan).reshape(n, C, d)
    # One all-to-all: each block carries its per-expert counts in extra rows.
    meta = ep.encode_counts(jax.lax.stop_gradient(kept), d, _BF16)
    got = jax.lax.all_to_all(jnp.concatenate([blocks, meta], axis=1), cfg.axis, 0, 0, tiled=True)
    recv = ep.decode_counts(jax.lax.stop_gradient(got[:, C:]), El)
    take, give, gs = ep.receive_maps(recv, C, cfg.pad)
    xe = ep.move_rows(got[:, :C].reshape(n * C, d), take, give)
    ys = _experts(cfg, xe, w1, w2, gs, state, extras)
    yback = jax.lax.all_to_all(ep.move_rows(ys, give, take), cfg.axis, 0, 0, tiled=True)
    return combine_pairs(yback, weights, plan.dest, plan.src, cfg.out_dtype)


# ---------------------------------------------------------------------------------------------
# Public entry
# ---------------------------------------------------------------------------------------------
def _state_spec(axis):
    # Grouped DelayedScaling state: histories (L, E), scales (E,): the expert axis is the last.
    return lambda a: P(*([None] * (a.ndim - 1)), axis)


def _check_weights(name, x, w1, w2, E, gated, bias):
    T, d = x.shape
    if w1.ndim != 3 or w1.shape[:2] != (E, d):
        raise ValueError(
            f"{name}: w1 must be (experts, d_model, d_ff) = ({E}, {d}, F), got {tuple(w1.shape)}"
        )
    F = w1.shape[2] // 2 if gated else w1.shape[2]
    if gated and w1.shape[2] % 2:
        raise ValueError(
            f"{name}: a gated activation needs w1's last dim even (two halves), got {w1.shape[2]}"
        )
    if w2.shape != (E, F, d):
        raise ValueError(
            f"{name}: w2 must be (experts, d_ff, d_model) = ({E}, {F}, {d}), got {tuple(w2.shape)}"
        )
    for b_name, b, shape in zip(("b1", "b2"), bias or (None, None), ((E, w1.shape[2]), (E, d))):
        if b is not None and tuple(b.shape) != shape:
            raise ValueError(f"{name}: {b_name} must have shape {shape}, got {tuple(b.shape)}")


def _check_args(x, router_kernel, w1, w2, top_k, gated):
    for name, a in (("x", x), ("router_kernel", router_kernel), ("w1", w1), ("w2", w2)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"moe_mlp: {name} must be a floating-point array, got {np.dtype(a.dtype).name}")
    if x.ndim != 2:
        raise ValueError(f"moe_mlp: x must be 2-D (tokens, d_model), got shape {tuple(x.shape)}")
    T, d = x.shape
    if router_kernel.ndim != 2 or router_kernel.shape[0] != d:
        raise ValueError(
            f"moe_mlp: router_kernel must be (d_model, experts) = ({d}, E), got {tuple(router_kernel.shape)}"
        )
    E = router_kernel.shape[1]
    _check_weights("moe_mlp", x, w1, w2, E, gated, None)
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= E:
        raise ValueError(f"moe_mlp: top_k must be an integer in [1, experts={E}], got {top_k!r}")
    return T, E


def _check_mesh(mesh, expert_axis, T, E):
    if expert_axis is None:
        raise ValueError(
            "moe_mlp: mesh is given but expert_axis is None; name the mesh axis that splits the experts"
        )
    names = tuple(mesh.axis_names)
    if expert_axis not in names:
        raise ValueError(f"moe_mlp: expert_axis {expert_axis!r} is not an axis of the mesh (axes {names})")
    n = int(mesh.shape[expert_axis])
    if E % n:
        raise ValueError(
            f"moe_mlp: experts ({E}, w1/w2's first dim) must be divisible by the size of mesh "
            f"axis {expert_axis!r} ({n})"
        )
    if T % n:
        raise ValueError(
            f"moe_mlp: tokens ({T}, x's first dim) must be divisible by the size of mesh axis "
            f"{expert_axis!r} ({n})"
        )
    return n


def _check_state(recipe, state, E):
    if not isinstance(recipe, DelayedScaling):
        if state is not None:
            raise ValueError(
                f"moe_mlp: state is only used with DelayedScaling, not {type(recipe).__name__}; "
                "pass state=None"
            )
        return None
    hint = "(lowbit.init_grouped_delayed_state(recipe, E),) * 2"
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise ValueError(f"moe_mlp: DelayedScaling needs state=(fc1_state, fc2_state), e.g. {hint}")
    return tuple(ds.check_state_arg(f"moe_mlp: state[{i}]", recipe, s, hint, E) for i, s in enumerate(state))


def _check_capacity(name, capacity_factor):
    if capacity_factor is not None and not (
        isinstance(capacity_factor, (int, float))
        and not isinstance(capacity_factor, bool)
        and capacity_factor > 0
    ):
        raise ValueError(f"{name}: capacity_factor must be None or a number > 0, got {capacity_factor!r}")


def buffer_rows(
    dispatch: str,
    tokens_local: int,
    top_k: int,
    experts: int,
    devices: int,
    capacity_factor=None,
    chunks: int = 1,
) -> int:
    """Rows of a device's receive buffer: ``"ragged"``: the whole buffer; ``"capacity"``: one
    source device's block (with ``chunks`` > 1, one chunk's: ``ceil(rows / chunks)``). The worst
    case (nothing dropped) when ``capacity_factor`` is None."""
    if dispatch not in ("ragged", "capacity"):
        raise ValueError(f"buffer_rows: dispatch must be 'ragged' or 'capacity', got {dispatch!r}")
    per_source = tokens_local * min(top_k, experts // devices)  # one token picks an expert once
    if capacity_factor is not None:
        per_source = min(per_source, max(1, math.ceil(capacity_factor * tokens_local * top_k / devices)))
    return per_source * devices if dispatch == "ragged" else -(-per_source // chunks)


def _check_chunks(name, ep_chunks, kind, state, tokens_local):
    if isinstance(ep_chunks, bool) or not isinstance(ep_chunks, (int, np.integer)) or ep_chunks < 1:
        raise ValueError(f"{name}: ep_chunks must be an integer >= 1, got {ep_chunks!r}")
    if ep_chunks == 1:
        return 1
    if kind != "capacity":
        raise ValueError(f"{name}: ep_chunks={ep_chunks} needs dispatch='capacity' (or 'auto'), not {kind!r}")
    if state is not None:  # each chunk's GEMMs would update the same amax history
        raise ValueError(
            f"{name}: ep_chunks={ep_chunks} does not support DelayedScaling's state; use ep_chunks=1"
        )
    if tokens_local % ep_chunks:
        raise ValueError(f"{name}: ep_chunks ({ep_chunks}) must divide each device's tokens ({tokens_local})")
    return int(ep_chunks)


def moe_mlp(
    x: ArrayLike,
    router_kernel: ArrayLike,
    w1: ArrayLike,
    w2: ArrayLike,
    *,
    top_k: int,
    activation: Union[str, Sequence[str]] = "gelu",
    recipe: Optional[Recipe] = None,
    state: Optional[tuple] = None,
    mesh: Optional[jax.sharding.Mesh] = None,
    expert_axis: Optional[str] = None,
    dispatch: str = "auto",
    capacity_factor: Optional[float] = None,
    ep_chunks: int = 1,
) -> jax.Array:
    """A top-k mixture-of-experts MLP on lowbit's grouped GEMM (see the module docstring).

    Args:
      x: (T, d_model) float32 or bfloat16 tokens. With a mesh: split over ``expert_axis`` on
        its first dim (T divisible by the axis size).
      router_kernel: (d_model, E) router weights (replicated).
      w1: (E, d_model, d_ff) fc1 of each expert ((E, d_model, 2 d_ff) for a gated activation,
        the two halves side by side); w2: (E, d_ff, d_model) fc2. With a mesh: split over
        ``expert_axis`` on their first dim (device i owns experts [i E/n, (i+1) E/n)).
      top_k: experts per token, 1 <= top_k <= E.
      activation: between the GEMMs, as :func:`lowbit.activation` names it (``"gelu"`` is the
        tanh approximation; ``"swiglu"`` etc. are gated).
      recipe: None: BF16 GEMMs. Float8CurrentScaling, DelayedScaling or Float8BlockScaling: FP8
        grouped GEMMs (per-expert scales, see :func:`lowbit.grouped_gemm`).
      state: DelayedScaling only: ``(fc1_state, fc2_state)``, each
        ``lowbit.init_grouped_delayed_state(recipe, E)``; with a mesh, split over
        ``expert_axis`` on their last dim. Its gradient is the updated state.
      mesh, expert_axis: expert parallelism over mesh axis ``expert_axis`` (other mesh axes hold
        replicas). Without a mesh: one device.
      dispatch: ``"ragged"`` (ragged_all_to_all; GPU only), ``"capacity"`` (dense all_to_all of
        fixed blocks) or ``"auto"`` (capacity: faster than ragged where both were measured).
      capacity_factor: None (default): buffers for the worst case, nothing dropped. A number
        f > 0: receive buffers of f times a balanced load; pairs past them are dropped (their
        contribution is zero) as the module docstring says. Ignored without a mesh.
      ep_chunks: capacity dispatch: each device's tokens in this many independent chunks (it
        must divide them), each with its own all-to-alls and GEMMs, so that the exchanges can
        overlap the other chunks' GEMMs; blocks of ``ceil(rows / ep_chunks)`` rows per chunk.
        Without drops the result is the unchunked one (the weight gradients summed over the
        chunks). Not with DelayedScaling's state. Ignored without a mesh.

    Returns:
      (T, d_model) in x's dtype, split like x.
    """
    x = as_array(x, "moe_mlp: x")
    router_kernel = as_array(router_kernel, "moe_mlp: router_kernel")
    w1, w2 = as_array(w1, "moe_mlp: w1"), as_array(w2, "moe_mlp: w2")
    _check_args(x, router_kernel, w1, w2, top_k, parse_activations(activation)[1])
    _check_capacity("moe_mlp", capacity_factor)
    if mesh is None:
        capacity_factor = None  # moe_mlp's contract: no drops on one device
    y, _ = moe_experts(
        x, (functools.partial(_softmax_route, top_k=int(top_k)), (router_kernel,)), w1, w2,
        activation=activation, recipe=recipe, state=state, mesh=mesh, expert_axis=expert_axis,
        dispatch=dispatch, capacity_factor=capacity_factor, ep_chunks=ep_chunks, name="moe_mlp",
    )  # fmt: skip
    return y


def _softmax_route(x, router_kernel, top_k):
    return (*route(x, router_kernel, top_k), ())


def _body(cfg, route_fn, path, x, route_args, w1, w2, state, extras):
    """Routes this device's tokens, runs the experts; sums the router's extra outputs over the
    expert axis (the aux loss's per-expert totals)."""
    weights, experts, extra = route_fn(x, *route_args)
    y = path(cfg, x, weights, experts, w1, w2, state, extras)
    if cfg.axis is not None:
        extra = jax.tree_util.tree_map(lambda a: jax.lax.psum(a, cfg.axis), extra)
    return y, extra


def moe_experts(
    x: ArrayLike,
    route: tuple,
    w1: ArrayLike,
    w2: ArrayLike,
    *,
    activation: Union[str, Sequence[str]] = "gelu",
    recipe: Optional[Recipe] = None,
    state: Optional[tuple] = None,
    mesh: Optional[jax.sharding.Mesh] = None,
    expert_axis: Optional[str] = None,
    dispatch: str = "auto",
    capacity_factor: Optional[float] = None,
    bias: Optional[tuple] = None,
    quantized_weights: Optional[tuple] = None,
    weights_early: bool = False,
    ep_chunks: int = 1,
    name: str = "moe_experts",
) -> tuple:
    """:func:`moe_mlp` with another router: ``route = (fn, args)``; ``fn(x, *args)`` (x this
    device's tokens; ``args`` replicated arrays) returns ``(weights (T, k) float, experts (T, k)
    int, extra)``, ``extra`` a pytree of arrays summed over the devices (e.g. the aux loss's
    per-expert totals). Returns ``(y, extra)``. The other arguments as moe_mlp's, and:
    ``capacity_factor`` on one device caps each expert at ``ceil(f * T * k / E)`` pairs (the
    first in token order; the rest add zero); ``bias``: None or ``(b1 (E, w1's last dim) or
    None, b2 (E, d_model) or None)``, split like w1;
    ``weights_early`` (one device): the weights multiply fc2's input rather than its output;
    ``ep_chunks``: as moe_mlp's (the router runs once on all of a device's tokens);
    ``quantized_weights``: None or ``(quantize_experts(w1), quantize_experts(w2))`` made
    outside the step (FP8 primary weights: the GEMMs read them instead of casting w1 / w2)."""
    x = as_array(x, f"{name}: x")
    w1, w2 = as_array(w1, f"{name}: w1"), as_array(w2, f"{name}: w2")
    gated = parse_activations(activation)[1]
    acts = (activation,) if isinstance(activation, str) else tuple(activation)
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be 2-D (tokens, d_model), got shape {tuple(x.shape)}")
    route_fn, route_args = route
    T, E = x.shape[0], w1.shape[0]
    probe = jax.eval_shape(route_fn, x, *route_args)
    k = probe[1].shape[-1]
    if probe[1].shape != (T, k) or probe[0].shape != (T, k):
        raise ValueError(
            f"{name}: the router must give weights and experts of shape (tokens, topk) = ({T}, k), "
            f"got {tuple(probe[0].shape)} and {tuple(probe[1].shape)}"
        )
    _check_weights(name, x, w1, w2, E, gated, bias)
    if quantized_weights is not None and recipe is None:
        raise ValueError(f"{name}: quantized_weights needs an FP8 recipe (recipe=None is BF16)")
    b1, b2 = (None, None) if bias is None else bias
    q1, q2 = (None, None) if quantized_weights is None else quantized_weights
    extras = None if bias is None and quantized_weights is None else (b1, b2, q1, q2)
    if dispatch not in DISPATCHES:
        raise ValueError(f"{name}: dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    _check_capacity(name, capacity_factor)
    state = _check_state(recipe, state, E)
    cfg = _MoeConfig(top_k=k, experts=E, act=acts, recipe=recipe, out_dtype=np.dtype(x.dtype))
    if mesh is None:
        if expert_axis is not None:
            raise ValueError(f"{name}: expert_axis={expert_axis!r} needs a mesh (mesh=None)")
        cap = 0 if capacity_factor is None else max(1, math.ceil(capacity_factor * T * k / E))
        cfg = dataclasses.replace(cfg, rows=cap, weights_early=bool(weights_early))
        return _body(cfg, route_fn, _local, x, route_args, w1, w2, state, extras)
    if weights_early:
        raise NotImplementedError(f"{name}: weights_early is only supported on one device (mesh=None)")

    n = _check_mesh(mesh, expert_axis, T, E)
    kind = pick_dispatch(dispatch, mesh)
    chunks = _check_chunks(name, ep_chunks, kind, state, T // n)
    rows = buffer_rows(kind, T // n, k, E, n, capacity_factor, chunks)
    cfg = dataclasses.replace(cfg, axis=expert_axis, devices=n, dispatch=kind, rows=rows, chunks=chunks)
    body = functools.partial(_body, cfg, route_fn, _ragged if kind == "ragged" else _capacity)
    tok = P(expert_axis)
    st_spec = None if state is None else jax.tree_util.tree_map(_state_spec(expert_axis), state)
    b_spec = None
    if extras is not None:
        b_spec = (
            *(None if b is None else tok for b in (b1, b2)),
            *(q and q.spec(expert_axis) for q in (q1, q2)),
        )
    args = (x, route_args, w1, w2, state, extras)
    return shard_map(body, mesh, (tok, P(), tok, tok, st_spec, b_spec), (tok, P()))(*args)


__all__ = ["DISPATCHES", "buffer_rows", "moe_experts", "moe_mlp", "route"]
