#!/usr/bin/env bash
# Packs what the GPU machine needs into .device/ (git-ignored, under the 64 MiB a device call
# carries): the GPU test and bench binaries, `baton` itself, and every non-glibc shared library
# they load (CAF, UCX, OpenBLAS, PCRE2, the CUDA runtime, ...), except cuBLAS, which the GPU machine's
# own CUDA 13 provides (bench/gpu/h200.sh finds it), and NCCL (218 MB), which it has in /usr/lib. Run after ./scripts/build.sh with nvcc; then,
# with the device tool:
#   run(command="bench/gpu/h200.sh", carry=[".device"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .device && mkdir -p .device/bin .device/lib
bins=(build/tests/baton_gpu_tests build/bench/baton_bench_gpu build/deploy/baton build/bench/baton_bench_handoff
      build/bench/baton_bench_nccl build/bench/baton_bench_ucx build/bench/baton_cuda_ipc_probe)
# ucx_perftest (Debian's ucx-utils): the ceiling of bench/ucx_bench.sh, run there on 16 cores.
command -v ucx_perftest >/dev/null && bins+=("$(command -v ucx_perftest)")
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "device-package: $b missing (build with nvcc first)" >&2; exit 1; }
  strip -o ".device/bin/$(basename "$b")" "$b"
  ldd "$b" | awk '/=> \// {print $3}' |
    grep -v -E '/(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|ld-linux|libcublas|libcublasLt|libnccl)[.-]' |
    while read -r lib; do cp -L -n "$lib" .device/lib/; done
done
# UCX loads its cross-memory-attach transport as a module (bench/gpu/h200.sh sets UCX_MODULE_DIR).
mkdir -p .device/lib/ucx && cp -L /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0 .device/lib/ucx/ 2>/dev/null || true
# The tree and .device travel together under 64 MiB; xz packs the binaries to about a third
# (bench/gpu/h200.sh unpacks them there).
tar -C .device -cJf /tmp/baton-device-pack.tar.xz bin lib
rm -rf .device/bin .device/lib && mv /tmp/baton-device-pack.tar.xz .device/pack.tar.xz
du -sh .device
