#!/usr/bin/env bash
# TransformerEngine's own JAX tests run on lowbit: `transformer_engine` is mapped onto lowbit.te by
# the import shim in tests/te_port. Prints one line per test file: collected/passed/failed/skipped.
#
#   scripts/te_tests.sh TE_TESTS_DIR [file.py ...]
#
# TE_TESTS_DIR holds TE's tests/jax (e.g. `git -C <TransformerEngine checkout> archive HEAD tests/jax
# | tar -x -C /tmp/te`, then /tmp/te/tests/jax). Without files: every file except the MoE ones
# (router, permutation, EP, grouped GEMM: another issue). PER_FILE_TIMEOUT (seconds, default 1200)
# bounds each file; PYTEST_ARGS adds pytest options (e.g. "-k 'not fp8'"); CPU_SIZES=1 shrinks
# test_layer's shapes (tests/te_port/te_cpu_sizes.py); CPU_DEVICES=N gives XLA N host devices so
# the distributed tests run on a CPU. Uses $PYTHON (default python3) with lowbit
# importable or src/ of this checkout.
set -u
here="$(cd "$(dirname "$0")/.." && pwd)"
tests="${1:?usage: scripts/te_tests.sh TE_TESTS_DIR [file.py ...]}"
shift
py="${PYTHON:-python3}"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  for f in "$tests"/test_*.py; do
    case "$(basename "$f")" in
      *router* | *permutation* | *_ep* | *ep_moe* | *grouped_gemm*) ;;
      *) files+=("$(basename "$f")") ;;
    esac
  done
fi
if [ -n "${CPU_DEVICES:-}" ]; then
  export XLA_FLAGS="--xla_force_host_platform_device_count=$CPU_DEVICES ${XLA_FLAGS:-}"
fi
export PYTHONPATH="$here/tests/te_port:$here/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$tests" || exit 1
printf '%-44s %9s %7s %7s %8s %7s\n' file collected passed failed skipped errors
# Counts come from pytest's progress characters, so a file stopped by the timeout still counts
# what ran (its line says so).
for f in "${files[@]}"; do
  plugins=""
  [ "${CPU_SIZES:-0}" = 1 ] && plugins="-p te_cpu_sizes"
  log="$(mktemp)"
  # shellcheck disable=SC2086  # PYTEST_ARGS and plugins are word lists
  timeout "${PER_FILE_TIMEOUT:-1200}" "$py" -m pytest "$f" -q -p no:cacheprovider --tb=no -rN \
    $plugins ${PYTEST_ARGS:-} >"$log" 2>&1
  rc=$?
  marks="$(grep -E '^[.FEsxX]+( +\[ *[0-9]+%\])?$' "$log" | sed -E 's/ +\[.*//' | tr -d '\n')"
  count() { printf '%s' "$marks" | tr -cd "$1" | wc -c; }
  p=$(count '.'); fl=$(count 'F'); s=$(count 's'); e=$(count 'E')
  if [ -z "$marks" ] && grep -qE 'errors? during collection|^ERROR ' "$log"; then e=1; fi
  note=""
  [ "$rc" = 124 ] && note="  (stopped at the ${PER_FILE_TIMEOUT:-1200} s timeout)"
  printf '%-44s %9s %7s %7s %8s %7s%s\n' "$f" $((p + fl + s + e)) "$p" "$fl" "$s" "$e" "$note"
  rm -f "$log"
done
