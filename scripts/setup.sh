#!/usr/bin/env bash
# Installs every Debian package Baton needs. Idempotent: when everything is present it only
# queries dpkg and exits (well under a second). CUDA is optional and never installed here:
# the build picks up nvcc from /usr/local/cuda when it exists.
set -euo pipefail

packages=(
  build-essential cmake pkg-config git ca-certificates
  libcaf-dev            # CAF 0.17.6: actors, io middleman, OpenSSL module
  libssl-dev openssl    # mutual TLS between nodes; `baton launch` makes the cluster CA with openssl
  libucx-dev ucx-utils  # UCX 1.13.1: KV transport between processes
  nlohmann-json3-dev    # configs, cluster specs, traces
  libpcre2-dev          # tokenizer pre-split patterns (Unicode classes \p{L}, \p{N})
  libicu-dev            # tokenizers' NFC normalizer (Qwen's tokenizer.json asks for it)
  doctest-dev           # unit tests
  libopenblas-dev       # sgemm ceiling in bench/ (the executor does not use it)
  procps                # ps/pkill used by the cluster scripts
  curl                  # the gateway's end-to-end test talks HTTP with it
  python3 python3-yaml  # the end-to-end test finds free ports and parses the k8s manifests
  wrk                   # HTTP load on 127.0.0.1 (overload test, gateway and overload benchmarks)
  clang libclang-rt-14-dev  # libFuzzer targets (scripts/fuzz.sh, run by scripts/test.sh)
)
# The OpenAI Node.js SDK test (tests/node, test-only) needs Node.js and npm: Debian's, unless
# the machine already has its own (a NodeSource nodejs bundles npm and conflicts with Debian's).
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then packages+=(nodejs npm); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# Test-only npm packages, exactly as pinned in tests/node/package-lock.json.
npm_packages() {
  local dir
  dir="$(cd "$(dirname "$0")/.." && pwd)/tests/node"
  if [ ! -f "$dir/node_modules/openai/package.json" ]; then
    echo "setup: npm ci in tests/node (the OpenAI SDK test)"
    # Test-only: without the registry (offline, or a proxy whose certificate npm does not trust)
    # Baton still builds and runs; the end-to-end test then skips the SDK checks and says so.
    if ! npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error; then
      echo "setup: WARNING: npm ci failed; the OpenAI SDK checks in tests/deploy/launch_e2e.sh will be skipped" >&2
    fi
  fi
}

if [ ${#missing[@]} -eq 0 ]; then
  npm_packages
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo_cmd=(sudo); else
    echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
npm_packages
echo "setup: done"
