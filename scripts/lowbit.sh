#!/usr/bin/env bash
# One entry point for a fresh machine: installs lowbit (and its test/bench extras) when it is not
# importable with its native library yet, then runs the demo/benchmark or the tests.
#   scripts/lowbit.sh demo [bench args]   -> python -m lowbit.bench (small shapes on CPU)
#   scripts/lowbit.sh test [pytest args]  -> the test suite (GPU tests skip without a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

installed() {
  "$PY" - <<'PY' 2>/dev/null
import lowbit._native as n, lowbit
n.ensure_loaded()
import flax, pytest, optax  # noqa: F401
PY
}

if ! installed; then
  echo "lowbit: installing (pip install -e '.[test,bench]') ..." >&2
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$PY" -m pip install -q -e ".[test,bench]"
fi

cmd=${1:-demo}
shift || true
case "$cmd" in
  demo|bench) exec "$PY" -m lowbit.bench "$@" ;;
  test) exec "$PY" -m pytest tests -q "$@" ;;
  *) echo "usage: scripts/lowbit.sh {demo|test} [args]" >&2; exit 2 ;;
esac
