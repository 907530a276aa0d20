#!/usr/bin/env bash
# One stage of the multi-device benchmark (lowbit.bench.multi_device) on a multi-GPU host, made to
# fit one device call: the stage runs under `timeout`, logs and JSON go under $OUT.
#   scripts/gpu_multi.sh STAGE [extra multi_device arguments]
# STAGE: seed | layer | moe | collectives | overlap | cp | all          one process over all GPUs
#        mp-seed | mp-layer | mp-moe | mp-all one process per GPU joined by jax.distributed
#                                             (LOWBIT_PROCESSES, default: every GPU)
# e.g.   scripts/gpu_multi.sh layer --models TransformerLayer --parallel dp_tp,fsdp
# LOWBIT_WHEEL=file.whl installs that wheel (pip --no-deps, as scripts/gpu_check.sh does);
# without it Python imports src/ with the libraries in LOWBIT_BUILD_DIR (default build/gpu).
# LOWBIT_STAGE_TIMEOUT: seconds for the stage (default 540). NVLink multicast (NVLS) stays off.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGE=${1:-seed}
shift || true
LIMIT=${LOWBIT_STAGE_TIMEOUT:-540}
BUILD=${LOWBIT_BUILD_DIR:-build/gpu}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -n "${LOWBIT_WHEEL:-}" ]; then
  "$PY" -m pip install -q --upgrade --no-deps --no-index --no-compile --target /tmp/lowbit-site "$LOWBIT_WHEEL" || exit 1
  export PYTHONPATH=/tmp/lowbit-site${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} LOWBIT_LIBRARY_DIR=$(realpath -m "$BUILD")
fi

echo "=== device ($(date +%T))"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
nvidia-smi topo -m 2>/dev/null | head -8 || true
"$PY" -c "import jax, lowbit; print('jax', jax.__version__, '| lowbit from', lowbit.__file__)"

GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
case $STAGE in
  seed | layer | moe | collectives | overlap | cp | all)
    cmd=("$PY" -m lowbit.bench multi_device --stage "$STAGE" --out "$OUT/results" "$@") ;;
  mp-seed | mp-layer | mp-moe | mp-all)
    n=${LOWBIT_PROCESSES:-$GPUS}
    cmd=("$PY" -m lowbit.bench multi_device --stage "${STAGE#mp-}" --out "$OUT/results"
      --processes "$n" --local-devices 1 --timeout $((LIMIT - 20)) "$@") ;;
  *) echo "unknown stage $STAGE (seed, layer, moe, collectives, overlap, cp, all, mp-seed, mp-layer, mp-moe, mp-all)"; exit 2 ;;
esac
echo "=== $STAGE: ${cmd[*]} ($(date +%T), limit ${LIMIT} s)"
timeout --kill-after=15 "$LIMIT" "${cmd[@]}" 2>&1 | grep -v "^W0000\|^I0000\|^\[Gloo\]" | tee "$OUT/$STAGE.log"
status=${PIPESTATUS[0]}
[ "$status" -eq 124 ] && echo "TIMED OUT after ${LIMIT} s (results of the finished stages are under $OUT/results)"
echo "=== done: $STAGE status $status ($(date +%T))"
exit "$status"
