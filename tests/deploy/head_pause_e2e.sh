#!/usr/bin/env bash
# The head stalls (SIGSTOP for 3 s: a VM pause, a starved host) and goes on (SIGCONT): its node
# directory must not take its own stall for its nodes' silence. Before, every node was declared
# gone ("missed its heartbeats") the moment the head went on, and every stream failed over.
# Usage: head_pause_e2e.sh BATON_BINARY SOURCE_DIR. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
SRC=$2
WORK=$(mktemp -d /tmp/baton-head-pause-e2e-XXXXXX)
LAUNCHER=""
source "$(dirname "$0")/e2e_lib.sh"
cont_head() { [ -n "${HEAD_PID:-}" ] && kill -CONT "$HEAD_PID" 2>/dev/null || true; }
trap 'cont_head; stop_launcher' EXIT
fail() { echo "head pause e2e: FAILED: $*" >&2; echo "--- launcher:" >&2; cat "$WORK/launch.log" >&2; exit 1; }

read -r P_ROUTER P_CLUSTER P_HTTP < <(free_ports 3)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "paused",
  "model": "$SRC/models/baton-kjv-tiny",
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]},
    {"name": "gw", "host": "127.0.0.1", "roles": ["gateway"], "ports": {"http": $P_HTTP}}
  ]
}
SPEC
launch_cluster
URL="http://127.0.0.1:$P_HTTP/v1/completions"
for _ in $(seq 300); do curl -sf -m 10 "$URL" -d '{"prompt":"In the beginning","max_tokens":4}' > "$WORK/before.json" 2>/dev/null && break; sleep 0.1; done
[ -s "$WORK/before.json" ] || fail "no answer before the pause"
HEAD_PID=$(pgrep -f "baton local .*--cluster-listen 127.0.0.1:$P_CLUSTER" | head -1) || fail "no head process found"
kill -STOP "$HEAD_PID"
sleep 3  # past the 2 s of silence (4 heartbeats of 500 ms) after which a node counts as gone
kill -CONT "$HEAD_PID"
sleep 2  # four more heartbeat intervals: a node really silent would be declared by now
if grep -q "missed its heartbeats" "$WORK/launch.log"; then fail "the head's own stall was taken for its nodes' silence"; fi
curl -sf -m 30 "$URL" -d '{"prompt":"In the beginning","max_tokens":4}' > "$WORK/after.json" || fail "no answer after the pause"
cmp -s <(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"])' "$WORK/before.json") \
       <(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"])' "$WORK/after.json") ||
  fail "the answer after the pause differs from the one before"
echo "head pause e2e: all checks passed"
