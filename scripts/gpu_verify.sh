#!/usr/bin/env bash
# First GPU run of code written without a GPU, one device call on one GPU (first GPU only):
#   scripts/gpu_verify.sh [own] [fusion] [memq] [mha] [moe] [moek] [bench-own] [bench-layer] [bench-moe]
# own: lowbit_check_block_gemm --quick (+ memcheck --quick, --bench-sm90 with the router's log) and
# the sm90own/auto gpu tests; moek: lowbit_check_moe (+ memcheck --quick, --bench), the fused MoE gpu tests;
# fusion: lowbit_check_block_fusion (+ memcheck --quick, --bench) and its gpu tests;
# memq: memcheck --quick of lowbit_check_quantize_cuda (the rewritten dbias column sum);
# mha: the fp8_mha op and module tests with the GPU as default device (the op's cuDNN path);
# moe: the fused FP8 dispatch gpu tests; bench-*: timings ($LOWBIT_LAYER_CASES, $LOWBIT_MOE_CASES).
# Each stage runs under its own limit (LIMIT_<STAGE>, seconds) and prints its wall time.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh "${TE:-}"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} LOWBIT_LIBRARY_DIR=$LOWBIT_BUILD_DIR
STAGES=" ${*:-own fusion memq mha moe} "
B=$LOWBIT_BUILD_DIR
has() { [[ $STAGES == *" $1 "* ]]; }
say() { echo "=== $1 ($(date +%T))"; }
pt() { # name limit args...
  say "pytest $1"
  timeout -s KILL "$2" python3 -m pytest "${@:3}" -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_$1.log" | tail -5
}
chk() { # name limit args...: a check program, its last lines
  say "check $1 ${*:3}"
  timeout -s KILL "$2" "$B/lowbit_check_$1" "${@:3}" >"$OUT/check_$1${3:-}.log" 2>&1
  echo "rc=$?"
  grep -E "FAIL|failed|passed" "$OUT/check_$1${3:-}.log" | tail -6
}
mem() { # name limit: memcheck --quick
  say "memcheck $1"
  timeout -s KILL "$2" compute-sanitizer --tool memcheck --error-exitcode 9 "$B/lowbit_check_$1" --quick \
    >"$OUT/memcheck_$1.log" 2>&1
  echo "rc=$?"
  grep "ERROR SUMMARY" "$OUT/memcheck_$1.log" | tail -1
}
if has own; then
  chk block_gemm "${LIMIT_OWN:-150}" --quick
  grep -E "sm90own|routed" "$OUT/check_block_gemm--quick.log" | cut -c1-160 | tail -24
  mem block_gemm "${LIMIT_OWN_MEM:-240}"
  say "check block_gemm --bench-sm90"
  LOWBIT_BLOCK_GEMM_LOG=1 timeout -s KILL 150 "$B/lowbit_check_block_gemm" --bench-sm90 \
    >"$OUT/check_block_gemm--bench-sm90.log" 2>"$OUT/block_gemm_router.log"
  echo "rc=$?"
  cut -c1-160 "$OUT/check_block_gemm--bench-sm90.log" | tail -45
  grep -i cluster "$OUT/block_gemm_router.log" | sort -u | head -4
  pt own 150 -m gpu tests/test_block_gemm_backends.py -x -k "sm90own or auto"
fi
if has fusion; then
  chk block_fusion 120
  mem block_fusion 200
  chk block_fusion 90 --bench
  tail -16 "$OUT/check_block_fusion--bench.log" | cut -c1-160
  LOWBIT_BLOCK_DBIAS_FUSION=1 pt fusion 150 -m gpu tests/test_block_dbias.py tests/test_block_fusion.py
fi
if has moek; then
  chk moe 150
  mem moe 200
  chk moe 90 --bench
  cut -c1-160 "$OUT/check_moe--bench.log" | tail -24
  pt moek 200 -m gpu tests/test_moe_fused.py
fi
has memq && mem quantize_cuda "${LIMIT_MEMQ:-200}"
has mha && pt mha "${LIMIT_MHA:-150}" tests/test_attention_fp8_mha.py
has moe && pt moe "${LIMIT_MOE:-150}" -m gpu tests/test_moe_dispatch_fp8.py
if has bench-own; then  # the block GEMM rows under each backend, same process per backend
  for b in ${BACKENDS:-auto sm90own}; do
    say "bench gemm LOWBIT_BLOCK_GEMM=$b"
    LOWBIT_BLOCK_GEMM=$b timeout -s KILL "${LIMIT_BGEMM:-120}" python3 -m lowbit.bench gemm --full --out "$OUT/bench_$b" \
      2>&1 | grep -i "block\|^| case" | head -30
  done
fi
if has bench-layer; then
  say "bench layer cases: ${LOWBIT_LAYER_CASES:-all}"
  timeout -s KILL "${LIMIT_LAYER:-240}" python3 -m lowbit.bench layer --full --out "$OUT/bench" 2>&1 \
    | tee "$OUT/bench_layer.log" | grep "^|\|wrote" | tail -20
fi
if has bench-moe; then
  say "bench moe cases: ${LOWBIT_MOE_CASES:-all} shapes: ${LOWBIT_MOE_SHAPES:-all}"
  timeout -s KILL "${LIMIT_BMOE:-300}" python3 -m lowbit.bench moe --full --out "$OUT/bench" 2>&1 \
    | tee "$OUT/bench_moe.log" | grep "^|\|wrote\|ms" | tail -40
fi
say done
