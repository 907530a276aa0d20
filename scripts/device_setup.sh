#!/usr/bin/env bash
# Source at the start of a device call: unpack the libraries (and check programs) carried as
# tarballs in .carry/, point lowbit at them, and install TransformerEngine's peer once per machine.
#   source scripts/device_setup.sh [te]
# Unpacked once per tarball content: parallel streams that source this again must not rewrite
# libraries another process is loading.
for t in .carry/libs.tar.gz .carry/checks*.tar.gz; do
  [ -f "$t" ] || continue
  stamp=.carry/.unpacked_$(basename "$t") sum=$(md5sum <"$t")
  [ "$(cat "$stamp" 2>/dev/null)" = "$sum" ] || { tar -C .carry -xzf "$t" && echo "$sum" >"$stamp"; }
done
export LOWBIT_BUILD_DIR=$PWD/.carry/prebuilt OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
if [ "${1:-}" = te ] && [ ! -f /tmp/te-site/env.sh ] && [ -d .carry/tepeer ]; then
  bash .carry/tepeer/install.sh --no-gpu-test >"$OUT/te_install.log" 2>&1 || tail -5 "$OUT/te_install.log"
fi
[ "${1:-}" = te ] && [ -f /tmp/te-site/env.sh ] && source /tmp/te-site/env.sh
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
