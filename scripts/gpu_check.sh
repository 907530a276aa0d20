#!/usr/bin/env bash
# The whole GPU check in one device call: build the CUDA library with all cores, run the
# standalone kernel checks (plain and under compute-sanitizer memcheck), `pytest -m gpu`, and the
# benchmark. Logs and results go under $OUT (default ./gpu_out).
#   scripts/gpu_check.sh [build] [check] [probe] [sanitize] [pytest] [bench] [bench-quantize] ... [profile]
# `probe` runs the probe_* programs (csrc/probes, built by hand: see NOTES.md) with PROBE_ARGS.
# `profile` prints where the GPU time of the main dense/layer cases goes (lowbit.bench.profile);
# PYTEST_ARGS narrows the pytest stage (default: tests); PYTEST_MARK=all drops its `-m gpu` (tests
# without a device parameter then run on the default device, the GPU).
# With no stage named, all run. Works from a plain checkout: no pip install needed.
# LOWBIT_BUILD_DIR=dir uses libraries and check programs built elsewhere (same nvcc) and skips
# nothing else: name the stages without `build` to save the device the compile.
# LOWBIT_WHEEL=file.whl runs the Python stages from that wheel, installed with pip --no-deps.
# LOWBIT_CMAKE_ARGS: more CMake arguments for `build` (e.g. -DLOWBIT_CUDNN_FRONTEND_INCLUDE=dir).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGES=${*:-build check sanitize pytest bench}
BUILD=${LOWBIT_BUILD_DIR:-build/gpu}
CUTLASS_INC=${LOWBIT_CUTLASS_INCLUDE:-$PWD/.carry/cutlass/include}
export PYTHONUNBUFFERED=1
if [ -n "${LOWBIT_WHEEL:-}" ]; then
  # The fleet install: the wheel built elsewhere, installed without a compiler or dependencies;
  # Python imports lowbit from there (not from src/), with the libraries the wheel carries.
  "$PY" -m pip install -q --upgrade --no-deps --no-index --no-compile --target /tmp/lowbit-site "$LOWBIT_WHEEL" || exit 1
  export PYTHONPATH=/tmp/lowbit-site${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} LOWBIT_LIBRARY_DIR=$(realpath -m "$BUILD")
fi
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
step() { echo; echo "=== $1 ($(date +%T))"; }
# CHECKS="moe block_fusion": only those check programs (lowbit_check_<name>) in check/sanitize.
picked() { [ -z "${CHECKS:-}" ] || [[ " $CHECKS " == *" ${1##*lowbit_check_} "* ]]; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
"$PY" -c "import lowbit, lowbit._native as n; n.ensure_loaded(); print('lowbit from', lowbit.__file__, '| CUDA library:', n.cuda_library())"

if has build; then
  step "build"
  cmake -S . -B "$BUILD" -G Ninja -DLOWBIT_CUDA=ON -DPython_EXECUTABLE="$(command -v "$PY")" \
    -DLOWBIT_CUTLASS_INCLUDE="$CUTLASS_INC" -DLOWBIT_BUILD_CHECKS=ON ${LOWBIT_CMAKE_ARGS:-} >"$OUT/build.log" 2>&1 &&
    ninja -C "$BUILD" -j "$(nproc)" >>"$OUT/build.log" 2>&1
  rc=$?; tail -5 "$OUT/build.log"; [ $rc -eq 0 ] || { echo "BUILD FAILED"; grep -m 20 -B2 -A8 "error" "$OUT/build.log"; exit 1; }
fi

if has check; then
  step "kernel checks"
  for exe in "$BUILD"/lowbit_check_*; do
    [ -x "$exe" ] && picked "$exe" || continue
    echo "--- $exe"; "$exe" 2>&1 | tee -a "$OUT/check.log" | tail -15 || status=1
  done
fi

if has probe; then
  step "probes"
  for exe in "$BUILD"/probe_*; do
    [ -x "$exe" ] || continue
    echo "--- $exe ${PROBE_ARGS:-}"; "$exe" ${PROBE_ARGS:-} 2>&1 | tee -a "$OUT/probe.log" | tail -40 || status=1
  done
fi

if has sanitize; then
  step "compute-sanitizer memcheck"
  for exe in "$BUILD"/lowbit_check_*; do
    [ -x "$exe" ] && picked "$exe" || continue
    compute-sanitizer --tool memcheck --error-exitcode 9 "$exe" --quick >>"$OUT/check.log" 2>&1
    rc=$?; echo "memcheck $exe: rc=$rc"; [ $rc -eq 0 ] || status=1
  done
  grep -E "ERROR SUMMARY" "$OUT/check.log" | tail -5
fi

if has pytest; then
  step "pytest -m gpu"
  timeout_flag=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo --timeout=900)
  mark=(-m "${PYTEST_MARK:-gpu}"); [ "${PYTEST_MARK:-}" = all ] && mark=()  # all: unmarked tests run on the GPU too
  "$PY" -m pytest ${PYTEST_ARGS:-tests} "${mark[@]}" -q $timeout_flag -p no:cacheprovider 2>&1 | tee -a "$OUT/pytest.log" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

for s in $STAGES; do
  case $s in
    bench) suite=all ;;
    bench-*) suite=${s#bench-} ;;
    *) continue ;;
  esac
  step "benchmark $suite"
  "$PY" -m lowbit.bench "$suite" --full --out "$OUT/bench" 2>&1 | tee -a "$OUT/bench.log" | grep -v "it/s" | tail -60
done
if has profile; then
  step "profile"
  { "$PY" -m lowbit.bench.profile dense "flax bf16 params" "lowbit delayed bf16 params"
    "$PY" -m lowbit.bench.profile layer "lowbit delayed bf16 params"
    "$PY" -m lowbit.bench.profile module "lowbit delayed" --timeline; } 2>&1 | grep -v "^W0000\|^I0000" | tee "$OUT/profile.log"
fi

[ -d "$OUT/bench" ] && tar -czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"

step "done: status $status"
exit $status
