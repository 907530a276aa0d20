#!/usr/bin/env bash
# FP8 convergence on one GPU (issues 26 and 27), one device call:
#   scripts/gpu_convergence.sh [dense] [moe]        (both by default)
# dense: examples/convergence.py --size gpu (d 512, 6 layers, head_dim 128, seq 512, batch 32;
#   attention through lowbit's DotProductAttention, cuDNN BF16) with bf16, the FP8 GEMM recipes
#   delayed / current, and delayed-dpa / current-dpa (FP8 attention as well);
# moe: --model moe --size gpu (4 layers of 8 experts, ffn 1024, top-2) with bf16 delayed current block.
# STEPS (1000) and SEEDS ("0 1 2") for both, MOE_STEPS / MOE_SEEDS override them for moe;
# DENSE_RECIPES / MOE_RECIPES the recipe lists. Each stage runs under its own limit (LIMIT_DENSE,
# LIMIT_MOE, seconds; 240 and 200: the pair fits one 8-minute call) and prints its wall time;
# logs and JSON (rewritten after every run, seed by seed, so a stage cut short keeps its whole
# seeds) in $OUT/convergence_<stage>.{log,json}.
# PARALLEL=1: both stages at once on the one GPU (45% of its memory each): the compiles overlap
# on the CPU cores and the launch-bound steps share the GPU; the losses are the same, the
# ms/step figures are not one model's alone.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} LOWBIT_LIBRARY_DIR=$LOWBIT_BUILD_DIR
STAGES=" ${*:-dense moe} "
has() { [[ $STAGES == *" $1 "* ]]; }
say() { echo "=== $1 ($(date +%T))"; }
conv() { # stage limit args...: one convergence run, its progress lines and table
  local log=$OUT/convergence_$1.log json=$OUT/convergence_$1.json t0=$SECONDS
  say "convergence $1: ${*:3}"
  timeout -s KILL "$2" python3 examples/convergence.py "${@:3}" --out "$json" >"$log" 2>&1
  local rc=$?
  grep -E "^  |^\||^Config|steps, seeds|Error|error" "$log" | cut -c1-200 | tail -40
  echo "rc=$rc wall $((SECONDS - t0)) s"
  if [ $rc -ne 0 ] && [ -f "$json" ]; then # cut short: the table of the runs that finished
    python3 -c "import json, sys; sys.path.insert(0, 'examples'); import convergence as c
print(c.table(json.load(open(sys.argv[1]))['rows']))" "$json"
  fi
}
STEPS=${STEPS:-1000} SEEDS=${SEEDS:-0 1 2}
dense() {
  # shellcheck disable=SC2086 # the lists split into words on purpose
  conv dense "${LIMIT_DENSE:-240}" --size gpu --steps "$STEPS" --seeds $SEEDS \
    --recipes ${DENSE_RECIPES:-bf16 delayed current delayed-dpa current-dpa}
}
moe() {
  # shellcheck disable=SC2086
  conv moe "${LIMIT_MOE:-200}" --model moe --size gpu --steps "${MOE_STEPS:-$STEPS}" \
    --seeds ${MOE_SEEDS:-$SEEDS} --recipes ${MOE_RECIPES:-bf16 delayed current block}
}
if [ "${PARALLEL:-0}" = 1 ]; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
  has dense && dense >"$OUT/stage_dense.txt" 2>&1 &
  has moe && moe >"$OUT/stage_moe.txt" 2>&1 &
  wait
  cat "$OUT"/stage_*.txt 2>/dev/null
else
  has dense && dense
  has moe && moe
fi
say done
