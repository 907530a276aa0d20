#!/usr/bin/env bash
# Format and lint checks (what .ci/run and the pre-commit hooks run), with pinned tool versions.
#   scripts/lint.sh         check only; non-zero exit on any violation
#   scripts/lint.sh --fix   rewrite the files instead
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.6
CLANG_FORMAT_VERSION=18.1.8
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
"$PY" -m pip install -q --disable-pip-version-check "ruff==$RUFF_VERSION" "clang-format==$CLANG_FORMAT_VERSION"
BIN=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")
mapfile -t cxx < <(git ls-files '*.cc' '*.cu' '*.cuh' '*.h')
if [ "${1:-}" = --fix ]; then
  "$BIN/ruff" format .
  "$BIN/ruff" check --fix .
  "$BIN/clang-format" -i "${cxx[@]}"
else
  "$BIN/ruff" format --check .
  "$BIN/ruff" check .
  "$BIN/clang-format" --dry-run --Werror "${cxx[@]}"
fi
echo "lint: ruff $RUFF_VERSION, clang-format $CLANG_FORMAT_VERSION: clean (${#cxx[@]} C++/CUDA files)"
