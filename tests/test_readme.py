"""README.md stays true: every ```python block runs alone, in a fresh namespace on the CPU (as a
reader pastes one), and gives what its comments say; the TransformerEngine import rule it states
turns TE's tutorial imports into working ones; the test tiers it describes select what it says."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "..", "README.md")


def readme_text() -> str:
    with open(README) as f:
        return f.read()


SNIPPETS = re.findall(r"```python\n(.*?)```", readme_text(), flags=re.S)


@functools.cache
def run_alone(i: int) -> dict:
    """Snippet ``i`` run by itself on the CPU; its namespace."""
    ns: dict = {"__name__": f"readme_snippet_{i}"}
    with jax.default_device(jax.devices("cpu")[0]):
        try:
            exec(compile(SNIPPETS[i], f"README.md python block {i}", "exec"), ns)  # noqa: S102
        except Exception as e:  # name the snippet that broke
            raise AssertionError(f"README python block {i} failed alone: {e!r}\n{SNIPPETS[i]}") from e
    return ns


def namespace_with(*names: str) -> dict:
    """The namespace of the one snippet that defines all ``names``."""
    found = [
        i for i, code in enumerate(SNIPPETS) if all(re.search(rf"^\s*{n} = ", code, re.M) for n in names)
    ]
    assert len(found) == 1, (names, found)
    return run_alone(found[0])


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def rel(got, ref) -> float:
    return float(np.linalg.norm(f64(got) - f64(ref)) / np.linalg.norm(f64(ref)))


def test_readme_has_its_snippets():
    assert len(SNIPPETS) >= 6


@pytest.mark.parametrize("i", range(len(SNIPPETS)))
def test_snippet_runs_alone(i):
    run_alone(i)


def test_quantize_snippet_gives_the_shapes_it_prints():
    ns = namespace_with("qt", "y")
    qt = ns["qt"]
    assert qt.data.shape == (256, 512) and qt.scale_inv.shape == (1,)
    assert qt.colwise_data.shape == (512, 256)
    assert ns["y"].dtype == ns["x"].dtype and rel(ns["y"], ns["x"]) < 0.05


def test_flax_snippet_keeps_delayed_scaling_state_and_trains():
    """The step's "gradient" of ``_overwrite_with_gradient`` is the new DelayedScaling state (the
    amaxes it saw, scales from them); with that state the next step's gradient is FP8-close to
    float64 (loss = mean(y^2): dL/dW = 2 x^T y / y.size)."""
    ns = namespace_with("layer", "grads")
    v, x = ns["variables"], f64(ns["x"])
    p0 = ns["layer"].init(ns["key"], ns["x"])["params"]
    state = v["_overwrite_with_gradient"]["dot_general"]
    for name, amax, fp8_max in (
        ("x", np.abs(x).max(), 448.0),
        ("kernel", np.abs(f64(p0["kernel"])).max(), 448.0),
    ):
        assert np.isclose(float(state[f"{name}_amax_history"][0]), amax, rtol=1e-6)
        assert np.isclose(float(state[f"{name}_scale"][0]), fp8_max / amax, rtol=1e-5)
    g = jax.grad(ns["loss_fn"])(v, ns["x"])
    p = v["params"]
    y = x @ f64(p["kernel"]) + f64(p["bias"])
    assert rel(g["params"]["kernel"], 2 * x.T @ y / y.size) < 0.1


FLAX_SNIPPET = next(c for c in SNIPPETS if "make_dot_general_cls(recipe)" in c and "Mesh" not in c)
OTHER_RECIPES = re.findall(
    r"(\w+)\(\)", re.search(r"# or (.*):\nrecipe = lowbit\.DelayedScaling\(\)", FLAX_SNIPPET)[1]
)


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHER_RECIPES)
def test_flax_snippet_runs_with_each_recipe_its_comment_names(name):
    code = FLAX_SNIPPET.replace("lowbit.DelayedScaling()", f"lowbit.{name}()")
    ns: dict = {}
    with jax.default_device(jax.devices("cpu")[0]):
        exec(compile(code, f"README.md Flax block with {name}", "exec"), ns)  # noqa: S102
    assert all(
        np.isfinite(np.asarray(a, np.float32)).all() for a in jax.tree_util.tree_leaves(ns["variables"])
    )
    assert set(ns["variables"]) == {"params"}  # only DelayedScaling keeps state


def test_fused_ops_snippet_matches_float64():
    ns = namespace_with("n", "a", "s")
    h = f64(ns["h"])
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    assert rel(ns["n"], (h - mu) / np.sqrt(var + 1e-6)) < 0.01
    assert rel(ns["a"], 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))) < 0.02
    s = f64(ns["s"])
    assert np.allclose(s.sum(-1), 1, atol=1e-3) and not np.triu(s[0, 0], 1).any()


def test_grouped_snippet_matches_ragged_dot_in_float64():
    ns = namespace_with("tokens", "out")
    t, w = f64(ns["tokens"]), f64(ns["experts"])
    ends = np.cumsum(np.asarray(ns["sizes"]))
    ref = np.concatenate([t[a:b] @ w[g] for g, (a, b) in enumerate(zip([0, *ends[:-1]], ends))])
    assert rel(ns["out"], ref) < 1e-2
    assert rel(ns["out_fp8"], ref) < 0.1 and rel(ns["out_blk"], ref) < 0.1


def test_multi_device_snippet_equals_the_unsharded_gradient():
    ns = namespace_with("mesh", "sharded_grads")
    ref = jax.grad(ns["loss_fn"])(ns["variables"], ns["x"])
    for name in ("kernel", "bias"):
        assert rel(ns["sharded_grads"]["params"][name], ref["params"][name]) < 1e-2


# The README's rule for a port from TransformerEngine, and import lines of TE's JAX tutorials.
TE_RULE = {"transformer_engine.jax": "lowbit.te", "transformer_engine.common": "lowbit"}
TE_TUTORIAL_IMPORTS = [
    "import transformer_engine.jax as te",
    "import transformer_engine.jax.flax as te_flax",
    "from transformer_engine.jax import flax as te_flax",
    "from transformer_engine.common import recipe",
    "import transformer_engine.common.recipe as recipe",
    "from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, "
    "MXFP8BlockScaling, NVFP4BlockScaling, Format",
    "from transformer_engine.jax.quantize import autocast",
    "from transformer_engine.jax.sharding import MeshResource, global_shard_guard",
    "from transformer_engine.jax.checkpoint_policies import checkpoint_dots_and_te_gemms",
]


def port(line: str) -> str:
    for te, lb in TE_RULE.items():
        line = line.replace(te, lb)
    return line


def test_readme_states_the_te_import_rule():
    flat = " ".join(readme_text().split())
    for te, lb in TE_RULE.items():
        assert f"`{te}` becomes `{lb}`" in flat


@pytest.mark.parametrize("line", TE_TUTORIAL_IMPORTS)
def test_te_tutorial_import_ported_by_the_rule(line):
    import lowbit.recipe
    import lowbit.te

    ns: dict = {}
    exec(port(line), ns)  # noqa: S102
    names = [n for n in ns if n != "__builtins__"]
    assert names
    for name in names:
        obj = ns[name]
        assert obj is not None, (line, name)
    if "DelayedScaling" in ns:
        assert ns["DelayedScaling"] is lowbit.recipe.DelayedScaling
    if "te" in ns:
        assert ns["te"] is lowbit.te


def test_modules_the_readme_says_lowbit_te_mirrors_import():
    import importlib

    flat = " ".join(readme_text().split())
    listed = re.search(r"The rule holds for the modules `lowbit.te` mirrors \((.*?)\)", flat)[1]
    names = re.findall(r"`(?:lowbit\.te)?\.(\w+)`", listed)
    assert len(names) >= 10, listed
    for name in names:
        importlib.import_module(f"lowbit.te.{name}")


def test_te_snippet_lines_follow_the_rule():
    """In the README's TE block each line's comment is the TE line it replaces."""
    block = next(c for c in SNIPPETS if "transformer_engine" in c)
    pairs = [
        re.split(r"\s{2,}# ", ln) for ln in block.splitlines() if re.search(r"\S\s{2,}# (import|from) ", ln)
    ]
    assert len(pairs) >= 3
    for ours, theirs in pairs:
        assert port(theirs.strip()) == ours.strip()


def test_test_tiers_select_what_the_readme_says(tmp_path):
    """Without arguments the tests marked slow are deselected; ``--all`` runs them too, ``-m``
    and a node id select regardless of the tier."""
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    gpu: gpu\n")
    (tmp_path / "test_t.py").write_text(
        "import pytest\n"
        "def test_fast(): pass\n"
        "@pytest.mark.slow\n"
        "def test_slow(): pass\n"
        "@pytest.mark.parametrize('n', [1, pytest.param(2, marks=pytest.mark.slow)])\n"
        "def test_p(n): pass\n"
    )

    def collected(*args: str) -> set:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        ).stdout
        return {ln.split("::", 1)[1] for ln in out.splitlines() if ln.startswith("test_t.py::")}

    assert collected() == {"test_fast", "test_p[1]"}
    assert collected("--all") == {"test_fast", "test_slow", "test_p[1]", "test_p[2]"}
    assert collected("test_t.py::test_slow") == {"test_slow"}


def test_multi_device_snippet_on_a_2x2_mesh_gathers_no_kernel():
    """The same block on 4 forced host devices (the tutorial's DP=2 x TP=2): the kernel's
    gradient stays column-parallel, the compiled step has no all-gather, and the gradient equals
    the unsharded one."""
    code = next(c for c in SNIPPETS if "sharded_grads = " in c)
    check = """
import re
assert tp == 2, tp
got = sharded_grads["params"]["kernel"]
assert got.sharding.spec == P(None, "tp"), got.sharding
with jax.sharding.set_mesh(mesh), lowbit.autocast(recipe, mesh_resource=mesh_resource):
    hlo = jax.jit(jax.grad(loss_fn)).lower(sharded_vars, x_sharded).compile().as_text()
assert not re.search(r"= \\S+ all-gather", hlo)
ref = jax.grad(loss_fn)(variables, x)["params"]["kernel"]
err = float(jnp.linalg.norm((got - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
assert err < 1e-2, err
print("OK")
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    src = os.path.join(HERE, "..", "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", code + check], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
