#!/usr/bin/env bash
# The seed tutorial's DP=2 x TP=2 Dense flow on a 4-GPU host (examples/dense_multi_gpu.py), for
# every recipe and both init flows; a run that dies gets a native backtrace from cuda-gdb.
#   scripts/gpu_seed_flow.sh [recipes...]        (default: delayed current block none)
# Imports src/ with the libraries in LOWBIT_BUILD_DIR (default build/gpu, scripts/gpu_check.sh build).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUILD=${LOWBIT_BUILD_DIR:-build/gpu}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONFAULTHANDLER=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} LOWBIT_LIBRARY_DIR=$(realpath -m "$BUILD")
status=0
for recipe in ${*:-delayed current block none}; do
  for flow in inside outside; do
    echo "=== seed flow recipe=$recipe flow=$flow ($(date +%T))"
    "$PY" examples/dense_multi_gpu.py --recipe "$recipe" --flow "$flow" 2>&1 | grep -v "^W0000\|^I0000" | tee -a "$OUT/seed_flow.log" | tail -25
    rc=${PIPESTATUS[0]}
    echo "rc=$rc"
    if [ "$rc" -ne 0 ]; then
      status=1
      if [ ! -e "$OUT/backtrace_$recipe.log" ] && command -v cuda-gdb >/dev/null; then
        timeout 300 cuda-gdb -q -batch -ex "set pagination off" -ex "set cuda api_failures ignore" -ex run \
          -ex "bt 40" -ex "info threads" --args "$PY" examples/dense_multi_gpu.py --recipe "$recipe" --flow "$flow" \
          >"$OUT/backtrace_$recipe.log" 2>&1
        grep -A45 "SIGSEGV\|signal" "$OUT/backtrace_$recipe.log" | head -70
      fi
    fi
  done
done
exit $status
