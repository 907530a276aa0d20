"""Compare ``lowbit.te`` against the TE API snapshot (tests/data/te_api.json, written by
scripts/te_api_snapshot.py from TE's wheel) and render docs/te_compat.md's name table.

    python tests/te_api_diff.py --write   # regenerate the table in docs/te_compat.md

Per name: "same" (present; TE's parameters/fields present with TE's defaults and TE's positional
order; enum members present), "differs" (with what differs), "refused" (absent on purpose:
REFUSED gives the reason) or "missing". Defaults are compared where TE's default is a literal or a
dotted name (last component against the default's name);
other defaults (calls, lambdas) are not compared.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "data" / "te_api.json"
DOC = ROOT / "docs" / "te_compat.md"
BEGIN, END = "<!-- te_api table: begin -->", "<!-- te_api table: end -->"
_FLAX_INTERNAL = {"parent", "name"}


# Names lowbit.te leaves out on purpose (status "refused" while absent), by module prefix or
# (module, name), with the reason docs/te_compat.md gives.
_MOE = "MoE (router, permutation, expert parallelism, grouped GEMM): the MoE issue's helper"
_ATTN = "sequence packing, fused attention, context parallelism: the attention-features helper"
REFUSED = {
    "cpp_extensions": "TE's kernel entry points and primitives (internal): use lowbit.dense, "
    "lowbit.quantize, lowbit.layernorm, lowbit.activation, lowbit.softmax",
    "triton_extensions": "TE's Triton permutation kernels (internal)",
    "router": _MOE,
    "permutation": _MOE,
    "moe": _MOE,
    "ep": _MOE,
    "flax.moe": _MOE,
    "cpp_extensions.router": _MOE,
    "cpp_extensions.ep": _MOE,
    "cpp_extensions.topk": _MOE,
    ("dense", "grouped_dense"): _MOE,
    ("flax", "_MoEBlock"): _MOE,
    ("flax", "make_grouped_dense_cls"): _MOE,
    ("flax.module", "make_grouped_dense_cls"): _MOE,
    "debug": "TE's tensor-dump debugging: no lowbit counterpart",
    "quantize.tensor": "TE's quantized-tensor classes: use lowbit.ScaledTensor",
    "quantize.dequantizer": "use lowbit.dequantize",
    "quantize.hadamard": "lowbit applies the RHT inside its NVFP4 quantizer",
    "quantize.device_utils": "use lowbit.capabilities",
    "quantize.metadata": "quantizer state is a QuantizerSet's leaves in lowbit.te",
    ("quantize.quantizer", "BlockScaleQuantizer"): "quantizers only describe in lowbit.te: QuantizerSet",
    ("quantize.quantizer", "CurrentScaleQuantizer"): "quantizers only describe in lowbit.te: QuantizerSet",
    ("quantize.quantizer", "DelayedScaleQuantizer"): "quantizers only describe in lowbit.te: QuantizerSet",
    ("quantize.quantizer", "GroupedQuantizer"): _MOE,
    ("quantize.scaling_modes", "QuantizeShardyRules"): "TE's Shardy rules for its primitives (internal)",
    ("attention", "SequenceDescriptor"): _ATTN,
    ("attention", "fused_attn"): _ATTN,
    ("attention", "fused_attn_thd"): _ATTN,
    ("attention", "reorder_causal_load_balancing"): _ATTN,
    ("attention", "inverse_reorder_causal_load_balancing"): _ATTN,
    ("attention", "is_fused_attn_kernel_available"): _ATTN,
    ("attention", "run_length_fill_flattened"): _ATTN,
}


def refusal(short: str, name: str):
    """The reason a missing name is left out, or None."""
    if (short, name) in REFUSED:
        return REFUSED[(short, name)]
    parts = short.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in REFUSED:
            return REFUSED[".".join(parts[:i])]
    return None


def load_snapshot() -> dict:
    return json.loads(SNAPSHOT.read_text())


def _lowbit_module(short: str):
    name = "lowbit.te" if short == "." else f"lowbit.te.{short}"
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _norm(v):
    if isinstance(v, list):
        return tuple(_norm(x) for x in v)
    if isinstance(v, tuple):
        return tuple(_norm(x) for x in v)
    return v


def _named_in_lowbit(name: str, ours) -> bool:
    # TE's default is a module-level object (noop_quantizer_set, tex.noop_collective_op_set):
    # ours must be the object lowbit.te binds to that name.
    mods = (
        "lowbit.te.quantize",
        "lowbit.te.cpp_extensions",
        "lowbit.te.attention",
        "lowbit.te.softmax",
        "lowbit.te.moe",
    )
    for mod in mods:
        obj = getattr(importlib.import_module(mod), name, inspect.Parameter.empty)
        if obj is not inspect.Parameter.empty and (obj is ours or obj == ours):
            return True
    return False


def default_matches(te_src, ours) -> bool | None:
    """True/False where TE's default can be compared with ours; None where it cannot."""
    if ours is inspect.Parameter.empty or ours is dataclasses.MISSING:
        return te_src is None
    if te_src is None:
        return True  # TE requires it; a default of ours breaks no TE call
    try:
        te = ast.literal_eval(te_src)
    except (ValueError, SyntaxError):
        node = ast.parse(te_src, mode="eval").body
        if not isinstance(node, (ast.Name, ast.Attribute)):
            return None
        last = te_src.split(".")[-1]
        if isinstance(ours, enum.Enum):
            return ours.name == last
        if isinstance(ours, str):  # a string that names TE's enum member ("scaled" ~ SCALED)
            low = last.lower()
            return low == ours.lower() or low.startswith(ours.lower() + "_")
        if getattr(ours, "__name__", None) == last or _named_in_lowbit(last, ours):
            return True
        return None if callable(ours) else False
    if te is None and callable(ours):
        return None  # TE fills a None initialiser in __post_init__; ours is that initialiser
    if isinstance(ours, enum.Enum):
        return te in (ours.value, ours.name) or str(te).lower() == ours.name.lower()
    return type(te) is type(ours) and _norm(te) == _norm(ours)


def _our_params(obj):
    """[(name, default, kind)] of a callable, or of a dataclass (Flax module) as fields."""
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        out = []
        for f in dataclasses.fields(obj):
            if f.name in _FLAX_INTERNAL:
                continue
            d = f.default
            if d is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
                d = f.default_factory()
            out.append((f.name, d, "field"))
        return out
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    kinds = {
        inspect.Parameter.VAR_POSITIONAL: "var_positional",
        inspect.Parameter.VAR_KEYWORD: "var_keyword",
        inspect.Parameter.KEYWORD_ONLY: "keyword",
    }
    return [(p.name, p.default, kinds.get(p.kind, "positional")) for p in sig.parameters.values()]


def _compare_params(te_params, ours, positional_order: bool) -> list:
    if ours is None:
        return ["no signature"]
    diffs = []
    ours_by_name = {n: (d, k) for n, d, k in ours}
    has_var_kw = any(k == "var_keyword" for _, _, k in ours)
    for i, (name, te_default, te_kind) in enumerate(te_params):
        if te_kind.startswith("var_"):
            continue
        if name not in ours_by_name:
            if not has_var_kw:
                diffs.append(f"no `{name}`")
            continue
        d, kind = ours_by_name[name]
        if positional_order and te_kind == "positional" and (i >= len(ours) or ours[i][0] != name):
            diffs.append(f"`{name}` not at position {i}")
        if default_matches(te_default, d) is False:
            shown = "required" if d in (inspect.Parameter.empty, dataclasses.MISSING) else repr(d)
            diffs.append(f"`{name}` default {shown} (TE {te_default or 'required'})")
    return diffs


def compare_entry(module, name: str, te: dict, short: str = "") -> tuple:
    """(status, notes) of one TE name against lowbit.te (``short``: TE's module, for refusals)."""
    if module is None or not hasattr(module, name):
        why = refusal(short, name)
        return ("refused", why) if why else ("missing", "")
    obj = getattr(module, name)
    kind = te["kind"]
    if kind == "module":
        return ("same", "") if isinstance(obj, types.ModuleType) else ("differs", "not a module")
    if kind == "enum":
        if not (isinstance(obj, type) and issubclass(obj, enum.Enum)):
            return "differs", "not an enum"
        absent = [m for m in te["members"] if m not in obj.__members__]
        return ("differs", "no members " + ", ".join(absent)) if absent else ("same", "")
    if kind == "function" or (kind == "class" and ("params" in te or "fields" in te)):
        te_params = te.get("params") or [[n, d, "field"] for n, d in te.get("fields", [])]
        diffs = _compare_params(te_params, _our_params(obj), positional_order="fields" not in te)
        return ("differs", "; ".join(diffs)) if diffs else ("same", "")
    return "same", ""


def compare_all(snapshot: dict | None = None) -> dict:
    """{module: {name: (status, notes)}} for every name of the snapshot."""
    snapshot = snapshot or load_snapshot()
    out = {}
    for short, entries in snapshot["modules"].items():
        mod = _lowbit_module(short)
        out[short] = {n: compare_entry(mod, n, te, short) for n, te in entries.items()}
    # A package's re-export of a name its submodule defines shares that name's refusal.
    for short, entries in out.items():
        for name, (status, _) in entries.items():
            if status != "missing":
                continue
            for sub, sub_entries in out.items():
                if sub.startswith(short + ".") and sub_entries.get(name, ("",))[0] == "refused":
                    entries[name] = sub_entries[name]
                    break
    return out


def counts(result: dict) -> dict:
    c = {"same": 0, "differs": 0, "refused": 0, "missing": 0}
    for entries in result.values():
        for status, _ in entries.values():
            c[status] += 1
    return c


def render(result: dict, version: str) -> str:
    c = counts(result)
    lines = [
        BEGIN,
        f"Generated by `python tests/te_api_diff.py --write` against TE {version}'s API snapshot "
        "(tests/data/te_api.json): "
        f"{c['same']} same, {c['differs']} differ, {c['refused']} left out on purpose (reason "
        f"given), {c['missing']} missing, of {sum(c.values())}.",
        "",
        "| module | name | status | notes |",
        "|---|---|---|---|",
    ]
    for short, entries in result.items():
        for name, (status, notes) in entries.items():
            notes = notes.replace("|", "\\|")
            lines.append(f"| `{short}` | `{name}` | {status} | {notes} |")
    lines.append(END)
    return "\n".join(lines)


def write_doc() -> None:
    snap = load_snapshot()
    table = render(compare_all(snap), snap["version"])
    text = DOC.read_text()
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + table + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Every name of TE's JAX package\n\n" + table + "\n"
    DOC.write_text(text)


if __name__ == "__main__":
    if "--write" in sys.argv:
        write_doc()
    print(counts(compare_all()))
