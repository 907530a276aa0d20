"""TE's ``moe()`` API as rows of the MoE bench: one fwd+bwd step of ``<te>.moe.moe`` written once
against a :class:`lowbit.bench.peers.Peer`, run on lowbit.te and, where ``transformer_engine`` is
importable, on TransformerEngine itself, with the MoE rows' tokens, router and expert weights.

Cases ``te-api moe none`` (BF16), ``te-api moe delayed`` and ``te-api moe current``: the quantizer
sets are TE's grouped ones, ``QuantizerFactory.create_set(n_quantizer_sets=2, scaling_mode=...,
n_groups=E)`` (one set for fc1, one for fc2), the tokens reshaped to TE's (B, S, H) with B = the EP
size. TE's moe() runs only on its NCCL EP path, which needs at least two ranks
(``ep_bootstrap``: world_size >= 2): ``LOWBIT_MOE_TE_EP=2`` runs both peers' rows over an ``ep``
mesh axis of two GPUs (x split over it, the experts sharded); with 1 (the default) only the
lowbit.te rows run. A peer that refuses a case (TE 2.20: grouped quantizers other than MXFP8)
has its row left out, with the reason printed, never faked.
"""

from __future__ import annotations

import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.bench.common import time_fn
from lowbit.bench.peers import lowbit_peer, te_peer

CASES = ("te-api moe none", "te-api moe delayed", "te-api moe current")
EP_ENV = "LOWBIT_MOE_TE_EP"
_MODE = {"delayed": "DELAYED_TENSOR_SCALING", "current": "CURRENT_TENSOR_SCALING"}
_PEER_TAG = {"lowbit": "lowbit.te", "te": "transformer_engine"}
_te_bootstrapped = [False]  # TE's NCCL EP communicator: once per process, re-made per shape


def ep_size() -> int:
    """The EP size of the TE-API rows (``LOWBIT_MOE_TE_EP``, default 1)."""
    raw = os.environ.get(EP_ENV, "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1 or n > jax.device_count():
        raise ValueError(
            f"moe: {EP_ENV} must be an int from 1 to {jax.device_count()} (the devices), got {raw!r}"
        )
    return n


def peers(n: int) -> list:
    """The peers that can run moe() at EP size ``n``: lowbit.te always, TE where it is installed
    and n >= 2 (its NCCL EP bootstrap refuses one rank)."""
    te = te_peer()
    if te is not None and n < 2:
        print(f"moe: TE's moe() rows left out: its NCCL EP needs >= 2 GPUs ({EP_ENV}=2)", file=sys.stderr)
        te = None
    return [lowbit_peer()] + ([te] if te is not None else [])


def count(cases) -> int:
    return len(cases) * len(peers(ep_size())) if cases else 0


def _quantizer_sets(peer, recipe: str, E: int):
    q = importlib.import_module(peer.te.__name__ + ".quantize")
    if recipe == "none":
        return (q.noop_quantizer_set, q.noop_quantizer_set)
    return q.QuantizerFactory.create_set(
        n_quantizer_sets=2,
        scaling_mode=getattr(q.ScalingMode, _MODE[recipe]),
        fwd_dtype=jnp.float8_e4m3fn,
        bwd_dtype=jnp.float8_e5m2,
        n_groups=E,
    )


def _step(peer, E: int, k: int):
    """jit(value_and_grad) of sum(moe(x, ...)) over x, the router, the experts and the sets."""
    moe = importlib.import_module(peer.te.__name__ + ".moe").moe

    def loss(x, gate, wi, wo, qsets):
        y, _, _ = moe(
            x, gate, wi, wo, num_experts=E, num_experts_per_tok=k, activation_type="silu",
            quantizer_sets=qsets, ep_axis="ep",
        )  # fmt: skip
        return jnp.sum(y.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def _te_bootstrap(T: int, H: int, E: int, k: int, n: int) -> None:
    """TE's NCCL EP communicator for this shape (eager, inside the mesh context), and the
    signature moe() checks; a previous shape's is torn down first."""
    ep = importlib.import_module("transformer_engine.jax.ep")
    te_moe = importlib.import_module("transformer_engine.jax.moe")
    if _te_bootstrapped[0]:
        ep.ep_finalize()
        _te_bootstrapped[0] = False
    per_rank = T // n
    cap = te_moe.get_moe_recv_capacity_per_rank(
        num_experts=E, num_experts_per_tok=k, max_tokens_per_rank=per_rank, ep_size=n
    )
    ep.ep_bootstrap(None, None, E, per_rank, cap, H)
    te_moe.record_ep_bootstrap_signature_for_moe(E, per_rank, cap, H, n)
    _te_bootstrapped[0] = True


def _te_ready(shape_name: str, T: int, H: int, E: int, k: int, n: int) -> bool:
    """TE's EP bootstrap for this shape; False (the reason printed) where it cannot start."""
    try:
        _te_bootstrap(T, H, E, k, n)
    except Exception as e:  # noqa: BLE001 - e.g. a TE build without the borrowed-comm EP path
        print(
            f"moe: {shape_name} TE moe() rows left out: ep_bootstrap: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return False
    return True


def _place(mesh, x, gate, wi, wo, n: int):
    """x as TE's (B, S, H), B = n split over ``ep``; the experts sharded over it; gate replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    T, H = x.shape
    ep3 = NamedSharding(mesh, P("ep", None, None))
    return (
        jax.device_put(x.reshape(n, T // n, H), ep3),
        jax.device_put(gate, NamedSharding(mesh, P())),
        jax.device_put(wi, ep3),
        jax.device_put(wo, ep3),
    )


def rows(shape_name: str, dims: tuple, operands: tuple, cases, iters: int, progress=None) -> list:
    """The TE-API rows of one shape ``dims`` = (T, H, E, F, k) for the selected ``cases``: dicts
    with the MoE rows' keys (floor_ms, weight_GB and vs_bf16 filled in by the caller) plus
    ``peer`` and ``note``."""
    T, H, E, F, k = dims
    if not cases:
        return []
    n = ep_size()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("ep",))
    flops = 3 * 2.0 * T * k * H * 3 * F
    out = []
    for peer in peers(n):
        tag = _PEER_TAG[peer.name]
        with peer.context(mesh, resource={"ep_resource": "ep"}):
            if peer.name == "te" and not _te_ready(shape_name, T, H, E, k, n):
                for _ in cases if progress else ():
                    progress()
                continue
            args = _place(mesh, *operands, n)
            for case in cases:
                recipe = case.rsplit(" ", 1)[-1]
                try:
                    qsets = _quantizer_sets(peer, recipe, E)
                    ms = time_fn(_step(peer, E, k), *args, qsets, warmup=2, iters=iters, repeats=3)
                except Exception as e:  # noqa: BLE001 - only a foreign peer's refusal is skipped
                    if peer.name == "lowbit":
                        raise
                    print(
                        f"moe: {shape_name} {case} [{tag}] left out: {type(e).__name__}: {e}", file=sys.stderr
                    )
                    continue
                finally:
                    if progress:
                        progress()
                fp8 = recipe != "none"
                out.append(
                    {
                        "name": f"{shape_name} {case} [{tag}]",
                        "shape": f"T={T} H={H} E={E} F={F} k={k}",
                        "case": case,
                        "peer": tag,
                        "ms": ms,
                        "TFLOPs": flops / (ms * 1e-3) / 1e12,
                        "weights": "cast in step" if fp8 else "bf16",
                        "note": _note(peer.name, n),
                    }
                )
    return out


def _note(peer: str, n: int) -> str:
    where = f"ep={n} over {n} devices" if n > 1 else "one device"
    if peer == "te":
        return f"TE moe(): {where}, NCCL EP dispatch, experts' tokens padded to 128"
    return f"TE-API moe() on lowbit.te: {where}"
