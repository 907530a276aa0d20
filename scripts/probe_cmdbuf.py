"""One layer case timed in this process, for comparing runs under different environments
(e.g. LOWBIT_GEMM_COMMAND_BUFFER=1 or XLA_FLAGS variants, one process each):
    python scripts/probe_cmdbuf.py [case name, default "lowbit delayed"] [--small]
Prints the step time and a checksum of the outputs, so runs can be checked for equal results."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.bench.common import time_fn
from lowbit.bench.dense import FULL, SMALL
from lowbit.bench.layer import build_case

args = [a for a in sys.argv[1:] if not a.startswith("--")]
name = args[0] if args else "lowbit delayed"
cfg = SMALL if "--small" in sys.argv else FULL
key, drop = jax.random.split(jax.random.PRNGKey(42))
fn, fargs = build_case(name, cfg, key, drop)
out = jax.block_until_ready(fn(*fargs))
leaves = jax.tree_util.tree_leaves(out)
check = sum(float(jnp.sum(jnp.abs(x.astype(jnp.float32)))) for x in leaves)
finite = all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)
ms = time_fn(fn, *fargs, warmup=3, iters=10, repeats=5)
print(f"PROBE {name}: {ms:.3f} ms  checksum {check:.6e}  finite {finite}  {np.__name__}")
