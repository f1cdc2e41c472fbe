#!/usr/bin/env bash
# The C++ client library as others use it: `cmake --install` into a prefix, an outside project
# (examples/client_app) finds it with find_package(baton) and links baton::client, and its
# program streams a completion from a running cluster -- the same text `baton generate` gets.
# Usage: client_install.sh BUILD_DIR SOURCE_DIR BATON_BINARY. Bounded waits; always cleans up.
set -euo pipefail
BUILD=$1 SRC=$2 BATON=$3
WORK=$(mktemp -d /tmp/baton-client-install-XXXXXX)
SERVER=""
cleanup() {
  [ -n "$SERVER" ] && kill -INT "$SERVER" 2>/dev/null && for _ in $(seq 100); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.1; done
  [ -n "$SERVER" ] && kill -9 "$SERVER" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
cmake --install "$BUILD" --prefix "$WORK/prefix" > "$WORK/install.log"
test -f "$WORK/prefix/include/baton/client.hpp"
! grep -q "caf/" "$WORK/prefix/include/baton/client.hpp"  # the public header needs no CAF
cmake -S "$SRC/examples/client_app" -B "$WORK/app" -DCMAKE_PREFIX_PATH="$WORK/prefix" -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$WORK/app" -j 2 > /dev/null
# The installed library speaks this build's wire form: the same fingerprint as the baton binary.
APP_WIRE=$("$WORK/app/client_app" --version | grep -o "wire [0-9a-f]*$")
[ -n "$APP_WIRE" ] && "$BATON" --version | grep -q "$APP_WIRE\$" || {
  echo "client_app's $APP_WIRE differs from: $("$BATON" --version)"; exit 1; }
"$BATON" local --serve --router-listen 127.0.0.1:0 > "$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 600); do grep -q "router listening" "$WORK/server.log" && break; sleep 0.1; done
PORT=$(grep -o "router listening on 127.0.0.1:[0-9]*" "$WORK/server.log" | grep -o "[0-9]*$")
"$WORK/app/client_app" 127.0.0.1 "$PORT" "In the beginning" > "$WORK/app.txt"
"$BATON" generate --router "127.0.0.1:$PORT" --prompt "In the beginning" --max-tokens 12 > "$WORK/generate.txt"
head -c "$(wc -c < "$WORK/generate.txt")" "$WORK/app.txt" | cmp -s - "$WORK/generate.txt" || {
  echo "client_app's text differs from baton generate's"; cat "$WORK/app.txt" "$WORK/generate.txt"; exit 1; }
grep -q "\[12 tokens, length\]" "$WORK/app.txt"
echo "client install: find_package(baton) + baton::client streamed the same text as baton generate"
