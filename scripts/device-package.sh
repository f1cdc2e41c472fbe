#!/usr/bin/env bash
# Packs what the GPU machine needs into .device/ (git-ignored): the built test and bench
# binaries and every non-glibc shared library they load (CAF, UCX, numa, OpenBLAS, CUDA
# runtime). Run after ./scripts/build.sh on a machine with nvcc; then, with the device tool:
#   run(command="scripts/device-check.sh", carry=[".device"])
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .device && mkdir -p .device/bin .device/lib
bins=(build/tests/baton_gpu_tests build/tests/baton_tests build/deploy/baton build/bench/baton_bench_cpu
      build/bench/baton_bench_placement build/bench/baton_bench_store)
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "device-package: $b missing (build with nvcc first)" >&2; exit 1; }
  cp "$b" .device/bin/
  ldd "$b" | awk '/=> \// {print $3}' | grep -v -E '/(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|ld-linux)[.-]' |
    while read -r lib; do cp -L -n "$lib" .device/lib/; done
done
du -sh .device
