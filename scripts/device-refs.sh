#!/usr/bin/env bash
# References that only Hugging Face can make, run on the GPU machine (which has torch,
# transformers and tokenizers): issue 4's model and tokenizer goldens, with transformers' own bf16
# and fp32 GPU logits for the CUDA conformance bound. Everything lands in $OUT/refs.tgz; unpack it
# at the repository root and commit tests/data/hf_reference and tests/data/tokenizer_golden.
#   run(command="scripts/device-refs.sh", carry=[".device"])
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/baton-refs}"
mkdir -p "$out" && export PYTHONUNBUFFERED=1
work=$(mktemp -d)
{
  echo "== hf_reference"; python3 scripts/hf_reference.py --out "$work/tests/data/hf_reference" 2>&1
  echo "== tokenizer_golden"; python3 scripts/tokenizer_golden.py --out "$work/tests/data/tokenizer_golden" 2>&1
  echo "== where the GPU machine keeps cuBLAS (too large to carry: libcublasLt is 540 MB)"
  find / -xdev \( -name "libcublasLt.so*" -o -name "libcublas.so*" \) 2>/dev/null | head; python3 -c "import torch; print(torch.__file__)"
  echo "== cuda IPC between two processes (seen working 2026-11-30)"
  python3 scripts/cuda_ipc_probe.py 2>&1
  if [ -x .device/bin/baton_gpu_tests ]; then
    echo "== our binaries run here"
    cub=$(dirname "$(find / -xdev -name "libcublasLt.so.13*" 2>/dev/null | head -1)")
    LD_LIBRARY_PATH="$PWD/.device/lib:$cub" .device/bin/baton_gpu_tests 2>&1 | tail -4
  fi
} 2>&1 | tee "$out/refs.txt"
tar -C "$work" -czf "$out/refs.tgz" tests
