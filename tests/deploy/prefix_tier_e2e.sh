#!/usr/bin/env bash
# `baton local --serve` without a block store still reuses a prompt's prefix: each prefill rank
# keeps the full blocks (64 tokens unless --block-tokens) it computed in its own KV pages, and a
# later prompt with the same prefix loads them instead of computing them (usage.cached_tokens),
# with the same text -- also a prefill rank in a node process of its own, keyed as the head
# keys; --prefix-cache-blocks 0 turns it off.
# Usage: prefix_tier_e2e.sh BATON_BINARY. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-prefix-tier-e2e-XXXXXX)
PID="" NODE=""
cleanup() {
  for p in $PID $NODE; do kill -9 "$p" 2>/dev/null; wait "$p" 2>/dev/null; done || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "prefix tier e2e: FAILED: $*" >&2; cat "$WORK"/*.log >&2 2>/dev/null || true; exit 1; }

serve() {  # serve LOG FLAGS...: starts baton local --serve with one prefill rank; sets PID and HTTP
  local log=$1
  shift
  "$BATON" local --serve --prefill-ranks 1 --http-listen 127.0.0.1:0 "$@" > "$WORK/$log" 2>&1 &
  PID=$!
  for _ in $(seq 600); do grep -q "serving;" "$WORK/$log" && break; kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
  grep -q "serving;" "$WORK/$log" || fail "it did not start serving ($*)"
  HTTP=$(grep -o "gateway listening on http://127.0.0.1:[0-9]*" "$WORK/$log" | grep -o "[0-9]*$")
}
# Prints "CACHED TEXT" of one call with a 137-token prompt (two full blocks of 64 and 9 more).
ask() {
  local prompt
  prompt=$(python3 -c 'print("And God said, Let there be light: and there was light. " * 8)')
  curl -sf -m 60 "http://127.0.0.1:$HTTP/v1/completions" -d "{\"prompt\":\"$prompt\",\"max_tokens\":8}" |
    python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["usage"]["prompt_tokens_details"]["cached_tokens"], json.dumps(j["choices"][0]["text"]))'
}

serve tier.log
read -r FIRST_CACHED FIRST_TEXT < <(ask)
read -r SECOND_CACHED SECOND_TEXT < <(ask)
[ "$FIRST_CACHED" = 0 ] || fail "the first call found $FIRST_CACHED tokens cached"
[ "$SECOND_CACHED" = 128 ] || fail "the second call found $SECOND_CACHED tokens cached, not two blocks of 64"
[ "$FIRST_TEXT" = "$SECOND_TEXT" ] || fail "the cached prefix changed the text: $FIRST_TEXT vs $SECOND_TEXT"
kill -9 "$PID"
wait "$PID" 2>/dev/null || true
PID=""
serve off.log --prefix-cache-blocks 0
ask > /dev/null
read -r OFF_CACHED OFF_TEXT < <(ask)
[ "$OFF_CACHED" = 0 ] || fail "with --prefix-cache-blocks 0 the second call found $OFF_CACHED tokens cached"
[ "$OFF_TEXT" = "$FIRST_TEXT" ] || fail "the text without the tier differs: $OFF_TEXT vs $FIRST_TEXT"
kill -9 "$PID"
wait "$PID" 2>/dev/null || true
PID=""
# The prefill rank in a `baton node` process: it learns the keying from the head as it joins.
serve node_head.log --prefill-ranks 0 --cluster-listen 127.0.0.1:0
CLUSTER=$(grep -o "cluster listening on 127.0.0.1:[0-9]*" "$WORK/node_head.log" | grep -o "[0-9]*$")
"$BATON" node --role prefill --name pn --connect "127.0.0.1:$CLUSTER" > "$WORK/node.log" 2>&1 &
NODE=$!
for _ in $(seq 600); do grep -q "joined the head" "$WORK/node.log" && break; kill -0 "$NODE" 2>/dev/null || break; sleep 0.1; done
grep -q "joined the head" "$WORK/node.log" || fail "the prefill node did not join"
for _ in $(seq 300); do curl -sf -m 5 "http://127.0.0.1:$HTTP/health" > /dev/null && break; sleep 0.1; done
read -r NODE_FIRST NODE_TEXT < <(ask)
read -r NODE_SECOND NODE_TEXT2 < <(ask)
[ "$NODE_FIRST" = 0 ] && [ "$NODE_SECOND" = 128 ] ||
  fail "a prefill rank in a node process found $NODE_FIRST, then $NODE_SECOND tokens cached (not 0, then 128)"
[ "$NODE_TEXT" = "$FIRST_TEXT" ] && [ "$NODE_TEXT2" = "$FIRST_TEXT" ] || fail "the node's text differs: $NODE_TEXT, $NODE_TEXT2"
echo "prefix tier e2e: no store: the second call loaded 128 of 137 prompt tokens from the rank's tier, same text $FIRST_TEXT; a prefill node process the same; off with --prefix-cache-blocks 0"
