"""examples/convergence.py on tiny shapes (dense and MoE), and the NVFP4 recipe's per-layer
precision."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit import abi
from lowbit import recipe as R

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PATH = os.path.join(_REPO, "examples", "convergence.py")


@pytest.fixture(scope="module")
def conv():
    spec = importlib.util.spec_from_file_location("convergence", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_layer_recipe_defaults_and_validation():
    n = R.NVFP4BlockScaling()
    assert [n.layer_recipe(i, 4) for i in range(4)] == [None, n, n, None]  # first and last in BF16
    keep = R.NVFP4BlockScaling(
        high_precision_first_layers=1,
        high_precision_last_layers=2,
        high_precision_recipe=R.MXFP8BlockScaling(),
    )
    mx, nv = "MXFP8BlockScaling", "NVFP4BlockScaling"
    assert [type(keep.layer_recipe(i, 5)).__name__ for i in range(5)] == [mx, nv, nv, mx, mx]
    every = R.NVFP4BlockScaling(high_precision_first_layers=0, high_precision_last_layers=0)
    assert all(every.layer_recipe(i, 3) is every for i in range(3))
    m = R.MXFP8BlockScaling()
    assert m.layer_recipe(3, 4) is m  # FP8 recipes quantize every layer
    with pytest.raises(ValueError, match="layer must be in"):
        n.layer_recipe(4, 4)
    with pytest.raises(ValueError, match="high_precision_last_layers"):
        R.NVFP4BlockScaling(high_precision_last_layers=-1)
    with pytest.raises(TypeError, match="high_precision_recipe"):
        R.NVFP4BlockScaling(high_precision_recipe=R.NVFP4BlockScaling())
    same = R.NVFP4BlockScaling(
        high_precision_first_layers=1,
        high_precision_last_layers=2,
        high_precision_recipe=R.MXFP8BlockScaling(),
    )
    assert hash(keep) == hash(same) and keep == same and keep != n


def _quantized_layers(conv, recipe, cfg=None):
    """Module paths of the blocks whose Dense layers run lowbit's dot_general."""
    cfg = cfg or conv.SMALL
    model = conv.ByteLM(cfg, recipe)
    tokens = jnp.zeros((2, cfg.seq), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)  # shapes only: fast
    seen = set()

    def spy(next_fun, args, kwargs, context):
        if type(context.module).__name__.startswith("LowbitWrapper"):
            seen.add(context.module.path[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(spy):  # runs at trace time
        jax.eval_shape(model.apply, variables, tokens)
    return seen


def test_nvfp4_default_keeps_first_and_last_layer_bf16(conv):
    n = conv.SMALL.n_layers
    assert _quantized_layers(conv, lowbit.NVFP4BlockScaling()) == {f"block{i}" for i in range(1, n - 1)}
    assert _quantized_layers(conv, conv.RECIPES["nvfp4-all"]()) == {f"block{i}" for i in range(n)}
    assert _quantized_layers(conv, lowbit.MXFP8BlockScaling()) == {f"block{i}" for i in range(n)}
    assert _quantized_layers(conv, None) == set()


@pytest.mark.slow
def test_script_runs_and_every_recipe_learns(conv):
    rows = conv.run(list(conv.DEFAULT_RECIPES), [0], 12, conv.SMALL, log=lambda s: None)
    assert [r["recipe"] for r in rows] == list(conv.DEFAULT_RECIPES)
    for r in rows:
        assert r["last"] < r["first"] - 0.5, r
        assert jnp.isfinite(r["held"]), r
    assert "| nvfp4 |" in conv.table(rows) and "gap vs bf16" in conv.table(rows)


# ---------------------------------------------------------------------------------------------
# --model moe: MoEBlock MLPs, their expert GEMMs on lowbit's grouped GEMM under each recipe
# ---------------------------------------------------------------------------------------------
_GROUPED = re.compile(r"@lowbit_grouped_gemm\(.*flags = (\d+) : i32.*\} : \(tensor<([^>]*)>, tensor<([^>]*)>")


def _grouped_gemms(conv, recipe):
    """(flags, lhs dtype, rhs dtype) of every grouped GEMM in one training step's gradient
    (read from the lowered program: what the step really runs, forward and backward)."""
    cfg = conv.SMALL_MOE
    model = conv.ByteLM(cfg, recipe)
    tokens = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
    variables = model.init(jax.random.PRNGKey(0), tokens)
    params = variables.pop("params")

    def loss(params, state):
        logits, aux = model.apply({"params": params, **state}, tokens)
        return conv.xent(logits, tokens) + aux

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, variables).as_text()
    return [
        (int(m.group(1)), m.group(2).split("x")[-1], m.group(3).split("x")[-1])
        for m in map(_GROUPED.search, text.splitlines())
        if m
    ]


@pytest.mark.parametrize("name", ["bf16", "delayed", "current", "block"])
def test_moe_expert_gemms_are_quantized(conv, name):
    assert set(conv.MOE_RECIPES) == {"bf16", "delayed", "current", "block"}
    recipe = conv.RECIPES[name]()
    gemms = _grouped_gemms(conv, recipe)
    # Per MoE layer: fc1 and fc2 forward, their dgrads and their wgrads.
    assert len(gemms) == 6 * conv.SMALL_MOE.n_layers, gemms
    blocked = {bool(flags & abi.GROUPED_BLOCK_SCALED) for flags, _, _ in gemms}
    operands = {t for _, a, b in gemms for t in (a, b)}
    if recipe is None:
        assert operands == {"bf16"} and blocked == {False}
    else:
        assert operands <= {"f8E4M3FN", "f8E5M2"}, operands  # every expert GEMM reads FP8
        assert blocked == {name == "block"}
    # The attention projections quantize as in the dense model.
    n = conv.SMALL_MOE.n_layers
    want = set() if recipe is None else {f"block{i}" for i in range(n)}
    assert _quantized_layers(conv, recipe, conv.SMALL_MOE) == want


def test_moe_script_every_recipe_learns(conv):
    rows = conv.run(list(conv.MOE_RECIPES), [0], 10, conv.SMALL_MOE, log=lambda s: None)
    assert [r["recipe"] for r in rows] == list(conv.MOE_RECIPES)
    base = rows[0]["held"]
    for r in rows:
        assert r["last"] < r["first"] - 0.2, r
        assert jnp.isfinite(r["held"]) and r["held"] < r["first"], r
        assert abs(r["held"] / base - 1) < 0.02, r  # same init and batches: FP8 tracks BF16
    assert "| block |" in conv.table(rows)


# ---------------------------------------------------------------------------------------------
# --size gpu, --corpus python, one compile per recipe, --out
# ---------------------------------------------------------------------------------------------
def test_python_corpus_holds_out_each_files_last_tenth(conv):
    files = conv.python_files()
    assert len(files) > 100 and files == conv.python_files()  # deterministic order
    assert not any(set(f.split(os.sep)) & conv.PYTHON_SKIP for f in files)  # no tests, no installed packages
    assert all(f.endswith(".py") for f in files)
    train, held = conv.load_corpus("python")
    assert 0 < sum(os.path.getsize(f) for f in files) <= conv.PYTHON_CAP
    pos_t = pos_h = 0
    for f in files:  # every file: first 90% in train, its last 10% in held-out, in file order
        with open(f, "rb") as fh:
            b = fh.read()
        cut = int(len(b) * 0.9)
        assert train[pos_t : pos_t + cut].tobytes() == b[:cut], f
        assert held[pos_h : pos_h + len(b) - cut].tobytes() == b[cut:], f
        pos_t, pos_h = pos_t + cut, pos_h + len(b) - cut
    assert (pos_t, pos_h) == (len(train), len(held))
    again = conv.load_corpus("python")
    assert (again[0] == train).all() and (again[1] == held).all()
    with pytest.raises(ValueError, match="corpus must be one of"):
        conv.load_corpus("latin")


def test_gpu_configs_fit_cudnn_fp8_attention_and_block_scaling(conv):
    dense, moe = conv.CONFIGS["dense"][0]["gpu"], conv.CONFIGS["moe"][0]["gpu"]
    assert conv.CONFIGS["dense"][0]["default"] == conv.Config()  # the CPU results' config untouched
    for cfg in (dense, moe):
        assert cfg.d_model // cfg.n_heads == 128  # cuDNN's FP8 attention backward: head_dim 128 only
        assert cfg.lowbit_attention and not cfg.fp8_attention  # FP8 attention only under *-dpa
        assert (cfg.d_model, cfg.seq, cfg.batch, cfg.d_ff, cfg.lr, cfg.warmup) == (
            512,
            512,
            32,
            2048,
            1e-3,
            100,
        )
    assert (dense.n_layers, dense.moe_experts, moe.n_layers, moe.moe_experts) == (6, 0, 4, 8)
    # Float8BlockScaling's 128-wide blocks tile every expert GEMM: d and the expert ffn (d_ff / 2).
    assert moe.d_model % 128 == 0 and (moe.d_ff // 2) % 128 == 0 and moe.d_ff // 2 == 1024
    assert set(conv.GPU_RECIPES) == {"bf16", "delayed", "current", "delayed-dpa", "current-dpa"}
    for cfg, name in ((dense, "current-dpa"), (moe, "block")):  # one training step traces (no compile)
        t = conv.Trainer(name, cfg, 2)
        tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
        with t._autocast():
            variables = jax.eval_shape(
                t.model.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
            )
        params = variables.pop("params")
        opt_state = jax.eval_shape(t.opt.init, params)
        key = jax.random.PRNGKey(0)
        out = jax.eval_shape(t._step, params, variables, opt_state, tokens, jnp.int32(0), key)
        assert out[3].shape == () and t.traces["step"] == 1


def test_eval_windows_spread_over_the_held_out_text(conv):
    data = np.arange(100_000)  # each window's first token is its start
    cfg = dataclasses.replace(conv.SMALL, eval_spread=True)
    w = conv.eval_batches(data, cfg).reshape(-1, cfg.seq + 1)
    n = cfg.eval_batches * cfg.batch
    starts = w[:, 0]  # first at the start, last ending on the text's last byte, evenly apart
    assert len(w) == n and starts[0] == 0 and w[-1, -1] == len(data) - 1
    assert (w == starts[:, None] + np.arange(cfg.seq + 1)).all()
    assert np.ptp(np.diff(starts)) <= 1 and np.diff(starts).min() > cfg.seq  # disjoint windows
    plain = conv.eval_batches(data, conv.SMALL).reshape(-1, cfg.seq + 1)  # default: the first windows
    assert (plain == np.arange(n)[:, None] * cfg.seq + np.arange(cfg.seq + 1)).all()


def test_one_compile_per_recipe_across_seeds_same_results(conv):
    cfg, data = conv.SMALL, conv.load_corpus()
    t = conv.Trainer("delayed", cfg, 4)
    rows = [t.train(s, data) for s in (0, 1)]
    assert t.traces == {"step": 1, "eval": 1}  # the second seed reran the first seed's executables
    assert rows[0]["compile_s"] > 0 and rows[1]["compile_s"] == 0
    fresh = conv.Trainer("delayed", cfg, 4).train(1, data)  # seed 1 compiled on its own: same numbers
    assert fresh["curve"] == rows[1]["curve"] and fresh["held"] == rows[1]["held"]
    assert rows[0]["curve"] != rows[1]["curve"]


def test_out_json_has_the_rows_and_the_run(conv, tmp_path):
    out = tmp_path / "conv.json"
    argv = ["--small", "--steps", "3", "--seeds", "0", "1", "--recipes", "current", "--out", str(out)]
    rows = conv.main(argv)
    doc = json.loads(out.read_text())
    assert doc["config"] == dataclasses.asdict(conv.SMALL)
    assert doc["jax"] == jax.__version__ and doc["device"] == jax.devices()[0].device_kind
    assert (doc["model"], doc["size"], doc["corpus"], doc["steps"]) == ("dense", "small", "licences", 3)
    # Seed by seed (a run cut short keeps whole seeds), bf16 first; each recipe compiled on seed 0.
    assert [(r["recipe"], r["seed"]) for r in doc["rows"]] == [
        ("bf16", 0),
        ("current", 0),
        ("bf16", 1),
        ("current", 1),
    ]
    assert [r["compile_s"] > 0 for r in doc["rows"]] == [True, True, False, False]
    for r, want in zip(doc["rows"], rows):
        for k in ("held", "first", "last", "step_ms", "compile_s", "curve"):
            assert r[k] == want[k], k
        assert len(r["curve"]) == 3 and r["step_ms"] > 0
    assert "| current |" in conv.table(doc["rows"]) and "| bf16 |" in conv.table(doc["rows"][:3])  # partial
    with pytest.raises(SystemExit):
        conv.main(["--small", "--size", "gpu"])
