#!/usr/bin/env bash
# Install what is missing, build, and run every test. GPU tests skip without a device.
set -euo pipefail
cd "$(dirname "$0")/.."
export UCX_NET_DEVICES=lo   # tests talk to 127.0.0.1 only
./scripts/setup.sh
./scripts/build.sh
cd build
ctest --output-on-failure -j 2 "$@"
