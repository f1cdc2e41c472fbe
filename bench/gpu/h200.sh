#!/usr/bin/env bash
# The one device script (issue 11): every GPU check and benchmark in one call, conformance first
# (stopping with diagnostics if it fails), then timings, a summary table last. Runs prebuilt
# binaries from .device/ (scripts/device-package.sh); cuBLAS comes from the GPU machine's own CUDA
# (libcublasLt is 540 MB, too large to carry).
#   run(command="bench/gpu/h200.sh", carry=[".device"], timeout_s=540)
#   bench/gpu/h200.sh --dry-run     # here, without a GPU: every step runs, the GPU parts skip
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out="${OUT:-/tmp/baton-h200-out}"
mkdir -p "$out"
quick=""
case "${1:-}" in --dry-run | --quick) quick="--quick" ;; esac  # --quick: a short pass on the GPU
bin=.device/bin
[ -x "$bin/baton_gpu_tests" ] || bin=build/tests  # the dry run uses the build tree
gpu_tests="$bin/baton_gpu_tests"
bench="$(dirname "$bin")/bin/baton_bench_gpu"
[ -x "$bench" ] || bench=build/bench/baton_bench_gpu
cub=$(dirname "$(ls /usr/local/cuda*/targets/x86_64-linux/lib/libcublasLt.so.13 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH="$root/.device/lib:${cub:-/usr/local/cuda/lib64}:${LD_LIBRARY_PATH:-}"
export UCX_NET_DEVICES=lo PYTHONUNBUFFERED=1 BATON_SOURCE_DIR="$root"
log="$out/h200.txt"
: > "$log"
say() { echo "$@" | tee -a "$log"; }

say "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$log" || say "no nvidia-smi"

say "== references made by transformers in this run (bf16 and fp32 on this GPU)"
refs="$out/.hf_reference"
if python3 -c "import torch, transformers" 2>/dev/null; then
  python3 scripts/hf_reference.py --out "$refs" 2>&1 | grep -v "Writing model shards" | tee -a "$log"
  export BATON_HF_REFERENCE_DIR="$refs"
else
  say "(no transformers here: the committed references are used)"
fi

say "== conformance: every kernel against its CPU reference, the executor against transformers"
"$gpu_tests" -s --duration=true 2>&1 | tee "$out/conformance.txt" | grep -E -A1 "MESSAGE|ERROR|test cases|assertions" | tee -a "$log"
if grep -q "Status: FAILURE" "$out/conformance.txt"; then
  say "conformance FAILED: timings skipped. Diagnostics:"
  grep -B3 -A12 "ERROR" "$out/conformance.txt" | head -150 | tee -a "$log"
  exit 1
fi

say "== baton_bench_gpu"
timeout 300 "$bench" $quick --json "$out/gpu_bench.jsonl" 2>&1 | tee "$out/bench.txt"
rc=${PIPESTATUS[0]}
[ "$rc" = 2 ] && say "(no GPU: benchmark skipped)"

say "== PyTorch/transformers eager on the same GPU (the peer)"
timeout 150 python3 bench/gpu/torch_peer.py $quick --json "$out/torch_peer.jsonl" 2>&1 | tee -a "$log"

say "== summary"
grep -E "^\| |^ceilings|^prefix upload|^prefill" "$out/bench.txt" | tee -a "$log"
rm -rf "$refs"
