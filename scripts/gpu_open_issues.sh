#!/usr/bin/env bash
# One-GPU checks the open issues still need, in one device call (first GPU only):
#   scripts/gpu_open_issues.sh [te] [attn] [moe] [checks] [bench-attn] [bench-layer]
# te: TE-port integration tests with the GPU as default device (float32 at 'highest');
# attn/moe: their gpu-marked tests; checks: check programs in $CHECKS plain + memcheck --quick;
# bench-attn: `bench attention --full`; bench-layer: the layer bench for $LOWBIT_LAYER_CASES.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh te
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} LOWBIT_LIBRARY_DIR=$LOWBIT_BUILD_DIR
STAGES=${*:-te attn moe checks bench-attn}
has() { [[ " $STAGES " == *" $1 "* ]]; }
pt() {  # name limit args...
  echo "=== $1 ($(date +%T))"
  timeout "$2" python3 -m pytest "${@:3}" -q -p no:cacheprovider -x 2>&1 | tee "$OUT/pytest_$1.log" | tail -6
}
has te && pt te "${LIMIT_TE:-150}" tests/test_te_framework.py tests/test_te_compat_names.py
has attn && pt attn "${LIMIT_ATTN:-150}" -m gpu tests/test_attention_fp8.py tests/test_attention_packed_cudnn.py tests/test_fused_attention_gpu.py
has moe && pt moe "${LIMIT_MOE:-150}" -m gpu tests/test_moe_fused.py
if has checks; then
  for c in ${CHECKS:-moe attention_cudnn}; do
    exe=$LOWBIT_BUILD_DIR/lowbit_check_$c
    echo "=== check $c ($(date +%T))"
    timeout 120 "$exe" >"$OUT/check_$c.log" 2>&1; echo "rc=$?"; tail -3 "$OUT/check_$c.log"
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$exe" --quick >"$OUT/memcheck_$c.log" 2>&1
    echo "memcheck rc=$?"; grep "ERROR SUMMARY" "$OUT/memcheck_$c.log" | tail -1
  done
fi
if has bench-attn; then
  echo "=== bench attention ($(date +%T))"
  timeout "${LIMIT_BENCH:-150}" python3 -m lowbit.bench attention --full --out "$OUT/bench" 2>&1 | tee "$OUT/bench_attention.log" | grep "^|\|wrote" | tail -20
fi
if has bench-layer; then
  echo "=== bench layer ($(date +%T)) cases: ${LOWBIT_LAYER_CASES:-all}"
  timeout "${LIMIT_LAYER:-200}" python3 -m lowbit.bench layer --full --out "$OUT/bench" 2>&1 | tee "$OUT/bench_layer.log" | grep "^|\|wrote" | tail -20
fi
echo "=== done ($(date +%T))"
