#!/usr/bin/env bash
# Compile one CUDA/C++ translation unit of this checkout with the CUDA build's flags (sm_90a,
# CUTLASS headers), to check a change without the full 10-25 minute build.
# Usage: scripts/nvcc_unit.sh csrc/kernels/cuda/norm.cu [extra nvcc flags, e.g. -Xptxas -v]
set -euo pipefail
src=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
cutlass=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
exec "$nvcc" -DLOWBIT_HAVE_CUTLASS=1 -I"$root/csrc/include" -isystem "$cutlass" -O3 -DNDEBUG \
  --generate-code=arch=compute_90a,code=[compute_90a,sm_90a] -Xcompiler=-fPIC --expt-relaxed-constexpr \
  -std=c++17 -x cu -c "$root/$src" -o "/tmp/nvcc_unit_$$.o" "$@"
