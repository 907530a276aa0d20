"""Checkpoint interchange with TransformerEngine's Flax modules.

Parameters already carry TE's names and shapes (``kernel``, ``wi_kernel``, ``qkv/...``), so a TE
``params`` tree loads as it is. The DelayedScaling state differs in where it lives:

* TE (2.20): collection ``fp8_metas``; in the scope of the module that runs the GEMM, one
  ``{x,kernel,grad}{postfix}_{amax_history (L,), scale (1,)}`` per quantizer, postfix ""
  for ``DenseGeneral`` / ``LayerNormDenseGeneral``, "_0" (``wi``) and "_1" (``wo``) for
  ``LayerNormMLP``.
* lowbit: collection ``_overwrite_with_gradient``; the same leaves without the postfix, one
  level down in the GEMM's op scope: ``dense_op``, ``wi_op``, ``wo_op``.

:func:`from_te` and :func:`to_te` convert whole variable trees (other collections untouched).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from flax.core import unfreeze

from lowbit.flax import OVERWRITE_WITH_GRADIENT

#: TE 2.20's NVTE_FP8_COLLECTION_NAME, where its modules keep DelayedScaling state.
TE_FP8_COLLECTION = "fp8_metas"
#: TE's quantizer-set postfix of each GEMM -> lowbit's op scope.
POSTFIX_TO_OP = {"": "dense_op", "_0": "wi_op", "_1": "wo_op"}
_OP_TO_POSTFIX = {op: p for p, op in POSTFIX_TO_OP.items()}
_TE_LEAF = re.compile(r"^(x|kernel|grad)(_\d+)?_(amax_history|scale)$")
_OUR_LEAF = re.compile(r"^(x|kernel|grad)_(amax_history|scale)$")


def _te_scope_to_ours(tree: Mapping, path: str) -> dict:
    out: dict = {}
    for key, value in tree.items():
        m = _TE_LEAF.match(key) if not isinstance(value, Mapping) else None
        if m is None:
            if not isinstance(value, Mapping):
                raise ValueError(f"{TE_FP8_COLLECTION}{path}/{key}: not a TE quantizer variable")
            out[key] = _te_scope_to_ours(value, f"{path}/{key}")
            continue
        role, postfix, kind = m.group(1), m.group(2) or "", m.group(3)
        if postfix not in POSTFIX_TO_OP:
            raise ValueError(
                f"{TE_FP8_COLLECTION}{path}/{key}: postfix {postfix!r} has no lowbit module "
                f"counterpart (known: {sorted(POSTFIX_TO_OP)})"
            )
        out.setdefault(POSTFIX_TO_OP[postfix], {})[f"{role}_{kind}"] = value
    return out


def _our_scope_to_te(tree: Mapping, path: str) -> dict:
    out: dict = {}
    for key, value in tree.items():
        if key in _OP_TO_POSTFIX and isinstance(value, Mapping):
            for leaf, v in value.items():
                m = _OUR_LEAF.match(leaf)
                if m is None:
                    raise ValueError(
                        f"{OVERWRITE_WITH_GRADIENT}{path}/{key}/{leaf}: no TE counterpart (TE keeps one "
                        "state per module; lowbit's '_call<i>' states of a shared module have none)"
                    )
                out[f"{m.group(1)}{_OP_TO_POSTFIX[key]}_{m.group(2)}"] = v
        elif isinstance(value, Mapping):
            sub = _our_scope_to_te(value, f"{path}/{key}")
            if sub:
                out[key] = sub
    return out


def _strip_ops(tree: Mapping) -> dict:
    # What stays in lowbit's collection once the module states moved (TE-style wrapper state).
    out = {}
    for key, value in tree.items():
        if key in _OP_TO_POSTFIX and isinstance(value, Mapping):
            continue
        if isinstance(value, Mapping):
            sub = _strip_ops(value)
            if sub:
                out[key] = sub
        else:
            out[key] = value
    return out


def from_te(variables: Mapping[str, Any]) -> dict:
    """A TE module's variables (``params``, ``fp8_metas``, ...) -> lowbit's module's."""
    out = {k: v for k, v in unfreeze(variables).items() if k != TE_FP8_COLLECTION}
    if TE_FP8_COLLECTION in variables:
        ours = _te_scope_to_ours(unfreeze(variables[TE_FP8_COLLECTION]), "")
        out[OVERWRITE_WITH_GRADIENT] = _merge(out.get(OVERWRITE_WITH_GRADIENT, {}), ours)
    return out


def to_te(variables: Mapping[str, Any]) -> dict:
    """lowbit's module's variables -> those of the TE module with the same fields."""
    out = {k: v for k, v in unfreeze(variables).items() if k != OVERWRITE_WITH_GRADIENT}
    if OVERWRITE_WITH_GRADIENT in variables:
        ours = unfreeze(variables[OVERWRITE_WITH_GRADIENT])
        te = _our_scope_to_te(ours, "")
        if te:
            out[TE_FP8_COLLECTION] = te
        rest = _strip_ops(ours)
        if rest:
            out[OVERWRITE_WITH_GRADIENT] = rest
    return out


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


__all__ = ["POSTFIX_TO_OP", "TE_FP8_COLLECTION", "from_te", "to_te"]
