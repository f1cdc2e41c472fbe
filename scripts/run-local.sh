#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine: install what is missing, build, and run a local
# disaggregated cluster on the built-in model. Extra arguments go to `baton local`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
exec ./build/deploy/baton local "$@"
