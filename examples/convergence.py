"""Convergence check: a small byte-level decoder LM trained with each recipe vs BF16.

Real text that is always there offline, byte tokens, the last 10% of every file held out. Every
recipe trains from the same initial parameters on the same batches; the table gives each
recipe's held-out loss and its gap to BF16 in percent. Corpora (``--corpus``): ``licences``, the
Debian licence texts in /usr/share/common-licenses (264 KB; else this repository's docs), the
default of the CPU sizes; ``python``, the .py files of the running interpreter's standard library
(sorted, test folders and site-packages left out, capped at 32 MB; ~12 MB), the default of
``--size gpu``. The python corpus depends on the interpreter's version (3.12 on the GPU
machine, 3.11 on the CPU one), so compare its losses only between runs of one interpreter.

    python examples/convergence.py                     # 500 steps, all recipes, seed 0
    python examples/convergence.py --seeds 0 1 2 --recipes bf16 nvfp4 nvfp4-all
    python examples/convergence.py --small --steps 30  # seconds: what the test runs
    python examples/convergence.py --model moe --steps 300 --seeds 0 1  # MoE decoder, FP8 recipes
    python examples/convergence.py --fp8-attention --steps 300 --recipes bf16 delayed current
    python examples/convergence.py --size gpu --seeds 0 1 2 --out conv.json  # one GPU: 1000 steps
    python examples/convergence.py --model moe --size gpu --recipes bf16 delayed current block

``--model moe``: the MoE decoder (MOE below: 2 layers, d 128, every block's MLP lowbit's
MoEBlock of 8 experts of ffn 128, top-2, SwiGLU, softmax router with TE's load-balancing aux
loss in the training loss), its expert grouped GEMMs under the recipe; default recipes bf16,
delayed, current, block (the grouped GEMM's). ``--moe E``: E experts (in either model).
``--fp8-attention``: every run's attention is lowbit's DotProductAttention, and the FP8 recipes
set ``fp8_dpa=True`` (FP8 attention; BF16 stays BF16).

``--size gpu`` (GPU and GPU_MOE below): d 512, 4 heads of 128 (the one head size of cuDNN's FP8
attention backward), d_ff 2048, seq 512, batch 32, AdamW 1e-3 with 100 warmup steps, held-out
loss over 32 batches spread over the held-out text; dense 6 layers, MoE 4 layers of 8 experts
(ffn 1024, top-2). Every run's attention is lowbit's DotProductAttention (cuDNN BF16 on a GPU),
so bf16 and the GEMM-only FP8 recipes share one attention kernel; only delayed-dpa and
current-dpa run FP8 attention. Each recipe's step is compiled once and run for every seed;
``--out FILE`` writes the rows (with the loss curves, config, jax version and device) as JSON,
rewritten after every run so that a run cut short keeps what finished.

Probing a run (issue 26): ``--attention-impl {auto,cudnn,emulate}`` picks the FP8 attention's
implementation under the ``-dpa`` recipes (auto: cuDNN on a GPU where it applies, else the float32
emulation; BF16 attention is not affected); ``--eval-every N`` adds the held-out loss every N
steps (``eval_curve`` in the rows); ``--save-at S [S ...] --save-dir DIR`` writes, for every seed
and recipe, ``DIR/<recipe>_seed<seed>_step<S>.npz``: the parameters and DelayedScaling state after
S steps and the batch the next step trains on with them (what scripts/attn_fp8_divergence_probe.py
reads; :func:`load_checkpoint`).

Recipe names: bf16 (no recipe), delayed, delayed-h16 (amax history of 16 steps, not 1024),
current, mxfp8, block (Float8BlockScaling), nvfp4 (the default NVFP4 recipe: first and last
transformer layer in BF16), and NVFP4 variants: nvfp4-all (every layer in NVFP4), nvfp4-last
(only the last layer BF16), nvfp4-last2 (the last two), nvfp4-nosr, nvfp4-norht, nvfp4-no2d
(the default with one TE feature disabled); delayed-dpa, current-dpa (DelayedScaling /
Float8CurrentScaling with ``fp8_dpa=True``: the attention runs in FP8 through
lowbit's DotProductAttention, the cuDNN kernel on a GPU, its emulation elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sysconfig
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

import lowbit
from lowbit.flax import OVERWRITE_WITH_GRADIENT, SR_RNG, layer_dot_general_cls
from lowbit.ops.attention.fp8 import cudnn_fp8_available


def _nvfp4_layers(first: int, last: int):
    return lowbit.NVFP4BlockScaling(high_precision_first_layers=first, high_precision_last_layers=last)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {
    "bf16": lambda: None,
    "delayed": lowbit.DelayedScaling,
    "delayed-h16": lambda: lowbit.DelayedScaling(amax_history_len=16),
    "current": lowbit.Float8CurrentScaling,
    "mxfp8": lowbit.MXFP8BlockScaling,
    "block": lowbit.Float8BlockScaling,
    "nvfp4": lowbit.NVFP4BlockScaling,
    "nvfp4-all": lambda: _nvfp4_layers(0, 0),
    "nvfp4-last": lambda: _nvfp4_layers(0, 1),
    "nvfp4-last2": lambda: _nvfp4_layers(0, 2),
    "nvfp4-nosr": lambda: lowbit.NVFP4BlockScaling(disable_stochastic_rounding=True),
    "nvfp4-norht": lambda: lowbit.NVFP4BlockScaling(disable_rht=True),
    "nvfp4-no2d": lambda: lowbit.NVFP4BlockScaling(disable_2d_quantization=True),
    # FP8 attention (issue 26): the recipe's GEMMs plus lowbit's FP8 attention (fp8_dpa).
    "delayed-dpa": lambda: lowbit.DelayedScaling(fp8_dpa=True),
    "current-dpa": lambda: lowbit.Float8CurrentScaling(fp8_dpa=True),
    "delayed-h16-dpa": lambda: lowbit.DelayedScaling(amax_history_len=16, fp8_dpa=True),
}
DEFAULT_RECIPES = ("bf16", "delayed", "current", "mxfp8", "nvfp4")
MOE_RECIPES = ("bf16", "delayed", "current", "block")  # the grouped GEMM's recipes


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 256
    seq: int = 64
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 50
    eval_batches: int = 8
    moe_experts: int = 0  # > 0: MoE MLPs (lowbit.flax.MoEBlock) with this many experts
    moe_top_k: int = 2
    aux_loss: float = 0.01
    fp8_attention: bool = False  # lowbit's DotProductAttention, fp8_dpa under FP8 recipes
    lowbit_attention: bool = False  # lowbit's DotProductAttention for every recipe (fp8_dpa: the recipe's)
    eval_spread: bool = False  # held-out windows spread over all the held-out text, not its start
    attention_impl: str = "auto"  # the FP8 attention's implementation under fp8_dpa (ATTENTION_IMPLS)


SMALL = Config(d_model=32, n_layers=3, n_heads=2, d_ff=64, seq=32, batch=8, warmup=5, eval_batches=2)
# Experts of ffn d_ff / 2 = 128 and d 128: Float8BlockScaling's 128-wide blocks tile every expert GEMM.
MOE = Config(d_model=128, n_layers=2, n_heads=4, d_ff=256, moe_experts=8)
SMALL_MOE = dataclasses.replace(MOE, n_layers=1, n_heads=2, seq=16, batch=8, warmup=2, eval_batches=1)
# One GPU (issues 26, 27): head_dim 512 / 4 = 128, cuDNN's FP8 attention size; MoE experts of
# ffn d_ff / 2 = 1024 and d 512, multiples of Float8BlockScaling's 128.
GPU = Config(d_model=512, n_layers=6, n_heads=4, d_ff=2048, seq=512, batch=32, lr=1e-3, warmup=100)
GPU = dataclasses.replace(GPU, eval_batches=32, lowbit_attention=True, eval_spread=True)
GPU_MOE = dataclasses.replace(GPU, n_layers=4, moe_experts=8)
GPU_RECIPES = ("bf16", "delayed", "current", "delayed-dpa", "current-dpa")
SIZES = ("default", "small", "gpu")
CONFIGS = {  # model: ({size: config}, default recipes)
    "dense": ({"default": Config(), "small": SMALL, "gpu": GPU}, DEFAULT_RECIPES),
    "moe": ({"default": MOE, "small": SMALL_MOE, "gpu": GPU_MOE}, MOE_RECIPES),
}
DEFAULT_STEPS = {"default": 500, "small": 500, "gpu": 1000}
# --attention-impl -> DotProductAttention's implementation field, whose FP8 path runs cuDNN for
# "cudnn", the emulation for any other name ("xla"), and picks for None.
ATTENTION_IMPLS = {"auto": None, "cudnn": "cudnn", "emulate": "xla"}


# ---------------------------------------------------------------------------------------------
# Data: bytes of real text, same order for every recipe
# ---------------------------------------------------------------------------------------------
def text_files() -> list[str]:
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    if not files:  # not Debian: this repository's docs
        files = sorted(
            [os.path.join(REPO, f) for f in ("README.md", "NOTES.md")]
            + glob.glob(os.path.join(REPO, "docs", "*.md"))
        )
    seen, out = set(), []
    for f in files:  # GPL -> GPL-3 etc.: each text once
        real = os.path.realpath(f)
        if os.path.isfile(real) and real not in seen:
            seen.add(real)
            out.append(real)
    return out


PYTHON_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
PYTHON_CAP = 32 << 20  # bytes


def python_files() -> list[str]:
    """The standard library's .py files in path order, test folders and installed packages left
    out, up to PYTHON_CAP bytes (the interpreter's version decides the text)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in PYTHON_SKIP]
        found += [os.path.join(top, f) for f in files if f.endswith(".py")]
    out, total = [], 0
    for f in sorted(found, key=lambda f: os.path.relpath(f, root)):
        if not os.path.isfile(f) or os.path.islink(f):
            continue
        total += os.path.getsize(f)
        if total > PYTHON_CAP:
            break
        out.append(f)
    return out


CORPORA = {"licences": text_files, "python": python_files}


def load_corpus(corpus: str = "licences") -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) byte arrays: the last 10% of every file is held out."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {list(CORPORA)}, got {corpus!r}")
    train, held = [], []
    for f in CORPORA[corpus]():
        with open(f, "rb") as fh:
            b = np.frombuffer(fh.read(), np.uint8)
        cut = int(len(b) * 0.9)
        train.append(b[:cut])
        held.append(b[cut:])
    return np.concatenate(train), np.concatenate(held)


def train_batches(data: np.ndarray, cfg: Config, steps: int, seed: int) -> np.ndarray:
    starts = np.random.default_rng(seed).integers(0, len(data) - cfg.seq - 1, (steps, cfg.batch))
    return data[starts[..., None] + np.arange(cfg.seq + 1)].astype(np.int32)


def eval_batches(data: np.ndarray, cfg: Config) -> np.ndarray:
    n = min(cfg.eval_batches * cfg.batch, (len(data) - 1) // cfg.seq)
    n -= n % cfg.batch
    starts = np.arange(n) * cfg.seq
    if cfg.eval_spread:  # evenly over the held-out text (all its files), not its first n windows
        starts = np.linspace(0, len(data) - cfg.seq - 1, n).astype(np.int64)
    w = data[starts[:, None] + np.arange(cfg.seq + 1)].astype(np.int32)
    return w.reshape(n // cfg.batch, cfg.batch, cfg.seq + 1)


# ---------------------------------------------------------------------------------------------
# Model: pre-LN decoder; every block Dense takes the dot_general its layer's recipe gives
# ---------------------------------------------------------------------------------------------
class Block(nn.Module):
    cfg: Config
    recipe: lowbit.recipe.Recipe | None
    index: int

    @nn.compact
    def __call__(self, x):
        c, dt = self.cfg, jnp.bfloat16
        dg = layer_dot_general_cls(self.recipe, self.index, c.n_layers)

        def dense(n, name):
            return nn.Dense(n, dtype=dt, dot_general=dg(), name=name)

        b, t, _ = x.shape
        h = nn.LayerNorm(dtype=dt)(x)
        q, k, v = jnp.split(dense(3 * c.d_model, "qkv")(h).reshape(b, t, 3 * c.n_heads, -1), 3, axis=2)
        if c.fp8_attention or c.lowbit_attention or getattr(self.recipe, "fp8_dpa", False):
            # FP8 where the recipe says fp8_dpa, else BF16 (cuDNN on a GPU)
            impl = ATTENTION_IMPLS[c.attention_impl] if getattr(self.recipe, "fp8_dpa", False) else None
            dpa = lowbit.flax.DotProductAttention(
                head_dim=q.shape[-1],
                num_attention_heads=c.n_heads,
                attn_mask_type="causal",
                implementation=impl,
                name="attn",
            )
            a = dpa(q, k, v).reshape(b, t, -1)
        else:
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
            a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s).astype(dt), v).reshape(b, t, -1)
        x = x + dense(c.d_model, "out")(a)
        h = nn.LayerNorm(dtype=dt)(x)
        if not c.moe_experts:
            return x + dense(c.d_model, "fc2")(nn.gelu(dense(c.d_ff, "fc1")(h))), jnp.float32(0)
        moe = lowbit.flax.MoEBlock(
            num_experts=c.moe_experts,
            num_experts_per_tok=c.moe_top_k,
            intermediate_size=c.d_ff // 2,  # SwiGLU: two halves, about the dense MLP's parameters per expert
            aux_loss_coeff=c.aux_loss,
            quantization_recipe=self.recipe,
            name="moe",
        )
        y, aux, _ = moe(h)
        return x + y.astype(x.dtype), aux.astype(jnp.float32)


class ByteLM(nn.Module):
    """Embedding and output head stay in BF16 for every recipe (as in the NVFP4 papers)."""

    cfg: Config
    recipe: lowbit.recipe.Recipe | None

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        x = nn.Embed(256, c.d_model)(tokens) + self.param(
            "pos", nn.initializers.normal(0.02), (c.seq, c.d_model)
        )
        x, aux = x.astype(jnp.bfloat16), jnp.float32(0)
        for i in range(c.n_layers):
            x, a = Block(c, self.recipe, i, name=f"block{i}")(x)
            aux = aux + a
        x = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        return nn.Dense(256, dtype=jnp.bfloat16, name="head")(x).astype(jnp.float32), aux


def xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ---------------------------------------------------------------------------------------------
# Training: one compiled step per recipe, run for every seed
# ---------------------------------------------------------------------------------------------
class Trainer:
    """One recipe's training step and held-out loss, jitted and compiled once for the config and
    run for every seed: the seed's parameters, batches and stochastic-rounding key are arguments,
    not constants of the program. ``traces`` counts how often each function was traced.
    ``eval_every``: the held-out loss every that many steps too (0: only at the end);
    ``save_at``, ``save_dir``: checkpoints after those steps (:func:`save_checkpoint`); the
    rows' ``step_ms`` then includes the evaluations and the writes."""

    def __init__(self, name: str, cfg: Config, steps: int, eval_every: int = 0, save_at=(), save_dir=None):
        recipe = RECIPES[name]()
        if cfg.fp8_attention and recipe is not None:
            recipe = dataclasses.replace(recipe, fp8_dpa=True)
        self.name, self.cfg, self.steps, self.recipe = name, cfg, steps, recipe
        self.model = ByteLM(cfg, recipe)
        total = max(steps, cfg.warmup + 1)
        sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, total, cfg.lr / 10)
        self.opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.95, weight_decay=0.1))
        self.traces = {"step": 0, "eval": 0}
        self.compiled = None  # (step, eval_loss) executables, built on the first seed
        self.compile_s = 0.0
        self.eval_every, self.save_at, self.save_dir = eval_every, frozenset(save_at), save_dir
        if self.save_at and (save_dir is None or not all(0 <= s < steps for s in self.save_at)):
            raise ValueError(
                f"save_at must be steps in [0, {steps}) with a save_dir, got {sorted(self.save_at)}"
            )
        self.final = None  # the last run's {"params": ..., **state}

    def attention(self) -> str:
        """What runs this recipe's attention: "cudnn" or "emulate" (FP8), or "bf16"."""
        if not getattr(self.recipe, "fp8_dpa", False):
            return "bf16"
        if self.cfg.attention_impl != "auto":
            return self.cfg.attention_impl
        c = self.cfg
        q = jax.ShapeDtypeStruct((c.batch, c.seq, c.n_heads, c.d_model // c.n_heads), jnp.bfloat16)
        return "cudnn" if cudnn_fp8_available(q, q) is None else "emulate"

    def _autocast(self):  # the recipe in context: lowbit's attention reads it there
        return lowbit.autocast(recipe=self.recipe, enabled=self.recipe is not None)

    def _apply(self, variables, tokens, **kw):
        with self._autocast():
            return self.model.apply(variables, tokens, **kw)

    def _step(self, params, state, opt_state, batch, i, sr_key):
        self.traces["step"] += 1  # runs only while tracing

        def loss_fn(params, state):
            key = jax.random.fold_in(sr_key, i)
            logits, aux = self._apply({"params": params, **state}, batch[:, :-1], rngs={SR_RNG: key})
            loss = xent(logits, batch[:, 1:])
            return loss + aux, loss  # trains on both, reports the cross-entropy

        (_, loss), (g, g_state) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(params, state)
        updates, opt_state = self.opt.update(g, opt_state, params)
        # DelayedScaling: the state's "gradient" is its new value.
        state = {OVERWRITE_WITH_GRADIENT: g_state[OVERWRITE_WITH_GRADIENT]} if state else state
        return optax.apply_updates(params, updates), state, opt_state, loss

    def _eval(self, params, state, batch):
        self.traces["eval"] += 1
        return xent(self._apply({"params": params, **state}, batch[:, :-1])[0], batch[:, 1:])

    def train(self, seed: int, data) -> dict:
        train_data, held = data
        cfg, steps = self.cfg, self.steps
        t0 = time.time()
        batches = train_batches(train_data, cfg, steps, seed)
        evals = eval_batches(held, cfg)
        with self._autocast():
            variables = self.model.init(jax.random.PRNGKey(seed), batches[0, :, :-1])
        params = variables.pop("params")
        state = variables  # DelayedScaling's amax histories and scales (else empty)
        opt_state = self.opt.init(params)
        sr_key = jax.random.PRNGKey(1000 + seed)
        compile_s = 0.0
        if self.compiled is None:  # ahead of time: the compile apart from the steps' time
            tc = time.time()
            args = (params, state, opt_state, batches[0], np.int32(0), sr_key)
            self.compiled = (
                jax.jit(self._step).lower(*args).compile(),
                jax.jit(self._eval).lower(params, state, evals[0]).compile(),
            )
            compile_s = self.compile_s = time.time() - tc
        step, eval_loss = self.compiled
        ts, losses, evals_at = time.time(), [], []
        for i in range(steps):
            if i in self.save_at:
                meta = dict(recipe=self.name, seed=seed, step=i, config=dataclasses.asdict(cfg))
                path = os.path.join(self.save_dir, f"{self.name}_seed{seed}_step{i}.npz")
                save_checkpoint(
                    path, {"params": params, **state}, batches[i], attention=self.attention(), **meta
                )
            params, state, opt_state, loss = step(params, state, opt_state, batches[i], np.int32(i), sr_key)
            losses.append(loss)  # a device array: no host round trip per step
            if self.eval_every and (i + 1) % self.eval_every == 0:  # dispatched, read at the end
                evals_at.append((i + 1, [eval_loss(params, state, b) for b in evals]))
        curve = [float(x) for x in jax.device_get(losses)]  # the one wait for the steps
        step_ms = 1e3 * (time.time() - ts) / max(steps, 1)
        held_loss = float(np.mean(jax.device_get([eval_loss(params, state, b) for b in evals])))
        self.final = {"params": params, **state}
        extra = {"attention": self.attention()}
        if self.eval_every:
            extra["eval_curve"] = [[n, float(np.mean(jax.device_get(v)))] for n, v in evals_at]
        return dict(
            recipe=self.name,
            seed=seed,
            first=float(np.mean(curve[:5])),
            last=float(np.mean(curve[-10:])),
            held=held_loss,
            curve=curve,  # training cross-entropy per step
            seconds=time.time() - t0,
            step_ms=step_ms,
            compile_s=compile_s,  # 0: this recipe's step was compiled for an earlier seed
            **extra,
        )


def save_checkpoint(path: str, variables, batch, **meta) -> None:
    """``variables`` ({"params": ..., **state}) as ``variables/<tree path>`` arrays, ``batch``,
    and ``meta`` (JSON) in one .npz."""
    flat = traverse_util.flatten_dict(jax.device_get(variables), sep="/")
    arrays = {f"variables/{k}": np.asarray(v) for k, v in flat.items()}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    np.savez(path, batch=np.asarray(batch), meta=np.array(json.dumps(meta)), **arrays)


def load_checkpoint(path: str) -> tuple[dict, np.ndarray, dict]:
    """(variables, batch, meta) of a :func:`save_checkpoint` file; ``meta["config"]`` a Config."""
    with np.load(path, allow_pickle=False) as f:
        flat = {k[len("variables/") :]: f[k] for k in f.files if k.startswith("variables/")}
        batch, meta = f["batch"], json.loads(str(f["meta"]))
    meta["config"] = Config(**meta["config"])
    return traverse_util.unflatten_dict(flat, sep="/"), batch, meta


def train(name: str, cfg: Config, steps: int, seed: int, data) -> dict:
    return Trainer(name, cfg, steps).train(seed, data)


def run(
    recipes, seeds, steps: int, cfg: Config, log=print, corpus="licences", on_row=None, **trainer_kw
) -> list[dict]:
    """Every recipe for seed 0, then for the next seed ... (a run cut short keeps whole seeds),
    each recipe compiled once, on the first seed; on_row(rows) after every run. ``trainer_kw``:
    :class:`Trainer`'s eval_every, save_at, save_dir."""
    data = load_corpus(corpus)
    trainers = {name: Trainer(name, cfg, steps, **trainer_kw) for name in recipes}
    rows = []
    for seed in seeds:
        for name, trainer in trainers.items():
            r = trainer.train(seed, data)
            log(
                f"  seed {seed} {name:12s} train {r['first']:.3f} -> {r['last']:.3f}  "
                f"held-out {r['held']:.4f}  ({r['seconds']:.0f} s, {r['step_ms']:.1f} ms/step, "
                f"compile {trainer.compile_s:.1f} s{'' if r['compile_s'] else ', reused'})"
            )
            rows.append(r)
            if on_row is not None:
                on_row(rows)
    return rows


def table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["recipe"] for r in rows))
    seeds = sorted({r["seed"] for r in rows})
    held = {(r["recipe"], r["seed"]): r["held"] for r in rows}
    out = [
        "| recipe | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | gap vs bf16 |",
        "|---" * (len(seeds) + 3) + "|",
    ]
    base = {s: held.get(("bf16", s)) for s in seeds}
    for n in names:
        v = {s: held[(n, s)] for s in seeds if (n, s) in held}  # a run cut short: seeds missing
        gaps = [100 * (x / base[s] - 1) for s, x in v.items() if base[s] is not None]
        gap = f"{np.mean(gaps):+.2f}%" if gaps else "n/a"
        cells = [f"{v[s]:.4f}" if s in v else "" for s in seeds]
        out.append(f"| {n} | " + " | ".join(cells) + f" | {np.mean(list(v.values())):.4f} | {gap} |")
    return "\n".join(out)


def write_json(path: str, rows: list[dict], cfg: Config, **meta) -> None:
    dev = jax.devices()[0]
    doc = dict(
        config=dataclasses.asdict(cfg),
        jax=jax.__version__,
        device=dev.device_kind,
        platform=dev.platform,
        **meta,
        rows=rows,
    )
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=1)
    os.replace(tmp, path)  # whole or not at all, if the run is killed while writing


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="default: 500, --size gpu 1000")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES), help="default: the model's set")
    p.add_argument("--model", choices=list(CONFIGS), default="dense", help="dense MLPs or MoE blocks")
    p.add_argument("--size", choices=SIZES, default=None, help="default (CPU), small (tests), gpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (seconds; for tests): --size small")
    p.add_argument("--corpus", choices=list(CORPORA), default=None, help="default: python for --size gpu")
    p.add_argument("--moe", type=int, default=None, metavar="E", help="MoE MLPs with E experts (top-2)")
    p.add_argument("--fp8-attention", action="store_true", help="lowbit's attention, fp8_dpa for FP8 recipes")
    p.add_argument("--out", metavar="FILE", help="the rows as JSON (rewritten after every run)")
    p.add_argument(
        "--attention-impl",
        choices=list(ATTENTION_IMPLS),
        default="auto",
        help="FP8 attention's (-dpa recipes)",
    )
    p.add_argument("--eval-every", type=int, default=0, metavar="N", help="held-out loss every N steps too")
    p.add_argument(
        "--save-at", type=int, nargs="+", default=[], metavar="STEP", help="checkpoint after STEP steps"
    )
    p.add_argument("--save-dir", metavar="DIR", help="where --save-at writes <recipe>_seed<s>_step<n>.npz")
    a = p.parse_args(argv)
    if a.small and a.size not in (None, "small"):
        p.error(f"--small contradicts --size {a.size}")
    size = "small" if a.small else a.size or "default"
    sizes, default = CONFIGS[a.model]
    cfg = dataclasses.replace(sizes[size], fp8_attention=a.fp8_attention, attention_impl=a.attention_impl)
    if a.moe is not None:
        cfg = dataclasses.replace(cfg, moe_experts=a.moe)
    steps = a.steps if a.steps is not None else DEFAULT_STEPS[size]
    if a.eval_every < 0:
        p.error(f"--eval-every must be >= 1 (or 0: off), got {a.eval_every}")
    if a.save_at and not a.save_dir:
        p.error("--save-at needs --save-dir")
    if any(not 0 <= s < steps for s in a.save_at):
        p.error(f"--save-at steps must be in [0, {steps}) (--steps {steps}), got {a.save_at}")
    corpus = a.corpus or ("python" if size == "gpu" else "licences")
    if size == "gpu" and a.model == "dense":
        default = GPU_RECIPES
    recipes = ["bf16"] + [r for r in (a.recipes or default) if r != "bf16"]  # the gaps need the baseline
    dev = jax.devices()[0]
    print(
        f"{cfg}\n{steps} steps, seeds {a.seeds}, corpus {corpus}, jax {jax.__version__} on {dev.device_kind}"
    )
    meta = dict(model=a.model, size=size, corpus=corpus, steps=steps)
    on_row = (lambda rows: write_json(a.out, rows, cfg, **meta)) if a.out else None
    kw = dict(eval_every=a.eval_every, save_at=a.save_at, save_dir=a.save_dir)
    rows = run(recipes, a.seeds, steps, cfg, corpus=corpus, on_row=on_row, **kw)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
