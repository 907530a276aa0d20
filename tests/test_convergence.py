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


# ---------------------------------------------------------------------------------------------
# Probing a run (issue 26): --attention-impl, --eval-every, --save-at, and the divergence probe
# ---------------------------------------------------------------------------------------------
_PROBE_PATH = os.path.join(_REPO, "scripts", "attn_fp8_divergence_probe.py")


@pytest.fixture(scope="module")
def probe_mod(conv):
    spec = importlib.util.spec_from_file_location("attn_fp8_divergence_probe", _PROBE_PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def saved_run(conv, tmp_path_factory):
    """One small run with every probing flag: (json doc, rows, checkpoint folder)."""
    tmp = tmp_path_factory.mktemp("saved_run")
    out, ckpt = tmp / "conv.json", tmp / "ckpt"
    argv = ["--small", "--steps", "3", "--recipes", "delayed-dpa", "--attention-impl", "emulate"]
    argv += ["--eval-every", "1", "--save-at", "0", "2", "--save-dir", str(ckpt), "--out", str(out)]
    rows = conv.main(argv)
    return json.loads(out.read_text()), rows, ckpt


def test_probing_flags_are_recorded(conv, saved_run):
    doc, rows, ckpt = saved_run
    assert doc["config"]["attention_impl"] == "emulate"
    assert [(r["recipe"], r["attention"]) for r in doc["rows"]] == [
        ("bf16", "bf16"),
        ("delayed-dpa", "emulate"),
    ]
    for r in doc["rows"]:  # the held-out curve after steps 1, 2, 3; its last point is the final held-out
        assert [n for n, _ in r["eval_curve"]] == [1, 2, 3]
        assert all(np.isfinite(v) for _, v in r["eval_curve"]) and r["eval_curve"][-1][1] == r["held"]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        f"{n}_seed0_step{s}.npz" for n in ("bf16", "delayed-dpa") for s in (0, 2)
    ]
    for bad in (["--save-at", "1"], ["--save-at", "3", "--save-dir", "x"], ["--eval-every", "-1"]):
        with pytest.raises(SystemExit):  # argparse's error names the flag
            conv.main(["--small", "--steps", "3", *bad])


def test_attention_impl_reaches_the_fp8_attention(conv):
    tokens = jnp.zeros((conv.SMALL.batch, conv.SMALL.seq), jnp.int32)
    seen = {}

    def spy(next_fun, args, kwargs, context):
        if type(context.module).__name__ == "DotProductAttention":
            seen[context.module.path[0]] = context.module.implementation
        return next_fun(*args, **kwargs)

    for name, impl, want in (
        ("delayed-dpa", "emulate", "xla"),
        ("delayed-dpa", "auto", None),
        ("bf16", "emulate", None),
    ):
        cfg = dataclasses.replace(conv.SMALL, attention_impl=impl, lowbit_attention=True)
        t = conv.Trainer(name, cfg, 1)
        seen.clear()
        with t._autocast(), nn.intercept_methods(spy):
            jax.eval_shape(t.model.init, jax.random.PRNGKey(0), tokens)
        assert set(seen.values()) == {want}, (name, impl, seen)  # BF16 attention keeps its default
    t = conv.Trainer("delayed-dpa", dataclasses.replace(conv.SMALL, attention_impl="cudnn"), 1)
    with (
        t._autocast(),
        pytest.raises(ValueError, match="implementation='cudnn' cannot run FP8 attention here"),
    ):
        jax.eval_shape(t.model.init, jax.random.PRNGKey(0), tokens)


def test_save_at_writes_the_runs_parameters_state_and_next_batch(conv, saved_run):
    _, _, ckpt = saved_run
    cfg, data = dataclasses.replace(conv.SMALL, attention_impl="emulate"), conv.load_corpus()
    t = conv.Trainer("delayed-dpa", cfg, 2)  # warmup 5: 2 and 3 steps follow the same schedule
    t.train(0, data)
    variables, batch, meta = conv.load_checkpoint(str(ckpt / "delayed-dpa_seed0_step2.npz"))
    assert (meta["recipe"], meta["seed"], meta["step"], meta["attention"]) == ("delayed-dpa", 0, 2, "emulate")
    assert meta["config"] == cfg
    want = jax.tree_util.tree_map(np.asarray, t.final)
    assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(variables), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(a, b)
    hist = variables["_overwrite_with_gradient"]["block0"]["attn"]["dk_amax_history"]
    assert (hist[:2] > 0).all() and (hist[2:] == 0).all()  # two steps of the attention's state
    assert (batch == conv.train_batches(data[0], cfg, 3, 0)[2]).all()  # what step 2 trains on
    init, batch0, _ = conv.load_checkpoint(str(ckpt / "delayed-dpa_seed0_step0.npz"))
    with t._autocast():
        fresh = t.model.init(jax.random.PRNGKey(0), batch0[:, :-1])
    for a, b in zip(jax.tree_util.tree_leaves(init), jax.tree_util.tree_leaves(fresh)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_probe_float64_reference_matches_autodiff(probe_mod):
    r = np.random.default_rng(0)
    q, k, v, do = (r.standard_normal((2, 8, 2, 4)) for _ in range(4))
    scale = 0.5

    def attn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        s = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    o, vjp = jax.vjp(attn, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    ref = probe_mod.reference(q, k, v, do, scale)
    for name, want in zip(("o", "dq", "dk", "dv"), (o, *vjp(jnp.asarray(do, jnp.float32)))):
        np.testing.assert_allclose(ref[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


def test_probe_steps_equal_the_fp8_op(probe_mod):
    """The probe runs the op's forward and backward steps itself (for the amaxes and scales):
    they must give what lowbit.ops.attention.fp8.fp8_attention's vjp gives."""
    from lowbit.ops.attention.fp8 import fp8_attention

    r = np.random.default_rng(1)
    q, k, v, do = (jnp.asarray(r.standard_normal((2, 16, 2, 16)), jnp.bfloat16) for _ in range(4))
    for recipe in (lowbit.DelayedScaling(fp8_dpa=True), lowbit.Float8CurrentScaling(fp8_dpa=True)):
        state = (
            probe_mod.warm_state(recipe, q, k, v, do, "emulate")
            if isinstance(recipe, lowbit.DelayedScaling)
            else None
        )
        out, _, _, _ = probe_mod.fp8_step(q, k, v, do, state, recipe=recipe, impl="emulate")

        def op(q, k, v, recipe=recipe, state=state):
            return fp8_attention(q, k, v, recipe=recipe, state=state, causal=True, implementation="emulate")

        o, grads = jax.jit(lambda q, k, v, do: (lambda o, f: (o, f(do)))(*jax.vjp(op, q, k, v)))(q, k, v, do)
        for name, want in zip(("o", "dq", "dk", "dv"), (o, *grads)):
            # Equal up to FP8 roundings flipped here and there by float32 noise: the two graphs
            # fuse the emulation's arithmetic differently (the same forward on the same centered
            # inputs, eager and jitted, differs in 0.3% of o under DelayedScaling's scales; up to
            # 6% of dk's entries, 0.6% of its norm); a wrong scale or a missed quantization would
            # move nearly every entry.
            got = np.asarray(jnp.asarray(out[name]).astype(jnp.bfloat16), np.float32)
            want = np.asarray(want, np.float32)
            moved, err = np.mean(got != want), np.linalg.norm(got - want) / np.linalg.norm(want)
            assert moved < 0.15 and err < 0.02, (type(recipe).__name__, name, moved, err)


def test_divergence_probe_on_a_saved_checkpoint(probe_mod, saved_run, capsys):
    _, _, ckpt = saved_run
    rows = probe_mod.main([str(ckpt / "delayed-dpa_seed0_step2.npz")])
    text = capsys.readouterr().out
    assert "cudnn rows skipped: " in text and "summary delayed emulate" in text  # head_dim 16, or no GPU
    assert {(r["recipe"], r["impl"]) for r in rows} == {("delayed", "emulate"), ("current", "emulate")}
    assert sorted({r["layer"] for r in rows}) == list(range(3))
    for r in rows:
        nums = [v for v in r.values() if isinstance(v, float)]
        assert nums and all(np.isfinite(nums)), r
        # FP8 against float64 (E4M3 forward, E5M2 gradients: ~0.04 and ~0.1 measured at head_dim 16)
        assert r["err_o"] < 0.1 and max(r[f"err_{g}"] for g in ("dq", "dk", "dv")) < 0.2, r
        assert min(r[f"cos_{g}"] for g in ("dq", "dk", "dv")) > 0.98, r
        assert all(0 <= r[k] <= 0.01 for k in r if k.startswith(("uf_", "z_"))), r
    for layer in range(3):  # current scaling's gradient scales are bounds: dk's sits binades below
        d, c = ({r["recipe"]: r for r in rows if r["layer"] == layer}[n] for n in ("delayed", "current"))
        assert abs(d["hr_dk"]) < 2 and c["hr_dk"] > d["hr_dk"] + 5, (d["hr_dk"], c["hr_dk"])


# --- GPU: the probe's cuDNN rows (cuDNN's FP8 attention: head_dim 128) ---------------------
@pytest.mark.gpu
def test_probe_cudnn_rows_against_the_emulation(probe_mod, gpu_device):
    """cuDNN and the emulation on the same tensors through the probe's steps: both near float64,
    near each other, and cuDNN's dp amax the emulation's times the softmax scale (the convention
    convert_dp relies on)."""
    r = np.random.default_rng(2)
    q, k, v, do = (jnp.asarray(r.standard_normal((2, 256, 4, 128)), jnp.bfloat16) for _ in range(4))
    scale = 128**-0.5
    ref = probe_mod.reference(q, k, v, do, scale)
    recipe = lowbit.DelayedScaling(fp8_dpa=True)
    rows, states = {}, {}
    for impl in ("cudnn", "emulate"):
        states[impl] = probe_mod.warm_state(recipe, q, k, v, do, impl)
        out, amaxes, sc, _ = probe_mod.fp8_step(q, k, v, do, states[impl], recipe=recipe, impl=impl)
        rows[impl] = probe_mod.compare(out, amaxes, sc, ref, recipe, impl, scale)
    for row in rows.values():
        assert row["err_o"] < 0.1 and max(row[f"err_{g}"] for g in ("dq", "dk", "dv")) < 0.2, row
    for key in ("err_o", "err_dq", "err_dk", "err_dv"):
        assert abs(rows["cudnn"][key] - rows["emulate"][key]) < 0.05, (key, rows)
    ratio = rows["cudnn"]["amax_dp"] / (rows["emulate"]["amax_dp"] * scale)
    assert 0.8 < ratio < 1.25, ratio
    moved = probe_mod.convert_dp(states["cudnn"], scale, "cudnn", "emulate")["dp_scale"]
    assert 0.8 < float(moved[0] / states["emulate"]["dp_scale"][0]) < 1.25


@pytest.mark.gpu
def test_probe_on_a_gpu_checkpoint(conv, probe_mod, gpu_device, tmp_path):
    """End to end with cuDNN's FP8 attention: a two-layer model of 128-wide heads trained by
    delayed-dpa on cuDNN, checkpointed, probed with both implementations."""
    cfg = dataclasses.replace(conv.SMALL, d_model=256, n_heads=2, d_ff=256, seq=64, batch=4, n_layers=2)
    cfg = dataclasses.replace(cfg, lowbit_attention=True, attention_impl="cudnn")
    t = conv.Trainer("delayed-dpa", cfg, 3, save_at=[2], save_dir=str(tmp_path))
    t.train(0, conv.load_corpus())
    lines = []
    rows = probe_mod.probe(str(tmp_path / "delayed-dpa_seed0_step2.npz"), log=lines.append)
    assert "skipped" not in "\n".join(lines)
    assert {(r["recipe"], r["impl"]) for r in rows} == {
        (n, i) for n in ("delayed", "current") for i in ("cudnn", "emulate")
    }
    for r in rows:
        assert all(np.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["err_o"] < 0.15 and min(r[f"cos_{g}"] for g in ("dq", "dk", "dv")) > 0.97, r
