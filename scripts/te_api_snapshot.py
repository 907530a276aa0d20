"""Snapshot of TransformerEngine's JAX API, read from its source with ``ast`` (no TE import, so it
runs without a GPU or TE's native library).

    python scripts/te_api_snapshot.py <dir holding transformer_engine/> tests/data/te_api.json

For every module of ``transformer_engine/jax`` and every public name it exports (its ``__all__``
where it has one, else its top-level defs and classes, star imports followed): the kind and
either the parameters (name, default source) of a function or of a class's ``__init__``, the
fields of a Flax module / dataclass (inherited ones first), or an enum's members.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

# Helper modules of TE's build or its kernels' dispatch, not API.
SKIP_MODULES = ("setup", "version_utils")


def _default_src(node):
    return None if node is None else ast.unparse(node)


def _params(fn: ast.FunctionDef, drop_self: bool) -> list:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [[p.arg, _default_src(d), "positional"] for p, d in zip(positional, defaults)]
    if a.vararg:
        out.append([a.vararg.arg, None, "var_positional"])
    out += [[p.arg, _default_src(d), "keyword"] for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append([a.kwarg.arg, None, "var_keyword"])
    return out[1:] if drop_self and out else out


class _Module:
    """One parsed TE module: its definitions and where its imported names come from."""

    def __init__(self, root: Path, dotted: str):
        self.dotted = dotted
        path = root / (dotted.replace(".", "/") + ".py")
        if not path.exists():
            path = root / dotted.replace(".", "/") / "__init__.py"
        self.is_package = path.name == "__init__.py"
        self.tree = ast.parse(path.read_text())
        self.defs = {}
        self.imports = {}  # name -> (module dotted, original name)
        self.stars = []
        self.all = None
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        if t.id == "__all__":
                            self.all = [ast.literal_eval(e) for e in node.value.elts]
                        else:
                            self.defs[t.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.defs[node.target.id] = node
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = self.dotted.split(".")
                base = base if self.is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                src = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    if alias.name == "*":
                        self.stars.append(src)
                    elif node.module is None:  # "from . import flax": a submodule
                        self.imports[alias.asname or alias.name] = (src + "." + alias.name, None)
                    else:
                        self.imports[alias.asname or alias.name] = (src, alias.name)


class Snapshot:
    def __init__(self, root: Path):
        self.root = root
        self.cache = {}

    def module(self, dotted: str) -> _Module:
        if dotted not in self.cache:
            self.cache[dotted] = _Module(self.root, dotted)
        return self.cache[dotted]

    def exported(self, dotted: str) -> list:
        m = self.module(dotted)
        if m.all is not None:
            return list(m.all)
        names = [n for n in m.defs if not n.startswith("_") and not isinstance(m.defs[n], ast.Assign)]
        for star in m.stars:
            names += [n for n in self.exported(star) if n not in names]
        return names

    def resolve(self, dotted: str, name: str, depth: int = 0):
        """(module, ast node) defining ``name`` as seen from ``dotted``; node None for a submodule."""
        m = self.module(dotted)
        if name in m.defs:
            return dotted, m.defs[name]
        if name in m.imports and depth < 8:
            src, orig = m.imports[name]
            if orig is None:
                return src, None
            try:
                return self.resolve(src, orig, depth + 1)
            except (FileNotFoundError, KeyError):
                return src, "external"
        for star in m.stars:
            if name in self.exported(star):
                return self.resolve(star, name, depth + 1)
        raise KeyError(f"{dotted}.{name}")

    def _fields(self, dotted: str, cls: ast.ClassDef) -> list:
        inherited = []
        for base in cls.bases:
            if not isinstance(base, ast.Name):  # nn.Module and other outside bases
                continue
            try:
                bmod, bnode = self.resolve(dotted, base.id)
            except (KeyError, FileNotFoundError):
                continue
            if isinstance(bnode, ast.ClassDef) and bnode is not cls:
                inherited += self._fields(bmod, bnode)
        own = [
            [n.target.id, _default_src(n.value)]
            for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        ]
        names = {f[0] for f in own}
        return [f for f in inherited if f[0] not in names] + own

    def describe(self, dotted: str, name: str) -> dict:
        mod, node = self.resolve(dotted, name)
        if node is None:
            return {"kind": "module", "target": mod}
        if node == "external":
            return {"kind": "external", "target": mod}
        if isinstance(node, ast.FunctionDef):
            return {"kind": "function", "params": _params(node, drop_self=False)}
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            return {"kind": "constant", "value": _default_src(node.value)}
        bases = [ast.unparse(b) for b in node.bases]
        if any(b.split(".")[-1] in ("Enum", "IntEnum", "DeprecatedEnum") for b in bases):
            members = [
                t.id
                for n in node.body
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name) and not t.id.startswith("_")
            ]
            return {"kind": "enum", "members": members}
        fields = self._fields(mod, node)
        methods = sorted(
            n.name for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
        )
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        out = {"kind": "class", "bases": bases, "methods": methods}
        if init is not None:
            out["params"] = _params(init, drop_self=True)
        elif fields:
            out["fields"] = fields
        return out


def modules(root: Path) -> list:
    base = root / "transformer_engine" / "jax"
    out = []
    for p in sorted(base.rglob("*.py")):
        rel = p.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] in SKIP_MODULES:
            continue
        out.append(".".join(parts))
    return out


def snapshot(root: Path) -> dict:
    snap = Snapshot(root)
    api = {}
    for dotted in modules(root):
        short = dotted[len("transformer_engine.jax") :].lstrip(".") or "."
        entries = {}
        for name in snap.exported(dotted):
            try:
                entries[name] = snap.describe(dotted, name)
            except (KeyError, FileNotFoundError):
                entries[name] = {"kind": "external"}
        api[short] = entries
    return api


if __name__ == "__main__":
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    data = {"modules": snapshot(src)}
    dist = sorted(src.glob("transformer_engine_jax-*.dist-info"))
    data["version"] = dist[0].name[: -len(".dist-info")].split("-")[1] if dist else "unknown"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{dst}: {sum(len(v) for v in data['modules'].values())} names in {len(data['modules'])} modules")
