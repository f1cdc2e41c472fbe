#!/usr/bin/env bash
# Install what is missing, build, and run every test, then each fuzz target for a bounded time.
# GPU tests skip without a device.
set -euo pipefail
cd "$(dirname "$0")/.."
export UCX_NET_DEVICES=lo   # tests talk to 127.0.0.1 only
./scripts/setup.sh
./scripts/build.sh
(cd build && ctest --output-on-failure -j 2 "$@")
# The fuzz targets, 10 s each from their seed corpora (clang + libFuzzer; skipped, saying so,
# without them): a regression check that keeps CI well under 30 minutes. Exploring is longer:
# `scripts/fuzz.sh 300`, or BATON_FUZZ_SECONDS.
./scripts/fuzz.sh "${BATON_FUZZ_SECONDS:-10}"
