"""The benchmark's case lookup: an unknown case name is a clear error, not a StopIteration."""

import pytest

from lowbit.bench.common import case_named, env_names


def test_case_named_finds_the_row():
    cases = [("a", 1), ("b", 2)]
    assert case_named(cases, "b", "dense") == ("b", 2)


def test_case_named_unknown_name_lists_the_cases():
    with pytest.raises(ValueError, match=r"layer: no case named 'c'; cases are \['a', 'b'\]"):
        case_named([("a", 1), ("b", 2)], "c", "layer")


def test_env_names_selects_known_names_and_refuses_others(monkeypatch):
    from lowbit.bench import moe

    monkeypatch.setenv("LOWBIT_X", " a ; b;")
    assert env_names("LOWBIT_X", ["a", "b", "c"], "s") == ["a", "b"]
    monkeypatch.delenv("LOWBIT_X")
    assert env_names("LOWBIT_X", ["a"], "s") == []
    monkeypatch.setenv("LOWBIT_MOE_CASES", "fp8 delayd")  # a typo: an error, not a silent subset
    with pytest.raises(ValueError, match=r"moe: LOWBIT_MOE_CASES names 'fp8 delayd'; known are"):
        moe.count(True)
    monkeypatch.setenv("LOWBIT_MOE_CASES", "fp8 delayed")
    assert moe.count(True) == len(moe.CPU_SHAPES) * (2 + 3 * len(moe.PIECE_IMPLS))  # with lowbit bf16


@pytest.mark.slow
def test_layer_cases_time_the_recipe_they_name():
    """Each fused-layer case runs under its recipe when timed, not only when first traced: the
    recipe is part of jit's cache key, so a call outside autocast would silently time BF16."""
    import jax
    import numpy as np

    from lowbit.bench import layer

    cfg = dict(layer.SMALL, batch=1, seq=32, hidden=64, ffn=128, heads=2)
    key, drop = jax.random.split(jax.random.PRNGKey(0))
    loss = {}
    for name in ("lowbit bf16 (no recipe)", "lowbit delayed"):
        fn, args = layer.build_case(name, cfg, key, drop)
        fn(*args)  # the first call after the trace: the one a timing loop repeats
        loss[name] = float(np.asarray(fn(*args)[0]))
    a, b = loss.values()
    assert abs(a - b) > 1e-4 * abs(a), loss  # FP8 rounding moves the loss; the same BF16 step would not


@pytest.mark.slow
def test_gemm_suite_times_each_format_against_bf16():
    """The GEMM table times every format on each shape and its ratios are relative to that
    shape's BF16 and per-tensor FP8 rows (not to another shape's)."""
    from lowbit.bench import gemm

    rows = gemm.run(small=True)
    assert len(rows) == gemm.count(small=True)
    for shape in {r["shape"] for r in rows}:
        part = {r["format"]: r for r in rows if r["shape"] == shape}
        assert set(part) == {f[0] for f in gemm._formats()}
        assert part["bf16"]["vs_bf16"] == 1.0 and part["fp8 per-tensor"]["vs_fp8"] == 1.0
        for r in part.values():
            assert r["ms"] > 0 and abs(r["vs_bf16"] - part["bf16"]["ms"] / r["ms"]) < 1e-12


@pytest.mark.slow
def test_layer_attention_dropout_case_runs_with_dropout():
    """The seed layer with attention dropout 0.1 through lowbit's modules runs (on CPU too) and
    really drops: the attention's output-kernel gradient (context^T dy) differs from the same
    layer's without dropout (same params and input). (The loss alone moves by ~1e-3 relative
    or less: the residual stream dominates it.)"""
    import jax
    import numpy as np

    from lowbit.bench import layer

    names = [c[0] for c in layer._cases()]
    assert "lowbit delayed, attention dropout 0.1" in names
    cfg = dict(layer.SMALL, batch=1, seq=16, hidden=32, ffn=64, heads=2)
    key, drop = jax.random.split(jax.random.PRNGKey(0))
    grad = {}
    for name in ("lowbit delayed", "lowbit delayed, attention dropout 0.1"):
        fn, args = layer.build_case(name, cfg, key, drop)
        out = fn(*args)
        assert np.isfinite(float(np.asarray(out[0])))
        assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree_util.tree_leaves(out[1]))
        grad[name] = np.asarray(out[1][0]["params"]["attention"]["out"]["kernel"], np.float64)
    a, b = grad.values()
    rel = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert rel > 1e-2, rel


def test_layer_cudnn_dropout_case_runs_where_cudnn_dropout_is_allowed(monkeypatch):
    """The cuDNN-dropout layer case is timed in a child process whose XLA_FLAGS keep cuDNN out
    of command buffers, the condition under which the attention uses cuDNN's dropout; the
    default-path case stays in the parent (where the reference dropout path runs)."""
    from lowbit.bench import layer
    from lowbit.flax.attention import _cudnn_dropout_allowed

    names = [c[0] for c in layer._cases()]
    assert set(layer._CHILD_ENV) < set(names)
    assert "lowbit delayed, attention dropout 0.1" in names
    monkeypatch.delenv("LOWBIT_CUDNN_DROPOUT", raising=False)
    flags = [env["XLA_FLAGS"] for env in layer._CHILD_ENV.values() if "XLA_FLAGS" in env]
    assert flags
    for f in flags:
        monkeypatch.setenv("XLA_FLAGS", f)
        assert _cudnn_dropout_allowed(None)
    # The split-accumulation case sets TransformerEngine's switches in its child only.
    split = layer._CHILD_ENV[layer._SPLIT_ACC_CHILD]
    assert split == {"NVTE_JAX_FP8_2X_ACC_DGRAD": "1", "NVTE_JAX_FP8_2X_ACC_WGRAD": "1"}


def test_docs_dense_case_is_the_tutorial_block():
    """The "docs dense" rows time TransformerEngine's Dense tutorial block as its harness does:
    float32 kernel, bf16 output, no bias, loss vdot(out, dy) with a bf16 dy; lowbit's rows
    differ from plain Flax's only by FP8 rounding (gradients within FP8's error of Flax's)."""
    import jax
    import numpy as np

    from lowbit.bench import dense

    cfg = dict(dense.SMALL, tokens_dense=(1, 32), dense_in=64, dense_out=128)
    key = jax.random.PRNGKey(0)
    grads = {}
    for name in ("flax", "lowbit current"):
        step, (v, x, dy, rngs) = dense.build_case("docs dense", name, cfg, key, key)
        assert (
            set(v["params"]["Dense_0"]) == {"kernel"} and v["params"]["Dense_0"]["kernel"].dtype == np.float32
        )
        assert dy.dtype == np.dtype("bfloat16")
        loss, (gv, gx) = step(v, x, dy, rngs)
        assert np.isfinite(float(loss))
        grads[name] = np.asarray(gv["params"]["Dense_0"]["kernel"], np.float64)
    ref, got = grads["flax"], grads["lowbit current"]
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert 0 < err < 0.1, err  # FP8 (E4M3 x, E5M2 dy) rounding, not another computation


def test_charts_name_each_baseline_without_punctuation(tmp_path, monkeypatch):
    """One chart per baseline; a baseline named like a row ("docs dense: flax") gives a file
    name without ':' and its own row is not drawn as a bar against itself."""
    from lowbit.bench import __main__ as bench_main

    drawn = {}

    def fake_chart(path, rows, *a, **k):
        drawn[path] = [r["bar"] for r in rows]
        return path

    monkeypatch.setattr(bench_main, "ratio_chart", fake_chart)
    rows = [
        dict(model="m", name="dense: flax bf16 params", ms=2.0, speedup=1.0, speedup_vs="flax bf16 params"),
        dict(model="m", name="dense: lowbit", ms=1.0, speedup=2.0, speedup_vs="flax bf16 params"),
        dict(model="d", name="docs dense: flax", ms=2.0, speedup=1.0, speedup_vs="docs dense: flax"),
        dict(
            model="d", name="docs dense: lowbit delayed", ms=1.0, speedup=2.0, speedup_vs="docs dense: flax"
        ),
    ]
    paths = bench_main._charts("dense", rows, str(tmp_path), "full", "dev")
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["dense-full.png", "dense-vs-docs-dense-flax-full.png"]
    assert drawn[paths[1]] == ["docs dense: lowbit delayed"]
    assert drawn[paths[0]] == ["dense: lowbit"]


def test_clock_samples_parse_to_medians():
    """nvidia-smi's "clock, power" lines become median clock and power; lines it prints for an
    unsupported field ("[N/A]") or anything else are skipped; nothing parsed gives no columns."""
    from lowbit.bench.clocks import parse

    text = "1980, 120.5\n1350, 699.1\n1500, 695.0\n[N/A], [N/A]\nnot a sample\n"
    assert parse(text) == {"sm_mhz": 1500, "power_w": 695.0}
    assert parse("") == {} and parse("[N/A], [N/A]\n") == {}


def test_timing_fills_clocks_only_where_sampled(monkeypatch, tmp_path):
    """time_fn hands the sampler's result to the caller's dict: a stand-in nvidia-smi that prints
    two samples gives their medians; without a GPU (the CPU suite) the dict stays empty."""
    import os
    import stat
    import time

    import jax.numpy as jnp

    from lowbit.bench import common

    fake = tmp_path / "nvidia-smi"
    fake.write_text(  # a driver with power.draw.instant (asked once), then two samples
        "#!/bin/sh\n"
        'case "$1" in --query-gpu=power.draw.instant) echo 42.0; exit 0;; esac\n'
        "echo '1700, 650.0'\necho '1500, 700.0'\nexec sleep 30\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    def step(x):  # long enough for the stand-in to print before the sampler stops it
        time.sleep(0.5)
        return x + 1

    clocks = {}
    common.time_fn(step, jnp.ones(4), warmup=1, iters=1, repeats=1, clocks=clocks)
    assert clocks == {}  # no GPU: not sampled
    monkeypatch.setattr(common, "on_gpu", lambda: True)
    common.time_fn(step, jnp.ones(4), warmup=1, iters=1, repeats=1, clocks=clocks)
    assert clocks == {"sm_mhz": 1600, "power_w": 675.0}


def test_clock_sampler_reads_the_visible_gpu(monkeypatch, tmp_path):
    """The sampler asks nvidia-smi for the first GPU of CUDA_VISIBLE_DEVICES only: a stand-in that
    reports GPU 2 and GPU 0 differently gives GPU 2's medians (before, every GPU's lines were
    mixed: a stream on GPU 1 of a 4-GPU host read 120 W at full load)."""
    import os
    import stat
    import time

    from lowbit.bench import clocks

    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in --query-gpu=power.draw.instant) echo 42.0; exit 0;; esac\n'
        'for a in "$@"; do last="$a"; done\n'
        'if [ "$last" = 2 ]; then echo "1700, 650.0"; else echo "1980, 120.0"; fi\n'
        "exec sleep 30\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for visible, want in (("2,3", 1700), ("", 1980)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with clocks.Sampler() as s:
            time.sleep(0.5)
        assert s.result.get("sm_mhz") == want, (visible, s.result)


def test_cpu_tables_and_charts_say_lowbit_ran_its_reference_kernels(tmp_path, monkeypatch, capsys):
    """On the CPU the printed header, each table's title and each chart (title and footnote) say
    that lowbit ran its reference kernels; on a GPU none of them does."""
    import sys
    import types

    import matplotlib.figure
    import matplotlib.text

    from lowbit.bench import __main__ as bench_main
    from lowbit.bench import common

    texts = {}
    savefig = matplotlib.figure.Figure.savefig

    def recording_savefig(fig, path, *a, **k):
        texts[str(path)] = " ".join(t.get_text() for t in fig.findobj(matplotlib.text.Text))
        return savefig(fig, path, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_savefig)
    rows = [
        dict(model="m", name="flax", ms=1.0, speedup=1.0, speedup_vs="flax"),
        dict(model="m", name="lowbit delayed", ms=10.0, speedup=0.1, speedup_vs="flax"),
    ]
    fake = types.ModuleType("fake_suite")
    fake.run = lambda small: rows
    monkeypatch.setitem(sys.modules, "fake_suite", fake)
    monkeypatch.setattr(bench_main, "SUITES", {"fake": ("fake_suite", None)})
    for platform, device in (("cpu", "cpu"), ("gpu", "NVIDIA H100")):
        env = dict(common.environment(), platform=platform, device=device)
        monkeypatch.setattr(bench_main, "environment", lambda env=env: env)
        texts.clear()
        assert bench_main.main(["fake", "--small", "--out", str(tmp_path / platform)]) == 0
        out = capsys.readouterr().out
        header = next(ln for ln in out.splitlines() if ln.startswith("## fake"))
        assert len(texts) == 1
        chart = next(iter(texts.values()))
        said = ["reference kernels" in s for s in (out.split("## fake")[0], header, chart)]
        assert said == [platform == "cpu"] * 3, (platform, out, chart)
        if platform == "cpu":  # the footnote names what ran where
            assert "C++ reference kernels" in chart and "XLA" in chart and "GPU" in chart


def test_fp8_err_ratio_measures_error_added_beyond_fp8():
    """1 where the sharded step equals one device's; the added error over FP8's own otherwise;
    leaves where FP8 is exact (no error to compare against) do not count."""
    import numpy as np

    from lowbit.bench.multi_device import fp8_err_ratio

    rng = np.random.default_rng(0)
    ref = [rng.standard_normal(256), np.ones(8)]
    one = [ref[0] + 0.1 * rng.standard_normal(256), np.ones(8)]  # FP8's own error; exact leaf
    assert fp8_err_ratio(ref, one, one) == pytest.approx(1.0)
    far = [ref[0] + 2.0 * (one[0] - ref[0]), np.ones(8) + 5.0]
    assert fp8_err_ratio(ref, one, far) == pytest.approx(2.0)


def test_profile_builds_a_moe_case_and_names_bad_ones():
    """`bench.profile moe "<shape> <case>"` gets the bench's own step; a bad label is named."""
    import jax

    from lowbit.bench import moe

    fn, args = moe.build_case("G4 small fp8 delayed")
    loss = jax.block_until_ready(fn(*args))
    assert all(bool(jax.numpy.isfinite(v).all()) for v in jax.tree_util.tree_leaves(loss))
    with pytest.raises(ValueError, match="G64 deepseek"):
        moe.build_case("G64 deepseek fp8 late")


def test_moe_te_api_rows_run_on_lowbit_te_and_leave_out_an_absent_peer(monkeypatch):
    """The TE-API moe() rows: on the CPU only the lowbit.te peer runs (TE is not importable, and
    its NCCL EP needs two GPUs); its row is finite and has vs_bf16 against lowbit's BF16 block."""
    import math

    from lowbit.bench import moe, moe_peers

    monkeypatch.setattr(moe_peers, "te_peer", lambda: None)
    monkeypatch.setenv("LOWBIT_MOE_CASES", "te-api moe delayed")
    assert moe.count(True) == len(moe.CPU_SHAPES) * (1 + 1 + 3 * len(moe.PIECE_IMPLS))
    rows = {r["name"]: r for r in moe.run(True)}
    r = rows["G4 small te-api moe delayed [lowbit.te]"]
    assert r["peer"] == "lowbit.te" and math.isfinite(r["ms"]) and r["ms"] > 0
    assert math.isfinite(r["vs_bf16"]) and r["vs_bf16"] > 0 and r["weights"] == "cast in step"
    assert r["floor_ms"] > 0 and r["weight_GB"] > 0
    assert not any("[transformer_engine]" in n for n in rows)
    assert not any("te-api moe none" in n for n in rows)  # only the selected case
    monkeypatch.setattr(moe_peers, "te_peer", lambda: "te")  # installed, but one rank: left out
    assert [p.name for p in moe_peers.peers(1)] == ["lowbit"]
    import jax

    monkeypatch.setenv("LOWBIT_MOE_TE_EP", str(jax.device_count() + 1))  # more than the devices
    with pytest.raises(ValueError, match="LOWBIT_MOE_TE_EP"):
        moe_peers.ep_size()


def test_moe_te_api_rows_leave_out_a_peer_that_refuses(monkeypatch, capsys):
    """A TE peer whose EP bootstrap fails, or that refuses a case, gets no row (the reason is
    printed); lowbit.te's rows stay."""
    import dataclasses

    from lowbit.bench import moe, moe_peers
    from lowbit.bench.peers import lowbit_peer

    fake_te = dataclasses.replace(lowbit_peer(), name="te")  # lowbit.te under TE's peer name
    monkeypatch.setattr(moe_peers, "peers", lambda n: [lowbit_peer(), fake_te])
    T, H, E, F, k = moe.CPU_SHAPES[0][1:]
    ops = moe._operands(T, H, E, F)

    def no_ep(*a):
        raise RuntimeError("no borrowed comm")

    monkeypatch.setattr(moe_peers, "_te_bootstrap", no_ep)
    got = moe_peers.rows("G4 small", (T, H, E, F, k), ops, ["te-api moe none"], iters=1)
    assert [r["name"] for r in got] == ["G4 small te-api moe none [lowbit.te]"]
    assert "TE moe() rows left out: ep_bootstrap: RuntimeError: no borrowed comm" in capsys.readouterr().err
    monkeypatch.setattr(moe_peers, "_te_bootstrap", lambda *a: None)
    sets = moe_peers._quantizer_sets

    def refuse(peer, recipe, E):
        if peer.name == "te":
            raise NotImplementedError("only MXFP8 grouped quantizers")
        return sets(peer, recipe, E)

    monkeypatch.setattr(moe_peers, "_quantizer_sets", refuse)
    got = moe_peers.rows("G4 small", (T, H, E, F, k), ops, ["te-api moe current"], iters=1)
    assert [r["peer"] for r in got] == ["lowbit.te"]
    assert "[transformer_engine] left out: NotImplementedError" in capsys.readouterr().err


def test_gpu_events_take_stream_lines_of_every_gpu_or_the_one_named():
    """profile._gpu_events (also comm_overlap's reader): every GPU plane's Stream lines, sorted,
    or only GPU ``device``'s; host planes and non-stream lines never."""
    from types import SimpleNamespace as NS

    from lowbit.bench.profile import _gpu_events

    def ev(start, name):
        return NS(start_ns=start, duration_ns=5, name=name, stats=[])

    def plane(name, lines):
        return NS(name=name, lines=[NS(name=n, events=evs) for n, evs in lines])

    trace = NS(
        planes=[
            plane("/device:GPU:1", [("Stream #7", [ev(30, "b")]), ("XLA Ops", [ev(1, "op")])]),
            plane("/host:CPU", [("Stream #1", [ev(2, "host")])]),
            plane("/device:GPU:0", [("Stream #3", [ev(20, "a"), ev(10, "c")])]),
            plane("/device:GPU:10", [("Stream #3", [ev(40, "d")])]),
        ]
    )
    names = lambda evs: [e[2] for e in evs]  # noqa: E731
    assert names(_gpu_events(trace)) == ["c", "a", "b", "d"]
    assert names(_gpu_events(trace, 0)) == ["c", "a"]
    assert names(_gpu_events(trace, 1)) == ["b"]
    assert names(_gpu_events(trace, 10)) == ["d"]


def test_moe_full_step_rows_with_adamw(monkeypatch):
    """The ``+ adamw`` rows (forward + backward + optax.adamw): run on the CPU shapes with their
    own BF16 base; the in-update FP8 step returns byte for byte the refresh step's outputs
    (masters, moments, state, copies) and runs no weight cast kernel."""
    import jax
    import numpy as np
    from helpers import jaxpr_eqns

    from lowbit.bench import moe, moe_update

    monkeypatch.setenv("LOWBIT_MOE_CASES", "fp8 delayed primary in-update + adamw")
    rows = {r["case"]: r for r in moe.run(True) if "adamw" in r["case"]}
    assert set(rows) == {"lowbit bf16 + adamw", "fp8 delayed primary in-update + adamw"}
    assert rows["lowbit bf16 + adamw"]["vs_bf16"] == 1.0
    r = rows["fp8 delayed primary in-update + adamw"]
    assert r["weights"] == "fp8 by in-update" and r["ms"] > 0
    T, H, E, F, k = moe.CPU_SHAPES[0][1:]
    assert r["weight_GB"] == E * 3 * H * F * 33 / 1e9
    ops = moe._operands(T, H, E, F)
    outs, casts = [], []
    for case in moe_update.CASES[1:]:
        fn, args = moe_update.build(case, k, *ops)
        eqns = jaxpr_eqns(jax.make_jaxpr(fn)(*args).jaxpr)
        casts.append(sum(e.params.get("target_name") == "lowbit_grouped_quantize" for e in eqns))
        outs.append(jax.tree_util.tree_leaves(fn(*args)))
    assert casts == [4, 6]  # x, h and two gradients; the refresh casts wi and wo again
    assert len(outs[0]) == len(outs[1]) > 10
    for u, w in zip(*outs):
        u, w = np.atleast_1d(np.asarray(u)), np.atleast_1d(np.asarray(w))
        assert u.dtype == w.dtype and np.array_equal(u.view(np.uint8), w.view(np.uint8))


@pytest.mark.parametrize("recipe", ["delayed", "block"])
def test_grouped_primary_rows_compute_what_the_cast_rows_do(recipe):
    """bench grouped's ``primary`` rows (weight copies made outside the timed call) return the
    same output and gradients as the rows that cast the weights in the call."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lowbit.bench import grouped as g

    G, M, K, N = g.CPU_SHAPES[0]
    lhs = jax.random.normal(jax.random.PRNGKey(0), (M, K)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.PRNGKey(1), (G, K, N)) * 0.02).astype(jnp.bfloat16)
    gs = jnp.asarray(g.group_sizes(G, M, "dirichlet"))
    outs = []
    for name in (f"lowbit fp8 {recipe}", f"lowbit fp8 {recipe} primary"):
        fn, args = g._case(name, "fwd+bwd", lhs, rhs, gs)
        outs.append([np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(fn(*args))[:3]])
    assert len(outs[0]) == 3
    for a, b in zip(*outs):
        assert np.abs(a).max() > 0
        np.testing.assert_array_equal(a, b)


def test_grouped_sizes_in_16_row_units_keep_the_dirichlet_draw():
    """``dirichlet16`` (the MoE dispatch's padded layout in the goal probe): every group a whole
    number of 16-row units, the total M, each group within 16 rows of the plain Dirichlet draw
    except the largest, which takes the remainder."""
    import numpy as np

    from lowbit.bench import grouped as g

    for G, M in ((64, 65536), (128, 16384), (8, 32768)):
        plain, units = g.group_sizes(G, M, "dirichlet"), g.group_sizes(G, M, "dirichlet16")
        assert units.sum() == M and np.all(units % 16 == 0) and np.all(units >= 0)
        rest = np.arange(G) != np.argmax(plain)
        assert np.all(np.abs(units[rest] - plain[rest]) < 16)
        assert np.count_nonzero(plain % 16) > G // 2  # the plain draw is not already aligned


def test_grouped_build_case_reads_the_spec(monkeypatch):
    """``lowbit.bench.profile grouped "G<experts> <sizes> <case>"`` builds that case at the shape
    with that expert count and those sizes (small shapes here)."""
    import jax
    import numpy as np

    from lowbit.bench import grouped as g

    monkeypatch.setattr(g, "GPU_SHAPES", g.CPU_SHAPES)
    G, M, K, N = g.CPU_SHAPES[1]
    fn, args = g.build_case(f"G{G} dirichlet16 lowbit bf16")
    out = jax.tree_util.tree_leaves(fn(*args))
    assert out[0].shape == (M, N)
    sizes = [a for a in args if getattr(a, "shape", None) == (G,)]
    np.testing.assert_array_equal(np.asarray(sizes[0]), g.group_sizes(G, M, "dirichlet16"))
