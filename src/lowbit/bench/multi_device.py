"""Multiple devices: the seed's DP x TP Dense, sharded layers, expert-parallel MoE (issue 16).

    python -m lowbit.bench multi_device --stage {seed,layer,moe,collectives,overlap,cp,all} [--small|--full]
    python -m lowbit.bench multi_device --stage seed --processes 2   # jax.distributed, one host

Stages (each prints a table and writes ``multi_device-<stage>-<size>.json`` under ``--out``,
default ``benchmarks/results/<device>/``):

* ``seed``: the Dense tutorial's multi-GPU section (2 x 2 mesh, kernel ``P(None, 'tp')``, input
  ``P('dp', None, None)``, output gradient ``P('dp', None, 'tp')``, ``MeshResource`` through
  ``autocast``): step time of lowbit next to plain Flax BF16 on the same mesh, and an audit of
  the compiled step's collectives (:func:`audit_hlo`, :func:`check_seed_collectives`).
* ``layer``: lowbit's ``LayerNormMLP`` and ``TransformerLayer`` under DP, DP x TP, FSDP and DP x TP
  with sequence parallelism (``dp_tpsp``: TE's ``tpsp_resource``), each against the same model on
  one device (results and time) and against plain Flax sharded the same way (for ``dp_tpsp``:
  dp_tp's kernels, the input split along the sequence, XLA's choices after that).
* ``moe``: the MoE MLP of ``examples/moe.py`` with its experts sharded over the devices
  (:func:`moe_ep`, :func:`lowbit.ops.fused.moe.moe_mlp`): each (token, expert) pair sent to the
  expert's owner by the capacity all_to_all (``dispatch="auto"``; one collective each way, the
  per-expert counts inside the blocks) or ragged_all_to_all (GPU), the grouped GEMMs of each
  device's experts, the results sent back; BF16 and FP8 with the smallest capacity factor that
  drops nothing for these tokens, 1.25, exact (worst-case) blocks, BF16 in 1, 2 and 4
  independent token chunks per device (``ep_chunks``: one chunk's all-to-alls can overlap
  another's GEMMs; FP8 in 2), and the first version
  (:func:`moe_allgather`: every token gathered, outputs reduce-scattered) for comparison. The
  one-device row is the dropless MoE (tokens sorted by expert, no padding): the same function
  as every EP row whose ``dropped`` is 0. :func:`check_moe_step` audits the capacity rows.
* ``overlap``: the sequence-parallel MLP and the seed's dense with ``tp_overlap`` off and on
  (lowbit.bench.overlap).
* ``cp``: context parallelism, causal attention fwd+bwd over every device against one device
  at 32k and 128k tokens (lowbit.bench.context_parallel); by name only, not in ``all``.

Columns: ``ms`` the sharded fwd+bwd step, ``ms_one_device`` the same global batch on one device,
``scaling_eff`` = ms_one_device / (devices x ms) (strong scaling; 1 is ideal), ``rel_diff_vs_one``
the largest relative norm difference of the gradients against one device, ``bound`` the largest
element difference in units of tests/test_sharding.py's tolerance (<= 1: within it), in the layer
stage ``fp8_err_ratio`` (:func:`fp8_err_ratio`: the sharded FP8 gradients' error against the
unquantized one-device model over one device's FP8 error; about 1 where sharding adds none), then the
compiled step's collectives (counts, MB moved per device).

Without a GPU the stages run on forced host devices (``--cpu-devices``, default 4) with small
shapes. ``--processes N`` starts N processes on this host, each with ``--local-devices`` devices
(one GPU each, or host devices with gloo collectives on CPU), joined by ``jax.distributed``: the
path a multi-host job takes. Process 0 prints and writes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from lowbit.bench.peers import te_peer  # imports neither jax nor TE at module load

STAGES = ("seed", "layer", "moe", "collectives", "overlap", "cp")
_ENV_ID, _ENV_NUM, _ENV_COORD = "LOWBIT_MP_PROCESS_ID", "LOWBIT_MP_NUM_PROCESSES", "LOWBIT_MP_COORDINATOR"


# ---------------------------------------------------------------------------------------------
# HLO audit (no jax needed)
# ---------------------------------------------------------------------------------------------
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2}
_BYTES.update({"u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})
_LINE = re.compile(
    r"=\s*(?P<type>\((?:[^()]|\([^()]*\))*\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_GROUPS = re.compile(
    r"replica_groups=(mesh\[[^\]]*\]\s*\{[^}]*\}|\{(?:\{[\d,]*\},?)*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)"
)


def collectives(hlo_text: str) -> list[dict]:
    """The collectives of a compiled HLO module's text (``jit(f).lower(...).compile().as_text()``):
    one dict per op with ``op``, ``results`` (one ``(dtype, shape)`` per result operand),
    ``elements``, ``bytes`` and ``groups`` (replica groups as printed). Async pairs count once
    (the ``-start``; for all-gather, all-to-all and collective-permute its results are the second
    half: the first repeats the operands)."""
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        arrays = [(d, tuple(int(s) for s in dims.split(",") if s)) for d, dims in _ARRAY.findall(m["type"])]
        if m["start"] and m["op"] in ("all-gather", "collective-permute", "all-to-all") and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2 :]
        arrays = [(d, s) for d, s in arrays if d in _BYTES]  # drop u32[] context / token entries
        elements = [int(_prod(s)) for _, s in arrays]
        g = _GROUPS.search(line)
        out.append(
            dict(
                op=m["op"],
                results=arrays,
                elements=elements,
                bytes=sum(e * _BYTES[d] for e, (d, _) in zip(elements, arrays)),
                groups=g.group(1) if g else "",
            )
        )
    return out


_COMP = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s+\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_NOT_DATA = re.compile(r"(?:metadata|control-predecessors)=\{[^}]*\}")


def _hlo_graph(hlo_text: str):
    """(entry name, {computation: {instruction: operand names}}, {computation: (caller's
    computation, calling instruction)}, [(computation, instruction) of each all-to-all]) of a
    compiled HLO module's text (``%name`` form)."""
    comps, entry, cur, a2a = {}, None, None, []
    for line in hlo_text.splitlines():
        h = _COMP.match(line)
        if h:
            h_name, cur = h[2], comps.setdefault(h[2], {})
            entry = h[2] if h[1] else entry
            continue
        m = _INSTR.match(line) if cur is not None else None
        if m:
            cur[m[1]] = re.findall(r"%([\w.\-]+)", _NOT_DATA.sub("", m[2]))
            op = _LINE.search(line)
            if op and op["op"] == "all-to-all":
                a2a.append((h_name, m[1]))
    callers = {}
    for cname, instrs in comps.items():
        for iname, refs in instrs.items():
            for r in refs:
                if r in comps and r != cname:
                    callers.setdefault(r, (cname, iname))
    return entry, comps, callers, a2a


def all_to_all_groups(hlo_text: str) -> list:
    """The all-to-alls of a compiled HLO module, grouped by data dependence: two are in one
    group when one's operands depend (through any chain of instructions, in the entry
    computation; an op inside a called computation counts as its caller) on the other's result.
    Returns the groups' sizes, largest first. Independent token chunks give one group each."""
    entry, comps, callers, a2a = _hlo_graph(hlo_text)
    anchors = []
    for c, i in a2a:
        while c != entry and c in callers:
            c, i = callers[c]
        anchors.append(i)
    deps = comps.get(entry, {})
    parent = {a: a for a in anchors}  # union-find over the anchors

    def find(a):
        while parent[a] != a:
            a = parent[a]
        return a

    for a in anchors:
        seen, todo = set(), list(deps.get(a, ()))
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in parent and v != a:
                parent[find(v)] = find(a)
            todo.extend(deps.get(v, ()))
    sizes = {}
    for a in parent:
        sizes[find(a)] = sizes.get(find(a), 0) + 1
    return sorted(sizes.values(), reverse=True)


def _prod(shape) -> int:
    p = 1
    for s in shape:
        p *= int(s)
    return p


def _squeeze(shape) -> tuple:
    return tuple(int(d) for d in shape if int(d) != 1)


def audit_hlo(hlo_text: str, kernel_shapes=()) -> dict:
    """Counts and bytes per collective kind, and the all-gathers whose result is shaped as one of
    ``kernel_shapes`` (size-1 axes ignored): a gathered full kernel."""
    colls = collectives(hlo_text)
    counts = {op: sum(c["op"] == op for c in colls) for op in COLLECTIVES}
    nbytes = {op: sum(c["bytes"] for c in colls if c["op"] == op) for op in COLLECTIVES}
    full = {_squeeze(s) for s in kernel_shapes}
    gathers = [
        c for c in colls if c["op"] == "all-gather" and any(_squeeze(s) in full for _, s in c["results"])
    ]
    return dict(
        counts=counts,
        bytes=nbytes,
        full_kernel_gathers=len(gathers),
        collectives=[dict(c, results=[f"{d}{list(s)}" for d, s in c["results"]]) for c in colls],
    )


def check_seed_collectives(hlo_text: str, M: int, K: int, N: int, dp: int, tp: int, small_max: int = 64):
    """The seed's column-parallel dense step (x (M, K) over dp, kernel (K, N) over tp): returns
    the list of problems (empty: as expected). Expected: no all-gather of the full kernel (nor
    any all-gather at all), no all-to-all; all-reduces either tiny (amaxes, the loss) or one of
    the three the math needs: dgrad partials (M/dp, K) over tp, the kernel gradient (K, N/tp)
    and the bias gradient (N/tp,) over dp, each at most once."""
    problems = []
    audit = audit_hlo(hlo_text, [(K, N)])
    if audit["full_kernel_gathers"]:
        problems.append(f"{audit['full_kernel_gathers']} all-gather(s) of the full kernel")
    for op in ("all-gather", "all-to-all"):
        if audit["counts"][op]:
            problems.append(f"{audit['counts'][op]} unexpected {op}(s)")
    # Keyed by 2-D shape: dgrad (M/dp, K) and wgrad (K, N/tp) can hold as many elements.
    allowed = {(M // dp, K): "dgrad over tp", (K, N // tp): "wgrad over dp", (N // tp,): "dbias over dp"}
    seen: dict = {}
    for c in collectives(hlo_text):
        if c["op"] != "all-reduce":
            continue
        # One count per tensor and op: an async all-reduce on the GPU lists its array twice.
        for d, s in dict.fromkeys(c["results"]):
            if _prod(s) <= small_max:
                continue
            key = (_prod(s[:-1]), s[-1]) if len(s) > 1 else tuple(s)
            if key not in allowed:
                problems.append(f"unexpected all-reduce {d}{list(s)}")
            seen[key] = seen.get(key, 0) + 1
    problems += [f"{allowed[k]} all-reduced {n} times" for k, n in seen.items() if k in allowed and n > 1]
    return problems


# ---------------------------------------------------------------------------------------------
# Process set-up: devices, jax.distributed, the launcher
# ---------------------------------------------------------------------------------------------
def gpu_count() -> int:
    """GPUs on this host without initialising a jax backend (a parent process must not)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in r.stdout.splitlines()) if r.returncode == 0 else 0


def _setup_jax(cpu_devices: int) -> None:
    """Before any backend starts: forced host devices on CPU, and jax.distributed when launched."""
    import jax

    if not gpu_count():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        if cpu_devices:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
    if _ENV_ID in os.environ:
        if not gpu_count():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=os.environ[_ENV_COORD],
            num_processes=int(os.environ[_ENV_NUM]),
            process_id=int(os.environ[_ENV_ID]),
        )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list, processes: int, local_devices: int = 1, timeout: float = 600.0) -> int:
    """Runs ``python -m lowbit.bench multi_device <argv>`` as ``processes`` processes on this host
    joined by jax.distributed (coordinator on a free local port). On a GPU host process i sees
    GPUs i*local_devices ... (CUDA_VISIBLE_DEVICES); on CPU each gets ``local_devices`` host
    devices and gloo collectives. Returns the first non-zero exit status (0 if all passed)."""
    gpus = gpu_count()
    if gpus and gpus < processes * local_devices:
        raise SystemExit(
            f"{processes} processes x {local_devices} GPUs need {processes * local_devices}, found {gpus}"
        )
    coord = f"127.0.0.1:{_free_port()}"
    procs, logs = [], []
    for i in range(processes):
        env = dict(os.environ, **{_ENV_ID: str(i), _ENV_NUM: str(processes), _ENV_COORD: coord})
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * local_devices + j) for j in range(local_devices))
        else:
            env["JAX_PLATFORMS"] = "cpu"
        cmd = [
            sys.executable,
            "-m",
            "lowbit.bench",
            "multi_device",
            *argv,
            "--cpu-devices",
            str(local_devices),
        ]
        # Process 0 prints; the others write to files (a full pipe nobody reads would block a
        # process inside a collective, and with it every other process).
        log = None if i == 0 else tempfile.TemporaryFile("w+")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=None if i == 0 else subprocess.STDOUT))
    status, deadline = 0, time.time() + timeout
    for i, (p, log) in enumerate(zip(procs, logs)):
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:  # one stuck process holds the others in their collectives
                q.kill()
            p.wait()
            print(f"process {i}: timed out after {timeout:.0f} s")
            status = status or 124
        if p.returncode and status != 124:
            out = ""
            if log is not None:
                log.seek(0)
                out = log.read()[-4000:]
            print(f"process {i} exited {p.returncode}" + (f":\n{out}" if out else ""))
            status = status or p.returncode
    for log in logs:
        if log is not None:
            log.close()
    return status


def is_main_process() -> bool:
    import jax

    return jax.process_index() == 0


# ---------------------------------------------------------------------------------------------
# Arrays across processes
# ---------------------------------------------------------------------------------------------
def put(tree, shardings):
    """Host values (the same in every process) placed as global arrays with ``shardings``."""
    import jax
    import numpy as np

    def one(a, s):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

    return jax.tree_util.tree_map(one, tree, shardings)


def to_host(tree):
    """numpy copies of (possibly not fully addressable) global arrays."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(a)

    return jax.tree_util.tree_map(one, tree)


def max_rel_diff(ref, got) -> float:
    """Largest ||got - ref|| / ||ref|| over the leaves (float64). Compare gradients, not a loss
    that sums random signs: its relative error says nothing."""
    import jax
    import numpy as np

    worst = 0.0
    for r, g in zip(jax.tree_util.tree_leaves(to_host(ref)), jax.tree_util.tree_leaves(to_host(got))):
        r, g = np.asarray(r, np.float64), np.asarray(g, np.float64)
        n = np.linalg.norm(r)
        worst = max(worst, float(np.linalg.norm(g - r) / n) if n else float(np.abs(g).max(initial=0.0)))
    return worst


#: tests/test_sharding.py's bound for a sharded result against one device's under the default
#: MeshResource (bf16 partial sums, case partial_sums_bf16): a relative 2^-7 plus 2^-7 of the
#: largest value (a bf16 rounding of each partial, which can be larger than the sum).
RTOL, ATOL_FRAC = 2.0**-7, 2.0**-7


def fp8_err_ratio(bf16_ref, one, got) -> float:
    """Under an FP8 recipe, how much error sharding adds beyond FP8's own: the largest, over the
    gradient leaves, of ||got - bf16_ref|| / ||one - bf16_ref||, with ``bf16_ref`` the one-device
    step without a recipe, ``one`` the one-device FP8 step and ``got`` the sharded one (about 1:
    sharding adds nothing; a bf16 rounding of a partial sum may flip an FP8 rounding downstream,
    which moves single elements by a whole FP8 step and fails the element ``bound`` while leaving
    the error against the unquantized model as large as one device's)."""
    import jax
    import numpy as np

    worst = 0.0
    leaves = [jax.tree_util.tree_leaves(to_host(t)) for t in (bf16_ref, one, got)]
    for r, o, g in zip(*leaves):
        r, o, g = (np.asarray(a, np.float64) for a in (r, o, g))
        base = np.linalg.norm(o - r)
        if base > 1e-6 * np.linalg.norm(r):
            worst = max(worst, float(np.linalg.norm(g - r) / base))
    return worst


def bound_ratio(ref, got, where: bool = False):
    """max |got - ref| / (RTOL |ref| + ATOL_FRAC max|ref|) over the elements of all leaves: at most
    1 where the results agree within the bound the CPU sharding tests use. ``where``: also the
    path of the worst leaf."""
    import jax
    import numpy as np

    worst, at = 0.0, ""
    got_leaves = jax.tree_util.tree_leaves(to_host(got))
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(to_host(ref)), got_leaves):
        r, g = np.asarray(r, np.float64), np.asarray(g, np.float64)
        tol = RTOL * np.abs(r) + ATOL_FRAC * np.abs(r).max(initial=0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(g == r, 0.0, np.abs(g - r) / tol)
        q = float(np.nan_to_num(q, nan=np.inf).max(initial=0.0))
        if q > worst:
            worst, at = q, jax.tree_util.keystr(path)
    return (worst, at) if where else worst


_QUICK = False  # --quick: one timed call (the tests run the stages end to end)


def _timed(fn, args, small):
    from lowbit.bench.common import time_fn

    if _QUICK:
        return time_fn(fn, *args, warmup=1, iters=1, repeats=1)
    return time_fn(fn, *args, warmup=2, iters=2 if small else 10, repeats=3 if small else 5)


class _Ctx:
    """Mesh, MeshResource and recipe around every trace and every call (all are part of jit's
    cache key)."""

    def __init__(self, mesh=None, resource=None, recipe=None, rules=None):
        self.mesh, self.resource, self.recipe, self.rules = mesh, resource, recipe, rules

    def __enter__(self):
        import contextlib

        import flax.linen as nn

        import lowbit

        self._stack = contextlib.ExitStack()
        if self.mesh is not None:
            self._stack.enter_context(_set_mesh(self.mesh))
        self._stack.enter_context(lowbit.autocast(self.recipe is not None, self.recipe, self.resource))
        if self.rules is not None:
            self._stack.enter_context(nn.logical_axis_rules(self.rules))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def wrap(self, fn):
        def call(*a):
            with self:
                return fn(*a)

        return call


def _wrap(context, fn):
    """fn called inside a fresh ``context()`` each time."""

    def call(*a):
        with context():
            return fn(*a)

    return call


def _set_mesh(mesh):
    import jax

    set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.set_mesh
    return set_mesh(mesh)


def _grad_step(apply, kwargs=None):
    """jit(value_and_grad) of <model output, dy> over (variables, x): the fwd+bwd the seeds time."""
    import jax
    import jax.numpy as jnp

    def loss(v, x, dy):
        # Not jnp.vdot: its ravel of a sharded (batch, seq, features) array makes XLA gather it.
        y = apply(v, x, **(kwargs or {}))
        y = y[0] if isinstance(y, tuple) else y  # LayerNormMLP: (out, ln_output)
        return jnp.sum(y.astype(jnp.float32) * dy)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _mesh(shape, names):
    import jax
    import numpy as np

    n = _prod(shape)
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _no_bias(grads):
    import jax

    return [a for p, a in jax.tree_util.tree_leaves_with_path(grads) if "bias" not in jax.tree_util.keystr(p)]


# ---------------------------------------------------------------------------------------------
# Stage seed
# ---------------------------------------------------------------------------------------------
def seed_rows(small: bool, recipes=("delayed", "current")) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit
    from lowbit.bench.dense import DenseBlock, _cast_params

    n = len(jax.devices())
    dp, tp = (n // 2, 2) if n >= 4 else (n, 1)
    mesh = _mesh((dp, tp), ("dp", "tp"))
    rkw = dict(dp_resource="dp", tp_resource="tp")
    res = lowbit.MeshResource(**rkw)
    B, S, H, F = (2 * dp, 64, 256, 512) if small else (8, 2048, 4096, 16384)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, S, H)).astype(jnp.bfloat16)
    dy = rng.standard_normal((B, S, F)).astype(np.float32)
    named = {
        "flax bf16": None,
        "lowbit delayed": lowbit.DelayedScaling(),
        "lowbit current": lowbit.Float8CurrentScaling(),
        "lowbit mxfp8": lowbit.MXFP8BlockScaling(),
    }
    # (row name, peer (None: lowbit itself), recipe, MeshResource): the "no MeshResource" row shows
    # what the audit catches: without one lowbit's FFI calls run unsharded and XLA gathers their
    # operands. TransformerEngine's rows (peer te) run in this process where it is installed.
    cases = [("flax bf16", None, None, res)]
    cases += [(f"lowbit {r}", None, named[f"lowbit {r}"], res) for r in recipes]
    cases.append(("lowbit current, no MeshResource", None, named["lowbit current"], None))
    te = te_peer()
    if te is not None:
        cases += [(f"te {r}", te, te.make_recipe(r), res) for r in recipes]
    rows = []
    for name, peer, recipe, resource in cases:
        if peer is not None:
            cls = peer.flax.make_dot_general_cls(recipe)
        else:
            cls = (lambda: None) if recipe is None else lowbit.flax.make_dot_general_cls(recipe)
        model = DenseBlock(features=F, dot_general_cls=cls)
        v = _cast_params(model.init(jax.random.PRNGKey(0), jnp.asarray(x)), jnp.bfloat16)
        step = _grad_step(model.apply)

        def spec(path, a):
            p = jax.tree_util.keystr(path)
            return NamedSharding(
                mesh,
                P(None, "tp") if p.endswith("['kernel']") else P("tp") if p.endswith("['bias']") else P(),
            )

        vs = jax.tree_util.tree_map_with_path(spec, v)
        sh = (vs, NamedSharding(mesh, P("dp", None, None)), NamedSharding(mesh, P("dp", None, "tp")))
        args = put((v, x, dy), sh)
        if peer is None:
            ctx, one = _Ctx(mesh, resource, recipe), _Ctx(None, None, recipe).wrap(step)
        else:
            ctx = peer.context(mesh, rkw, recipe)
            one = _wrap(lambda: peer.context(None, None, recipe), step)
        with ctx:  # the compiled step is called directly: one compile, the HLO audited is the one timed
            fn = step.lower(*args).compile()
        hlo = fn.as_text()
        got = fn(*args)
        args1 = (v, jnp.asarray(x), jnp.asarray(dy))
        ref = one(*args1)
        problems = check_seed_collectives(hlo, B * S, H, F, dp, tp)
        audit = audit_hlo(hlo, [(H, F)])
        ms = _timed(fn, args, small)
        ms1 = _timed(one, args1, small)
        rows.append(
            dict(
                case=name,
                mesh=f"dp{dp} x tp{tp}",
                shape=f"{B}x{S}x{H} -> {F}",
                ms=ms,
                ms_one_device=ms1,
                scaling_eff=ms1 / (n * ms) if n else None,
                rel_diff_vs_one=max_rel_diff(ref[1], got[1]),
                # The bound covers what lowbit computes (kernel and input gradients): nn.Dense adds
                # the bias itself, and XLA's bf16 reduction of its gradient is another matter.
                bound=bound_ratio(_no_bias(ref[1]), _no_bias(got[1])),
                all_gather=audit["counts"]["all-gather"],
                all_reduce=audit["counts"]["all-reduce"],
                reduce_scatter=audit["counts"]["reduce-scatter"],
                all_to_all=audit["counts"]["all-to-all"],
                coll_MB=sum(audit["bytes"].values()) / 1e6,
                full_kernel_gathers=audit["full_kernel_gathers"],
                audit="ok" if not problems else "; ".join(problems),
                audit_expected=resource is not None and peer is None,
                collectives=audit["collectives"],
            )
        )
    base = next(r["ms"] for r in rows if r["case"] == "flax bf16")
    for r in rows:
        r["speedup_vs_flax"] = base / r["ms"]
    return rows


SEED_COLUMNS = [
    "case",
    "mesh",
    "ms",
    "speedup_vs_flax",
    "ms_one_device",
    "scaling_eff",
    "rel_diff_vs_one",
    "bound",
]
SEED_COLUMNS += ["all_gather", "all_reduce", "reduce_scatter", "coll_MB", "audit"]


# ---------------------------------------------------------------------------------------------
# Stage layer
# ---------------------------------------------------------------------------------------------
PARALLEL = {
    # name: (mesh shape fn(n), axis names, MeshResource kwargs, lowbit logical rules, input spec)
    "dp": (lambda n: (n,), ("dp",), dict(dp_resource="dp"), (), ("dp", None, None)),
    "dp_tp": (
        lambda n: (n // 2, 2),
        ("dp", "tp"),
        dict(dp_resource="dp", tp_resource="tp"),
        (("mlp", "tp"), ("joined_kv", "tp")),
        ("dp", None, None),
    ),
    "fsdp": (
        lambda n: (n,),
        ("fsdp",),
        dict(fsdp_resource="fsdp"),
        (("embed", "fsdp"),),
        ("fsdp", None, None),
    ),
    # Sequence parallelism (TE's tpsp_resource): kernels as dp_tp, the activations between blocks
    # (input, output, their gradients) split along the sequence over tp.
    "dp_tpsp": (
        lambda n: (n // 2, 2),
        ("dp", "tp"),
        dict(dp_resource="dp", tpsp_resource="tp"),
        (("mlp", "tp"), ("joined_kv", "tp"), ("nvte_seqlen_tp", "tp")),
        ("dp", "tp", None),
    ),
}


def _flax_models(cfg):
    import flax.linen as nn

    from lowbit.bench.dense import MLP
    from lowbit.bench.dense import TransformerLayer as SeedLayer

    class MlpBlock(nn.Module):
        hidden: int
        ffn: int

        @nn.compact
        def __call__(self, x):
            return MLP(self.hidden, self.ffn)(nn.LayerNorm(epsilon=1e-5)(x))

    return {
        "LayerNormMLP": (MlpBlock(cfg["hidden"], cfg["ffn"]), {}),
        "TransformerLayer": (SeedLayer(cfg["hidden"], cfg["ffn"], cfg["heads"]), {"deterministic": True}),
    }


def _lowbit_models(cfg, lf=None):
    """The layer stage's modules, built with TE's field names from ``lf`` (lowbit.flax by default;
    TransformerEngine's flax package for its rows)."""
    import jax.numpy as jnp

    if lf is None:
        from lowbit import flax as lf

    mlp = lf.LayerNormMLP(
        intermediate_dim=cfg["ffn"],
        epsilon=1e-5,
        activations=("gelu",),
        use_bias=True,
        kernel_axes_1=("embed", "mlp"),
        kernel_axes_2=("mlp", "embed"),
        bias_axes_1=("mlp",),
        bias_axes_2=("embed",),
        intermediate_dropout_rate=0.0,
        dtype=jnp.bfloat16,
    )
    layer = lf.TransformerLayer(
        hidden_size=cfg["hidden"],
        mlp_hidden_size=cfg["ffn"],
        num_attention_heads=cfg["heads"],
        layernorm_epsilon=1e-5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        intermediate_dropout=0.0,
        mlp_activations=("gelu",),
        use_bias=True,
        self_attn_mask_type="causal",
        dtype=jnp.bfloat16,
        # The residual stream split along the sequence where the MeshResource names tpsp_resource
        # (dp_tpsp); no effect on the other layouts (TE's and lowbit's alike).
        enable_sequence_parallel=True,
    )
    return {
        "LayerNormMLP": (mlp, {"deterministic": True}, 0),
        "TransformerLayer": (layer, {"deterministic": True}, None),
    }


def _flax_param_spec(path: str, ndim: int, par: str):
    """Plain Flax: the seed layer's qkv / fc1 kernels (Dense_0) column-parallel, out / fc2
    (Dense_1) row-parallel; FSDP splits every kernel's first axis."""
    from jax.sharding import PartitionSpec as P

    if par == "dp":
        return P()
    up = path.endswith("Dense_0']['kernel']") or path.endswith("Dense_0']['bias']")
    if par in ("dp_tp", "dp_tpsp"):  # dp_tpsp: the same kernels; its input is split along the sequence
        if path.endswith("['kernel']"):
            return P(None, "tp") if up else P("tp", None)
        if path.endswith("['bias']") and up:
            return P("tp")
        return P()
    if path.endswith("['kernel']") and ndim == 2:
        return P("fsdp", None)
    return P()


def layer_rows(
    small: bool, models=("LayerNormMLP", "TransformerLayer"), pars=tuple(PARALLEL), recipe="current"
):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit
    from lowbit.bench.dense import FULL, SMALL, _cast_params

    n = len(jax.devices())
    # Full: the seed layer with 4 sequences per device (16 on 4 GPUs, as issue 24 measured).
    cfg = dict(SMALL, batch=n, seq=32, hidden=128, ffn=256, heads=4) if small else dict(FULL, batch=4 * n)
    rec = {
        "delayed": lowbit.DelayedScaling(),
        "current": lowbit.Float8CurrentScaling(),
        "block": lowbit.Float8BlockScaling(),
        "none": None,
    }[recipe]
    shape = (cfg["batch"], cfg["seq"], cfg["hidden"])
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(jnp.bfloat16)
    dy = rng.standard_normal(shape).astype(np.float32)
    rows = []
    te = te_peer() is not None
    for mname in models:
        lb_model, lb_kw, _ = _lowbit_models(cfg)[mname]
        fx_model, fx_kw = _flax_models(cfg)[mname]
        key = jax.random.PRNGKey(0)
        with lowbit.autocast(rec):
            boxed = lb_model.init(key, jnp.asarray(x), **lb_kw)
        lb_v = nn.unbox(boxed)
        lb_logical = nn.get_partition_spec(boxed)
        fx_v = _cast_params(fx_model.init(key, jnp.asarray(x), **fx_kw), jnp.bfloat16)
        lb_step = _grad_step(lb_model.apply, lb_kw)
        fx_step = _grad_step(fx_model.apply, fx_kw)
        args1 = (jnp.asarray(x), jnp.asarray(dy))
        one_lb = _Ctx(None, None, rec).wrap(lb_step)
        one_fx = _Ctx().wrap(fx_step)
        ref_lb = one_lb(lb_v, *args1)
        # The same step without a recipe: the unquantized model the FP8 error is measured against.
        ref_bf16 = _Ctx().wrap(lb_step)(lb_v, *args1) if rec is not None else None
        t1_lb = _timed(one_lb, (lb_v, *args1), small)
        t1_fx = _timed(one_fx, (fx_v, *args1), small)
        kernels = [tuple(a.shape) for a in jax.tree_util.tree_leaves(lb_v["params"]) if a.ndim >= 2]
        kernels += [
            (a.shape[0], int(np.prod(a.shape[1:])))
            for a in jax.tree_util.tree_leaves(lb_v["params"])
            if a.ndim == 3
        ]
        for par in pars:
            mshape_fn, names, rkw, rules, xspec = PARALLEL[par]
            mshape = mshape_fn(n)
            if _prod(mshape) != n:
                continue
            mesh = _mesh(mshape, names)
            res = lowbit.MeshResource(**rkw)
            data = (NamedSharding(mesh, P(*xspec)), NamedSharding(mesh, P(*xspec)))
            # lowbit: the modules' logical axes through the rules; other variables replicated.
            lb_specs = _logical_shardings(lb_logical, mesh, rules)
            lb_args = put((lb_v, x, dy), (lb_specs, *data))
            fx_specs = jax.tree_util.tree_map_with_path(
                lambda p, a: NamedSharding(mesh, _flax_param_spec(jax.tree_util.keystr(p), a.ndim, par)), fx_v
            )
            fx_args = put((fx_v, x, dy), (fx_specs, *data))
            lb_ctx, fx_ctx = _Ctx(mesh, res, rec, list(rules)), _Ctx(mesh, None, None, None)
            with lb_ctx:
                lb_fn = lb_step.lower(*lb_args).compile()
            with fx_ctx:
                fx_fn = fx_step.lower(*fx_args).compile()
            hlo, fx_hlo = lb_fn.as_text(), fx_fn.as_text()
            got = lb_fn(*lb_args)
            diff = max_rel_diff(ref_lb[1], got[1])
            bound, bound_leaf = bound_ratio(ref_lb[1], got[1], where=True)
            err_ratio = fp8_err_ratio(ref_bf16[1], ref_lb[1], got[1]) if ref_bf16 is not None else None
            t_lb = _timed(lb_fn, lb_args, small)
            t_fx = _timed(fx_fn, fx_args, small)
            au, fau = audit_hlo(hlo, kernels), audit_hlo(fx_hlo)
            te_cols = _te_layer_cols(cfg, mname, recipe, mesh, rkw, rules, data, x, dy, small) if te else {}
            rows.append(
                dict(
                    model=mname,
                    parallel=par,
                    mesh="x".join(f"{a}{s}" for a, s in zip(names, mshape)),
                    recipe=recipe,
                    ms=t_lb,
                    ms_one_device=t1_lb,
                    scaling_eff=t1_lb / (n * t_lb),
                    flax_ms=t_fx,
                    flax_ms_one_device=t1_fx,
                    flax_scaling_eff=t1_fx / (n * t_fx),
                    speedup_vs_flax=t_fx / t_lb,
                    rel_diff_vs_one=diff,
                    bound=bound,
                    fp8_err_ratio=err_ratio,
                    bound_leaf=bound_leaf,
                    gathers=au["counts"]["all-gather"],
                    full_kernel_gathers=au["full_kernel_gathers"],
                    reduces=au["counts"]["all-reduce"] + au["counts"]["reduce-scatter"],
                    coll_MB=sum(au["bytes"].values()) / 1e6,
                    flax_coll_MB=sum(fau["bytes"].values()) / 1e6,
                    collectives=au["collectives"],
                    flax_collectives=fau["collectives"],
                    **te_cols,
                )
            )
    return rows


def _logical_shardings(logical, mesh, rules):
    """NamedShardings of boxed variables' logical axes through ``rules``; the rest replicated."""
    import flax.linen as nn
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    specs = nn.logical_to_mesh_sharding(logical, mesh, list(rules))
    return jax.tree_util.tree_map(
        lambda s: s if isinstance(s, NamedSharding) else NamedSharding(mesh, P()),
        specs,
        is_leaf=lambda s: s is None or isinstance(s, (NamedSharding, P)),
    )


_TE_ONE_DEVICE: dict = {}  # (model, recipe, shape) -> TE's one-device ms, measured once per run


def _te_layer_cols(cfg, mname, recipe_name, mesh, rkw, rules, data, x, dy, small) -> dict:
    """TransformerEngine's row for the same module, fields, sharding rules and step: te_ms,
    te_ms_one_device, te_scaling_eff, te_reduces, te_coll_MB; empty if TE fails here (the error
    is kept in te_error)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    te = te_peer()
    try:
        model, kw, _ = _lowbit_models(cfg, te.flax)[mname]
        recipe = te.make_recipe(recipe_name)
        key = jax.random.PRNGKey(0)
        with te.context(None, None, recipe):
            boxed = model.init(key, jnp.asarray(x), **kw)
        v, logical = nn.unbox(boxed), nn.get_partition_spec(boxed)
        step = _grad_step(model.apply, kw)
        one_key = (mname, recipe_name, tuple(x.shape))
        if one_key not in _TE_ONE_DEVICE:
            one = _wrap(lambda: te.context(None, None, recipe), step)
            _TE_ONE_DEVICE[one_key] = _timed(one, (v, jnp.asarray(x), jnp.asarray(dy)), small)
        with te.context(mesh, rkw, recipe, rules):
            full_rules = te.flax.extend_logical_axis_rules(tuple(rules))
            specs = _logical_shardings(logical, mesh, full_rules)
            args = put((v, x, dy), (specs, *data))
            fn = step.lower(*args).compile()
        t = _timed(fn, args, small)
        au = audit_hlo(fn.as_text())
        t1 = _TE_ONE_DEVICE[one_key]
        return dict(
            te_ms=t,
            te_ms_one_device=t1,
            te_scaling_eff=t1 / (len(mesh.devices.flat) * t),
            te_reduces=au["counts"]["all-reduce"] + au["counts"]["reduce-scatter"],
            te_coll_MB=sum(au["bytes"].values()) / 1e6,
        )
    except Exception as e:  # TE refuses a case: say so in the row instead of stopping the stage
        return dict(te_error=f"{type(e).__name__}: {str(e)[:200]}")


LAYER_COLUMNS = [
    "model",
    "parallel",
    "mesh",
    "ms",
    "ms_one_device",
    "scaling_eff",
    "flax_ms",
    "flax_scaling_eff",
]
LAYER_COLUMNS += [
    "speedup_vs_flax",
    "rel_diff_vs_one",
    "bound",
    "fp8_err_ratio",
    "gathers",
    "full_kernel_gathers",
    "reduces",
    "coll_MB",
    "flax_coll_MB",
    "te_ms",
    "te_scaling_eff",
    "te_reduces",
]


# ---------------------------------------------------------------------------------------------
# Stage moe: expert parallelism
# ---------------------------------------------------------------------------------------------
def moe_ep(params, x, recipe=None, mesh=None, axis="ep", dispatch="auto", capacity_factor=None, ep_chunks=1):
    """The MoE MLP of ``examples/moe.py`` through :func:`lowbit.ops.fused.moe.moe_mlp`: router,
    top-k, grouped fc1, GELU, grouped fc2. With ``mesh``, tokens and experts split over mesh
    axis ``axis``: each (token, expert) pair travels only to the expert's owner and back
    (``dispatch``: ragged_all_to_all or a capacity all_to_all, in ``ep_chunks`` independent
    token chunks)."""
    from lowbit.ops.fused.moe import moe_mlp

    return moe_mlp(
        x, params["router"], params["w1"], params["w2"], top_k=params["top_k"], recipe=recipe,
        mesh=mesh, expert_axis=None if mesh is None else axis, dispatch=dispatch,
        capacity_factor=capacity_factor, ep_chunks=ep_chunks,
    )  # fmt: skip


def moe_allgather(params, x, mesh, axis="ep"):
    """The first expert-parallel MoE, kept for comparison (BF16): every device all-gathers every
    token and routing decision, runs its E / n experts on the pairs routed to them, and the
    outputs are reduce-scattered back to the tokens' owners."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import lowbit
    from lowbit.ops.fused.moe import route
    from lowbit.sharding import shard_map as _shard_map

    E, n = params["w1"].shape[0], mesh.shape[axis]
    weight, expert = route(x, params["router"], params["top_k"])

    def body(x, weight, expert, w1, w2):
        x, weight, expert = (jax.lax.all_gather(a, axis, tiled=True) for a in (x, weight, expert))
        T, k = expert.shape
        first = jax.lax.axis_index(axis) * (E // n)
        flat = expert.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        start = jnp.sum(jnp.where(jnp.arange(E) < first, sizes, 0))
        loc = jax.lax.dynamic_slice(sizes, (first,), (E // n,))
        xs = jnp.roll(x[order // k].astype(jnp.bfloat16), -start, axis=0)  # this device's pairs first
        gemm = functools.partial(lowbit.grouped_gemm, preferred_element_type=jnp.bfloat16)
        ys = gemm(lowbit.activation(gemm(xs, w1, loc), "gelu"), w2, loc)
        ys = jnp.roll(ys.astype(jnp.float32), start, axis=0)
        y = jnp.zeros((T * k, ys.shape[1]), jnp.float32).at[order].set(ys).reshape(T, k, -1)
        y = jnp.einsum("tkd,tk->td", y, weight)
        return jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True).astype(x.dtype)

    spec = P(axis)
    return _shard_map(body, mesh, (spec,) * 5, spec)(x, weight, expert, params["w1"], params["w2"])


def moe_params(key, d, ff, E, top_k):
    import jax

    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "router": jax.random.normal(k1, (d, E)) / d**0.5,
        "w1": jax.random.normal(k2, (E, d, ff)) / d**0.5,
        "w2": jax.random.normal(k3, (E, ff, d)) / ff**0.5,
        "top_k": top_k,
    }


_RAGGED = re.compile(r"=\s*(\w+\[[\d,]*\])(?:\{[^}]*\})?\s+ragged-all-to-all(?:-start)?\(")


def ragged_bytes(hlo_text: str) -> int:
    """Bytes of the ragged-all-to-all output buffers in compiled HLO (the audit's regex does not
    list them): an upper bound on what they move."""
    total = 0
    for m in _RAGGED.finditer(hlo_text):
        ((dt, dims),) = _ARRAY.findall(m.group(1))
        total += _prod(int(s) for s in dims.split(",") if s) * _BYTES.get(dt, 0)
    return total


def moe_loads(x, params, n, dispatch, chunks=1):
    """Routed (token, expert) pairs per receive buffer, counted on the host from the router's
    choices: per (source, destination) block for ``"capacity"`` (per (chunk, source,
    destination) with ``chunks`` > 1), per destination for ``"ragged"``."""
    import numpy as np

    from lowbit.ops.fused.moe import route

    E = params["w1"].shape[0]
    expert = np.asarray(route(x, params["router"], params["top_k"])[1])
    T, k = expert.shape
    src = np.repeat(np.arange(T) // (T // n), k)
    chunk = np.repeat(np.arange(T) % (T // n) // (T // n // chunks), k)
    dest = expert.reshape(-1) // (E // n)
    group = (dest * n + src) * chunks + chunk if dispatch == "capacity" else dest
    return np.bincount(group, minlength=n * n * chunks)


def moe_dropped(x, params, n, dispatch, capacity_factor, chunks=1) -> int:
    """(token, expert) pairs the dispatch drops for these tokens (0 when capacity_factor is None),
    as moe_mlp's docstring says."""
    import numpy as np

    from lowbit.ops.fused.moe import buffer_rows

    E, (T, k) = params["w1"].shape[0], (x.shape[0], params["top_k"])
    rows = buffer_rows(dispatch, T // n, k, E, n, capacity_factor, chunks)
    return int(np.maximum(moe_loads(x, params, n, dispatch, chunks) - rows, 0).sum())


_SCATTER = re.compile(r"=\s*(\w+)\[([\d,]*)\](?:\{[^}]*\})?\s+scatter\(")


def check_moe_step(
    hlo_text: str, tokens_local: int, d: int, experts: int, devices: int, rows: int, chunks: int = 1
) -> list:
    """The expert-parallel MoE fwd+bwd step with the capacity dispatch (tokens_local per device,
    ``rows`` per (chunk, source, destination) block, ``chunks`` = moe_mlp's ep_chunks): returns
    the list of problems (empty: as expected). Expected: four all-to-alls per chunk (dispatch and
    combine, forward and backward) of one device's blocks (``devices`` x ``rows`` rows of d, plus
    the count rows of the dispatch), the chunks' all-to-alls independent of each other (none
    waits on another chunk's values: :func:`all_to_all_groups`), no other all-to-all, no
    all-gather, reduce-scatter or collective-permute (no token batch and no expert weight ever
    gathered), all-reduces only of the router's gradient and scalars (the experts are local:
    their gradients stay put), and no scatter of token rows (its transpose of a gather: a
    gather-only VJP instead)."""
    problems = []
    colls = collectives(hlo_text)
    a2a = [c for c in colls if c["op"] == "all-to-all"]
    block = devices * rows * d
    sizes = sorted(sum(c["elements"]) for c in a2a)  # a tuple all-to-all: one result per peer
    want = 4 * chunks
    if len(a2a) != want:
        problems.append(
            f"{len(a2a)} all-to-alls (expected {want}: dispatch and combine, fwd and bwd, per chunk)"
        )
    # The dispatch's blocks end in rows holding 3 base-256 digits per local expert's count
    # (lowbit.ops.fused.ep_dispatch.meta_rows).
    with_counts = devices * (rows + -(-3 * (experts // devices) // d)) * d
    if len(a2a) == want and sizes != sorted([block, with_counts] * 2 * chunks):
        problems.append(
            f"all-to-alls of {sizes} elements per device (expected {2 * chunks} x {block}, "
            f"{2 * chunks} x {with_counts})"
        )
    groups = all_to_all_groups(hlo_text)
    if len(a2a) == want and groups != [4] * chunks:
        problems.append(f"all-to-alls in dependent groups of {groups} (expected {chunks} independent of 4)")
    for op in ("all-gather", "reduce-scatter", "collective-permute"):
        k = sum(c["op"] == op for c in colls)
        if k:
            problems.append(f"{k} unexpected {op}(s)")
    for c in colls:
        # XLA's GPU combiner may flatten the router gradient and the loss scalars into one buffer
        # (f32[8193] at d 1024, 8 experts): a few scalars over d x experts still pass.
        if c["op"] == "all-reduce" and max(c["elements"], default=0) > d * experts + 16:
            problems.append(f"all-reduce of {c['results']} (only the router gradient {d}x{experts} expected)")
    for dt, dims in _SCATTER.findall(hlo_text):
        if _prod(int(v) for v in dims.split(",") if v) >= tokens_local * d:
            problems.append(f"scatter of token rows {dt}[{dims}]")
    return problems


def moe_rows(small: bool, quick: bool = False, shape: str = "") -> list[dict]:
    import math

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lowbit
    from lowbit.bench.common import on_gpu
    from lowbit.ops.fused.ep_choice import RAGGED_NCCL_FLAG
    from lowbit.ops.fused.moe import buffer_rows

    n = len(jax.devices())
    T, d, ff, E, k = (64 * n, 64, 128, 2 * n, 2) if small else (8192, 1024, 2048, n * max(1, 8 // n), 2)
    if shape:  # "T,d,ff,E,k": a model-sized MoE (compute per routed row grows with ff, bytes with d)
        T, d, ff, E, k = (int(v) for v in shape.split(","))
        if E % n:
            raise ValueError(f"--moe-shape: experts {E} not divisible by the {n} devices")
    mesh = _mesh((n,), ("ep",))
    p = moe_params(jax.random.PRNGKey(0), d, ff, E, k)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (T, d)), np.float32)
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (T, d)), np.float32)
    recipes = {"bf16": None, "fp8 current": lowbit.Float8CurrentScaling()}
    # (case, recipe, dispatch, capacity_factor). The capacity dispatch is what dispatch="auto"
    # picks; 1.25: blocks a quarter over a balanced load (nothing dropped for this router: the
    # dropped column counts it, and with 0 the result is the dropless one-device model's).
    # "exact": blocks for the worst case (tokens_local x min(top_k, local experts) rows each).
    # cf: the smallest tenth (>= 1.1) that drops nothing for these tokens (full shapes: 1.1 at 2
    # and 4 devices, loads 1.02 and 1.07 of a balanced one); padding rows travel as zeros.
    balanced = T // n * k / n
    cf = max(1.1, math.ceil(10 * moe_loads(x, p, n, "capacity").max() / balanced) / 10)
    cases = [(f"lowbit {r} capacity cf{cf:g}", r, "capacity", cf, 1) for r in recipes]
    if cf != 1.25:
        cases.append(("lowbit bf16 capacity cf1.25", "bf16", "capacity", 1.25, 1))
    # ep_chunks: each device's tokens in independent chunks (a chunk's all-to-alls can overlap
    # another's GEMMs), at the smallest tenth that drops nothing at 1, 2 and 4 chunks (per-chunk
    # blocks of ceil(rows / chunks)).
    cfc = cf
    while any(moe_dropped(x, p, n, "capacity", cfc, c) for c in (1, 2, 4)):
        cfc = round(cfc + 0.1, 1)
    for c in (1, 2, 4) if cfc != cf else (2, 4):
        cases.append((f"lowbit bf16 capacity cf{cfc:g} chunks{c}", "bf16", "capacity", cfc, c))
    cases.append((f"lowbit fp8 current capacity cf{cfc:g} chunks2", "fp8 current", "capacity", cfc, 2))
    cases.append(("lowbit bf16 capacity exact", "bf16", "capacity", None, 1))
    # XLA:CPU has no ragged-all-to-all; between processes XLA runs it only where XLA_FLAGS allows
    # its NCCL fallback (lowbit.ops.fused.moe says so with an error).
    ragged_ok = jax.process_count() == 1 or RAGGED_NCCL_FLAG in os.environ.get("XLA_FLAGS", "")
    if on_gpu() and ragged_ok:
        cases.append(("lowbit bf16 ragged cf1.25", "bf16", "ragged", 1.25, 1))
    cases.append(("lowbit bf16 allgather", "bf16", "allgather", None, 1))
    if quick:
        cases = [cases[0], cases[-1]]
    elif shape:  # the model-sized run: the default dispatch and its two-chunk overlap, both recipes
        cases = [c for c in cases if (c[3] == cf and c[4] == 1) or (c[1] == "bf16" and c[4] == 2)]
    weights = {kk: v for kk, v in p.items() if kk != "top_k"}
    sh = {
        "router": NamedSharding(mesh, P()),
        "w1": NamedSharding(mesh, P("ep")),
        "w2": NamedSharding(mesh, P("ep")),
    }
    tok = NamedSharding(mesh, P("ep"))
    args = put((weights, x, dy), (sh, tok, tok))

    def step_for(recipe, mesh=None, dispatch="auto", cf=None, chunks=1):
        def loss(w, x, dy):
            w = dict(w, top_k=k)
            if dispatch == "allgather":
                y = moe_allgather(w, x, mesh)
            else:
                y = moe_ep(w, x, recipe, mesh, dispatch=dispatch, capacity_factor=cf, ep_chunks=chunks)
            return jnp.sum(y.astype(jnp.float32) * dy)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    one_dev = {}  # recipe name -> (grads, ms) on one device, the same global batch
    rows = []
    for name, rname, disp, cf, chunks in cases:
        recipe = recipes[rname]
        if rname not in one_dev:
            one = step_for(recipe)
            host = (weights, jnp.asarray(x), jnp.asarray(dy))
            one_dev[rname] = (one(*host), _timed(one, host, small))
        ref, t1 = one_dev[rname]
        with _set_mesh(mesh):
            ep = step_for(recipe, mesh, disp, cf, chunks).lower(*args).compile()
        hlo = ep.as_text()
        got = ep(*args)
        au = audit_hlo(hlo, [(d, ff), (ff, d)])
        audit, block_rows = "", 0
        if disp in ("capacity", "ragged"):
            block_rows = buffer_rows(disp, T // n, k, E, n, cf, chunks)
        if disp == "capacity":
            audit = "; ".join(check_moe_step(hlo, T // n, d, E, n, block_rows, chunks)) or "ok"
        tn = _timed(ep, args, small)
        print(f"  {name}: {tn:.3f} ms (one device {t1:.3f} ms)", flush=True)  # a partial run keeps rows
        rows.append(
            dict(
                case=name,
                mesh=f"ep{n}",
                shape=f"T{T} d{d} ff{ff} E{E} top{k}",
                dispatch=disp,
                ep_chunks=chunks,
                ms=tn,
                ms_one_device=t1,
                scaling_eff=t1 / (n * tn),
                rel_diff_vs_one=max_rel_diff(ref[1], got[1]),
                bound=bound_ratio(ref[1], got[1]),
                bound_leaf=bound_ratio(ref[1], got[1], where=True)[1],
                dropped=0 if disp == "allgather" else moe_dropped(x, p, n, disp, cf, chunks),
                rows=block_rows,  # receive buffer rows: per (chunk,) source block (capacity) or in all
                load=0 if disp == "allgather" else int(moe_loads(x, p, n, disp, chunks).max()),
                all_to_all=au["counts"]["all-to-all"] + len(_RAGGED.findall(hlo)),
                all_gather=au["counts"]["all-gather"],
                reduce_scatter=au["counts"]["reduce-scatter"],
                coll_MB=(sum(au["bytes"].values()) + ragged_bytes(hlo)) / 1e6,
                audit=audit,
                collectives=au["collectives"],
            )
        )
    return rows


MOE_COLUMNS = ["case", "mesh", "shape", "ms", "ms_one_device", "scaling_eff", "rel_diff_vs_one", "bound"]
MOE_COLUMNS += ["rows", "load", "dropped", "all_to_all", "all_gather", "reduce_scatter", "coll_MB", "audit"]


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m lowbit.bench multi_device",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--stage", choices=("all", *STAGES), default="all")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="small shapes (default without a GPU)")
    size.add_argument("--full", action="store_true", help="the seed shapes (default on a GPU)")
    ap.add_argument("--out", default=None, help="default benchmarks/results/<device>/")
    ap.add_argument(
        "--cpu-devices", type=int, default=4, help="forced host devices per process without a GPU"
    )
    ap.add_argument("--processes", type=int, default=0, help="launch this many processes (jax.distributed)")
    ap.add_argument("--local-devices", type=int, default=1, help="devices per launched process")
    ap.add_argument(
        "--timeout", type=float, default=590.0, help="launcher: seconds before the processes are killed"
    )
    ap.add_argument("--quick", action="store_true", help="fewest cases and one timed call each (tests)")
    ap.add_argument(
        "--recipe", choices=("delayed", "current", "block", "none"), default="current", help="layer stage"
    )
    ap.add_argument("--moe-shape", default="", help='moe stage: "T,d,ff,E,k" instead of the default shape')
    ap.add_argument("--models", default="LayerNormMLP,TransformerLayer", help="layer stage, comma-separated")
    ap.add_argument("--parallel", default=",".join(PARALLEL), help="layer stage: " + ",".join(PARALLEL))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.processes and _ENV_ID not in os.environ:
        rest, skip = [], False
        for a in argv:  # the children get the same arguments less the launcher's
            if skip:
                skip = False
                continue
            if a in ("--processes", "--local-devices", "--cpu-devices", "--timeout"):
                skip = True
                continue
            if a.split("=")[0] in ("--processes", "--local-devices", "--cpu-devices", "--timeout"):
                continue
            rest.append(a)
        return launch(rest, args.processes, args.local_devices, args.timeout)
    _setup_jax(args.cpu_devices)
    import jax

    global _QUICK
    _QUICK = args.quick

    from lowbit.bench.common import environment, on_gpu, print_table, write_json

    small = args.small or (not args.full and not on_gpu())
    env = environment()
    env.update(devices=len(jax.devices()), processes=jax.process_count())
    main_proc = is_main_process()
    out = args.out or os.path.join("benchmarks", "results", env["device"].replace(" ", "_").lower())
    if main_proc:
        print(
            f"lowbit multi-device benchmark on {len(jax.devices())} x {env['device']} in "
            f"{jax.process_count()} process(es) (jax {env['jax']}, {'small' if small else 'full'} shapes)"
        )
    if len(jax.devices()) < 2:
        raise SystemExit(f"needs at least 2 devices, found {len(jax.devices())}")
    # "all": issue 24's stages; cp (issue 26) runs by name (its full shapes take minutes)
    stages = tuple(s for s in STAGES if s != "cp") if args.stage == "all" else (args.stage,)
    status = 0
    for stage in stages:
        t0 = time.perf_counter()
        if stage == "seed":
            rows, cols = (
                seed_rows(small, ("current",) if args.quick else ("delayed", "current")),
                SEED_COLUMNS,
            )
            bad = [r for r in rows if r["audit"] != "ok" and r["audit_expected"] and r["case"] != "flax bf16"]
        elif stage == "layer":
            models = tuple(m for m in args.models.split(",") if m)
            pars = tuple(p for p in args.parallel.split(",") if p)
            rows, cols, bad = layer_rows(small, models, pars, args.recipe), LAYER_COLUMNS, []
        elif stage == "collectives":
            from lowbit.bench import collectives as cl

            rows, cols, bad = cl.collective_rows(small, lambda f, a: _timed(f, a, small)), cl.COLUMNS, []
        elif stage == "overlap":
            from lowbit.bench import overlap as ov

            recipes = ("bf16", "current") if args.quick else ("bf16", "current", "delayed")
            rows, cols = (
                ov.overlap_rows(small, lambda f, a: _timed(f, a, small), sys.modules[__name__], recipes),
                ov.COLUMNS,
            )
            bad = [r for r in rows if r["rel_diff"] > 2.0**-6]
        elif stage == "cp":
            from lowbit.bench import context_parallel as cpb

            rows, cols = cpb.cp_rows(small, args.quick, print if main_proc else lambda *a: None), cpb.COLUMNS
            bad = [dict(r, audit=r["ms"]) for r in rows if str(r["ms"]).startswith("error")]
        else:
            rows, cols = moe_rows(small, quick=args.quick, shape=args.moe_shape), MOE_COLUMNS
            bad = [r for r in rows if r["audit"] not in ("ok", "")]
        if main_proc:
            suffix = ("small" if small else "full") + (
                f"-{jax.process_count()}proc" if jax.process_count() > 1 else ""
            )
            # Runs with other settings keep their own file beside the default one.
            if stage == "layer" and args.recipe not in ("delayed", "current"):
                suffix += f"-{args.recipe}"
            if stage == "moe" and args.moe_shape:
                suffix += "-" + args.moe_shape.replace(",", "_")
            shown = [
                dict(r, rel_diff_vs_one=f"{r['rel_diff_vs_one']:.1e}") if "rel_diff_vs_one" in r else r
                for r in rows
            ]
            print_table(f"multi_device {stage} ({len(jax.devices())} x {env['device']})", shown, cols)
            path = write_json(f"multi_device-{stage}-{suffix}", {"env": env, "rows": rows}, out)
            print(f"wrote {path} ({time.perf_counter() - t0:.1f} s)")
            for r in bad:
                print(f"AUDIT FAILED {r['case']}: {r['audit']}")
        status = status or (1 if bad else 0)
    if main_proc:
        print(json.dumps({"status": status}))
    return status


if __name__ == "__main__":
    sys.exit(main())
