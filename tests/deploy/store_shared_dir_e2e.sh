#!/usr/bin/env bash
# docs/cluster-spec.md's store layout: a head with the store role and two store nodes on one host,
# all under one store directory, each server in its own server-N. Before, the first process to
# lock the directory refused the others ("served by another block server already") and the
# cluster did not start. Checks: it starts, /health counts three servers up, each folder holds
# blocks, a repeated prompt is served from the store; the same store node started twice is refused.
# Usage: store_shared_dir_e2e.sh BATON_BINARY SOURCE_DIR. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
SRC=$(cd "$2" && pwd)
WORK=$(mktemp -d /tmp/baton-store-shared-e2e-XXXXXX)
LAUNCHER=""
source "$(dirname "$0")/e2e_lib.sh"
trap stop_launcher EXIT
fail() { echo "store shared dir e2e: FAILED: $*" >&2; echo "--- launcher:" >&2; cat "$WORK/launch.log" >&2; exit 1; }

read -r P_ROUTER P_CLUSTER P_HTTP P_STORE_A P_STORE_B P_AGAIN < <(free_ports 6)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "shareddir",
  "model": "$SRC/models/baton-kjv-tiny",
  "store": {"dir": "$WORK/store", "block_tokens": 16, "rank_cache_blocks": 0},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill", "store", "gateway"],
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER, "http": $P_HTTP}},
    {"name": "store-a", "host": "127.0.0.1", "roles": ["store"], "ports": {"store": $P_STORE_A}},
    {"name": "store-b", "host": "127.0.0.1", "roles": ["store"], "ports": {"store": $P_STORE_B}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]}
  ]
}
SPEC
launch_cluster
URL="http://127.0.0.1:$P_HTTP"
for _ in $(seq 300); do curl -sf -m 5 "$URL/health" > "$WORK/health.json" 2>/dev/null && break; sleep 0.1; done
python3 - "$WORK/health.json" <<'PY' || fail "/health does not count three store servers up: $(cat "$WORK/health.json")"
import json, sys
h = json.load(open(sys.argv[1]))
sys.exit(0 if h.get("store_servers") == 3 and h.get("store_servers_up") == 3 else 1)
PY
# A prompt of many blocks, twice: written back the first time, read from the store the second.
P="In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness was upon the face of the deep."
ask() { curl -sf -m 60 "$URL/v1/completions" -d "{\"prompt\":\"$P\",\"max_tokens\":4}"; }
ask > "$WORK/first.json" || fail "the first request failed"
cached=0
for _ in $(seq 50); do
  ask > "$WORK/again.json" || fail "a repeated request failed"
  cached=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["usage"].get("prompt_tokens_details",{}).get("cached_tokens",0))' "$WORK/again.json")
  [ "$cached" -gt 0 ] && break
  sleep 0.2
done
[ "$cached" -gt 0 ] || fail "the repeated prompt found nothing in the store"
for d in server-0 server-1 server-2; do [ -d "$WORK/store/$d" ] || fail "no $d under the store directory"; done
# The same store node started again on the directory is refused, naming the holder's lock.
if "$BATON" node --role store --name store-a --store-dir "$WORK/store" --listen "127.0.0.1:$P_AGAIN" > "$WORK/again.log" 2>&1; then
  fail "a second store-a on the same directory started"
fi
grep -q "is served by another block server already" "$WORK/again.log" || fail "the second store-a did not say why: $(cat "$WORK/again.log")"
echo "store shared dir e2e: all checks passed"
