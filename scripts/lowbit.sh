#!/usr/bin/env bash
# One entry point for a fresh machine: sets lowbit up the first time (a virtual environment, the
# Python dependencies, the native library), printing a line per stage, then runs.
#   scripts/lowbit.sh demo [bench args]   -> python -m lowbit.bench (small shapes on CPU)
#   scripts/lowbit.sh test [pytest args]  -> the default test tier (GPU tests skip without a GPU);
#                                            --all adds the tests marked slow, -m slow runs them alone
#   scripts/lowbit.sh setup               -> set-up only
# Python: $PYTHON if set, else the active virtual environment, else ./.venv (created here).
# LOWBIT_CUDA=AUTO|ON|OFF: AUTO (default) builds the CUDA kernels only where nvcc and a GPU are
# both present; ON builds them anyway (CI, wheels for a GPU fleet); OFF never.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
say() { echo "lowbit: $* [$((SECONDS - t0)) s]" >&2; }

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  PY=$VIRTUAL_ENV/bin/python
else
  if [ ! -x .venv/bin/python ]; then
    say "creating the virtual environment .venv"
    python3 -m venv .venv
  fi
  PY=$PWD/.venv/bin/python
fi

installed() {
  "$PY" - <<'PY' 2>/dev/null
import lowbit._native as n, lowbit
n.ensure_loaded()
import flax, pytest, optax, matplotlib  # noqa: F401
PY
}

want_cuda() {
  case "${LOWBIT_CUDA:-AUTO}" in
    ON) return 0 ;;
    OFF) return 1 ;;
    *) command -v nvcc >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU ;;
  esac
}

setup() {
  local pip=("$PY" -m pip --disable-pip-version-check)
  say "[1/3] build tools (scikit-build-core, ninja, jaxlib for the XLA FFI headers)"
  "${pip[@]}" install -q --progress-bar off "scikit-build-core>=0.10" ninja "jax>=0.6"
  if want_cuda; then
    export LOWBIT_CUDA=ON
    say "[1/3] CUDA build: CUTLASS and cuDNN frontend headers (nvidia-cutlass, nvidia-cudnn-frontend)"
    "${pip[@]}" install -q --progress-bar off --no-deps "nvidia-cutlass>=4.0" "nvidia-cudnn-frontend>=1.32,<1.33"
  else
    export LOWBIT_CUDA=OFF
  fi
  say "[2/3] lowbit's dependencies and native library (LOWBIT_CUDA=$LOWBIT_CUDA, $(nproc) cores)"
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  local log
  log=$(mktemp)
  # pip shows a build's output only with -v: keep CMake's and ninja's progress lines, the rest
  # goes to the log (printed whole if the install fails).
  # Whether it worked is decided by `installed` below, not by the pipeline's status.
  "${pip[@]}" install -v --progress-bar off --no-build-isolation -e ".[test,bench]" 2>&1 |
    tee "$log" | grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\] |^ *-- lowbit|^Successfully installed' >&2 || true
  if ! installed; then
    tail -60 "$log" >&2
    say "set-up FAILED (full log: $log)"
    exit 1
  fi
  rm -f "$log"
  say "[3/3] set-up done"
}

cmd=${1:-demo}
shift || true
if [ "$cmd" = setup ] || ! installed; then
  setup
fi
case "$cmd" in
  setup) ;;
  demo | bench) exec "$PY" -m lowbit.bench "$@" ;;
  test) exec "$PY" -m pytest tests -q "$@" ;;
  *)
    echo "usage: scripts/lowbit.sh {demo|test|setup} [args]" >&2
    exit 2
    ;;
esac
