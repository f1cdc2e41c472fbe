#!/usr/bin/env bash
# The one prepared script for the GPU machine: correctness first, then timings, everything
# written under $OUT. Runs from a copy of the repository with .device/ carried in
# (scripts/device-package.sh). On a machine without a GPU it still runs: GPU cases skip.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/baton-device-out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/.device/lib:${LD_LIBRARY_PATH:-}"
export UCX_NET_DEVICES=lo
{
  echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  echo "== GPU conformance (every kernel against its CPU reference)"
  .device/bin/baton_gpu_tests --success=false 2>&1
  echo "== CPU suite on this machine (no network beyond 127.0.0.1)"
  .device/bin/baton_tests --test-case-exclude="across processes*" 2>&1 | tail -3
  echo "== CPU executor benchmark (host CPU of the GPU machine)"
  .device/bin/baton_bench_cpu --threads 4 --quick 2>&1
  echo "== placement decision (16/256/1024 ranks) and store CHECK/read on the host"
  .device/bin/baton_bench_placement --decisions 5001 2>&1
  .device/bin/baton_bench_store --dir "$out" 2>&1
  echo "== cost profile of the CPU executor, 4 threads"
  .device/bin/baton profile --executor-threads 4 --repeats 1 --out "$out/cpu_profile_4threads.json" 2>&1 | tail -3
} | tee "$out/device-check.txt"
