#!/usr/bin/env bash
# The multi-GPU check and benchmark in one device call on a multi-GPU host: the multi-GPU pytest
# cases (the seed tutorial's flow, expert parallelism), then the multi_device stages seed, layer,
# moe, collectives and overlap (scripts/gpu_multi.sh, one time limit each), TransformerEngine's rows where
# it is installed (source /tmp/te-site/env.sh first: ../shared/tepeer). Logs and JSON under $OUT.
#   scripts/gpu_multi_suite.sh [pytest] [probe] [seed] [layer] [moe] [collectives] [overlap] [cp] [mp-seed]
#   (default: all but probe, cp and mp-seed)
# cp: context parallelism at 32k/128k tokens (issue 26; LIMIT_CP) after its gpu tests
#   (tests/test_attention_cp_fused.py, LIMIT_CP_PYTEST).
# probe: scripts/dp_overlap_probe.py once per variant in PROBE_FLAGS (';'-separated "XLA flags|probe args"), each in a
# fresh process: the DP TransformerLayer step's time and the all-reduce MB its schedule overlaps.
# LAYER_ARGS: extra layer-stage arguments (default: TransformerLayer, every layout, delayed).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_out} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
STAGES=${*:-pytest seed layer moe collectives overlap}
BUILD=${LOWBIT_BUILD_DIR:-build/gpu}
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has pytest; then
  echo "=== multi-GPU pytest ($(date +%T))"
  PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} LOWBIT_LIBRARY_DIR=$(realpath -m "$BUILD") \
    timeout "${LIMIT_PYTEST:-420}" python3 -m pytest tests/test_seed_multi_device.py tests/test_moe_ep.py -m gpu -q \
    -k "${PYTEST_K:-not outside}" -p no:cacheprovider 2>&1 | tee "$OUT/pytest_multi.log" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if has probe; then
  IFS=';' read -ra variants <<<"${PROBE_FLAGS:-}"
  [ ${#variants[@]} -eq 0 ] && variants=("")
  one=--one
  for v in "${variants[@]}"; do  # "XLA flags|probe arguments", e.g. "|--pgle 3"
    flags=${v%%|*} extra=
    [[ $v == *"|"* ]] && extra=${v#*|}
    echo "=== probe XLA_FLAGS='$flags' $extra ($(date +%T))"
    XLA_FLAGS="$flags" PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} LOWBIT_LIBRARY_DIR=$(realpath -m "$BUILD") \
      timeout "${LIMIT_PROBE:-150}" python3 scripts/dp_overlap_probe.py $one $extra --label "${flags:-default}" 2>&1 \
      | grep "^PROBE\|Error" | tee -a "$OUT/probe.log" | cut -c1-700
    one=
  done
fi
run_stage() {
  LOWBIT_STAGE_TIMEOUT=$1 bash scripts/gpu_multi.sh "${@:2}" 2>&1 | grep -v "^  File\|^    \|Warning\|warn(" | tail -${TAIL:-14}
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
# Stage time limits (seconds): LIMIT_SEED, LIMIT_LAYER, LIMIT_MOE, LIMIT_COLLECTIVES, LIMIT_OVERLAP,
# LIMIT_CP, LIMIT_MP.
has seed && run_stage "${LIMIT_SEED:-200}" seed
has layer && run_stage "${LIMIT_LAYER:-420}" layer ${LAYER_ARGS:---models TransformerLayer --recipe delayed}
has moe && run_stage "${LIMIT_MOE:-240}" moe
has collectives && run_stage "${LIMIT_COLLECTIVES:-200}" collectives
has overlap && run_stage "${LIMIT_OVERLAP:-240}" overlap
if has cp; then
  echo "=== CP gpu tests ($(date +%T))"
  PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} LOWBIT_LIBRARY_DIR=$(realpath -m "$BUILD") \
    timeout "${LIMIT_CP_PYTEST:-180}" python3 -m pytest tests/test_attention_cp_fused.py -m gpu -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_cp.log" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  TAIL=${TAIL:-20} run_stage "${LIMIT_CP:-300}" cp
fi
has mp-seed && run_stage "${LIMIT_MP:-240}" mp-seed
exit $status
