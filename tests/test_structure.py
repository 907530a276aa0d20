"""The package's structure, read from the sources (an AST walk over src/lowbit, nothing imported):
no import cycle between lowbit's modules, every custom_vjp / custom_jvp built once at module
level, no source file over 600 lines (the benchmarks excepted), and the layers of lowbit.ops
(docstring of src/lowbit/ops/__init__.py) standing on lowbit.quantization, which imports none
of them."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
MAX_LINES = 600

# Known offenders with a reason (empty: none). An entry that no longer offends fails
# test_allow_lists_hold_only_offenders.
OVERSIZE_ALLOWED: set = set()
TE_IMPORT_ALLOWED: set = set()


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every module of the lowbit package."""
    mods = {}
    for path in sorted((SRC / "lowbit").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imports(name: str) -> set[str]:
    """The lowbit modules ``name`` imports, at module level or inside functions alike.

    ``from pkg import sub`` counts as an import of the submodule ``pkg.sub`` when there is one,
    else of ``pkg``; ``import a.b.c`` of the longest prefix that is a lowbit module."""
    is_pkg = MODULES[name].name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in MODULES:
                    target = target.rpartition(".")[0]
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    found.add(f"{source}.{alias.name}")
                elif source in MODULES:
                    found.add(source)
    found.discard(name)
    return found


EDGES = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for root in sorted(EDGES):
        if root in index:
            continue
        work = [(root, iter(sorted(EDGES[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(EDGES[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle():
    cycles = _cycles()
    assert not cycles, f"import cycles among lowbit modules (module- and function-level imports): {cycles}"


def test_cycle_finder_sees_a_function_level_import():
    """The walk counts an import inside a function body as an edge (the late import that made
    quantization.tensor -> ops.quantize -> quantization.tensor a cycle)."""
    tree = ast.parse("def f():\n    from lowbit.ops.quantize import dequantize\n")
    saved = TREES["lowbit.quantization.tensor"]
    TREES["lowbit.quantization.tensor"] = tree
    try:
        assert "lowbit.ops.quantize" in _imports("lowbit.quantization.tensor")
    finally:
        TREES["lowbit.quantization.tensor"] = saved


def _vjp_inside_functions(tree: ast.AST) -> list[int]:
    """Lines where custom_vjp / custom_jvp is named inside a function body (a decorator of a
    nested function, a call, or functools.partial's argument): rebuilt on every call."""
    names = {"custom_vjp", "custom_jvp"}
    lines = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        body = fn.body if isinstance(fn.body, list) else [fn.body]
        for stmt in body:
            for node in ast.walk(stmt):
                if (isinstance(node, ast.Attribute) and node.attr in names) or (
                    isinstance(node, ast.Name) and node.id in names
                ):
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_custom_vjp_built_at_module_level():
    found = {name: lines for name, tree in TREES.items() if (lines := _vjp_inside_functions(tree))}
    assert not found, f"custom_vjp/custom_jvp created inside a function (module: lines): {found}"


def test_vjp_finder_sees_a_closure():
    tree = ast.parse("import jax\ndef op(x):\n    @jax.custom_vjp\n    def f(x):\n        return x\n")
    assert _vjp_inside_functions(tree) == [3]
    assert _vjp_inside_functions(ast.parse("import jax\n@jax.custom_vjp\ndef f(x):\n    return x\n")) == []


def _oversize() -> dict[str, int]:
    out = {}
    for path in MODULES.values():
        rel = path.relative_to(SRC).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and not rel.startswith("lowbit/bench/"):
            out[rel] = n
    return out


def test_no_file_over_600_lines():
    over = {rel: n for rel, n in _oversize().items() if rel not in OVERSIZE_ALLOWED}
    assert not over, f"files over {MAX_LINES} lines (split them along their seams): {over}"


def _importers(prefixes: tuple[str, ...], of: str) -> dict[str, set[str]]:
    """Modules under ``of`` and what they import under any of ``prefixes``."""
    out = {}
    for name, targets in EDGES.items():
        if name == of or name.startswith(of + "."):
            bad = {t for t in targets if any(t == p or t.startswith(p + ".") for p in prefixes)}
            if bad:
                out[name] = bad
    return out


def test_quantization_is_the_ground_floor():
    bad = _importers(("lowbit.ops", "lowbit.flax", "lowbit.te"), "lowbit.quantization")
    assert not bad, f"lowbit.quantization must not import the layers above it: {bad}"


def test_ops_layers_import_downward():
    bad = _importers(("lowbit.ops",), "lowbit.ops._ffi")
    bad = {m: {t for t in ts if not t.startswith("lowbit.ops._ffi")} for m, ts in bad.items()}
    bad = {m: ts for m, ts in bad.items() if ts}
    assert not bad, f"lowbit.ops._ffi must import nothing from the ops above it: {bad}"
    above = {
        m: ts
        for m, ts in _importers(("lowbit.ops.fused",), "lowbit.ops").items()
        if not m.startswith("lowbit.ops.fused")
    }
    assert not above, f"the ops must not import the fused compositions above them: {above}"
    native = {m for m in _importers(("lowbit._native",), "lowbit.ops") if not m.startswith("lowbit.ops._ffi")}
    assert not native, (
        f"only lowbit.ops._ffi makes FFI calls (imports lowbit._native) in lowbit.ops: {native}"
    )


def test_moe_layer_sits_between_ops_and_flax():
    """lowbit.moe drives lowbit.ops (its fused moe engine) and is used by lowbit.flax / lowbit.te."""
    up = _importers(("lowbit.flax", "lowbit.te"), "lowbit.moe")
    down = {m: ts for m, ts in _importers(("lowbit.moe",), "lowbit.ops").items()}
    assert not up and not down, f"lowbit.moe layering broken: {up or down}"


def _te_importers() -> dict[str, set[str]]:
    out = _importers(("lowbit.te",), "lowbit")
    return {m: ts for m, ts in out.items() if not m.startswith(("lowbit.te", "lowbit.bench"))}


def test_core_does_not_import_the_te_layer():
    bad = {m: ts for m, ts in _te_importers().items() if m not in TE_IMPORT_ALLOWED}
    assert not bad, f"only lowbit.te (and the benchmarks) may import lowbit.te: {bad}"


def test_allow_lists_hold_only_offenders():
    stale = (OVERSIZE_ALLOWED - set(_oversize())) | (TE_IMPORT_ALLOWED - set(_te_importers()))
    assert not stale, f"no longer offending: remove {sorted(stale)} from the allow-lists above"
