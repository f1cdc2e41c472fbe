#!/usr/bin/env bash
# Configures and builds Baton into build/ (Release, -j2). CUDA code is built when nvcc exists
# (/usr/local/cuda/bin/nvcc); pass -DWITH_CUDA=OFF in BATON_CMAKE_ARGS to skip it.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${BATON_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "${BATON_JOBS:-2}"
