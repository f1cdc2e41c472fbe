#!/usr/bin/env bash
# kill -9 of a block server mid-read (issue 10): a cluster from a spec on 127.0.0.1 whose block
# server runs in its own process on its own directory (store node store-a; the head adopts it),
# prefill ranks without a rank-local prefix tier (every cached prefix comes from the store). 20
# prompts of 3 blocks each are answered undisturbed first (their blocks are written back to
# store-a), then the same 20 are streamed at once: each loads its prefix from store-a, which
# fault injection makes slow (BATON_FAULT_LAYER_DELAY_MS: 250 ms per layer, a slow disk), and
# store-a is killed with SIGKILL while it serves them. The reads in flight fail, the blocks are
# recomputed, and every client must get exactly the undisturbed text; the launcher reports the
# store node gone and the cluster serves on (now without the store's blocks). Before the kill, a
# prompt repeated twice loads its prefix from store-a both times.
# Usage: store_kill_e2e.sh BATON_BINARY SOURCE_DIR. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
SRC=$(cd "$2" && pwd)
WORK=$(mktemp -d /tmp/baton-store-kill-e2e-XXXXXX)
LAUNCHER=""
source "$(dirname "$0")/e2e_lib.sh"
trap stop_launcher EXIT
fail() { echo "store kill e2e: FAILED: $*" >&2; echo "--- launcher:" >&2; cat "$WORK/launch.log" >&2; exit 1; }

read -r P_ROUTER P_CLUSTER P_HTTP P_STORE < <(free_ports 4)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "storekill",
  "model": "$SRC/models/baton-kjv-tiny",
  "store": {"dir": "$WORK/store", "block_tokens": 16, "rank_cache_blocks": 0},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill", "gateway"], "prefill_ranks": 2,
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER, "http": $P_HTTP}},
    {"name": "store-a", "host": "127.0.0.1", "roles": ["store"], "ports": {"store": $P_STORE},
     "env": {"BATON_FAULT_LAYER_DELAY_MS": "250"}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]}
  ]
}
SPEC
launch_cluster
grep -q "store node store-a started" "$WORK/launch.log" || fail "the store node did not start first"
URL="http://127.0.0.1:$P_HTTP/v1/completions"
N=20 TOKENS=16
# Each prompt's first block differs (the verse number leads), so each has 3 blocks of its own.
body() {
  echo "{\"prompt\":\"Verse $1. In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness was upon the face of the deep.\",\"max_tokens\":$TOKENS,\"ignore_eos\":true,\"stream\":true}"
}
metric() { curl -sf "http://127.0.0.1:$P_HTTP/metrics" | grep "^$1 " | awk '{print $2}'; }

for i in $(seq $N); do curl -sN -m 60 "$URL" -d "$(body "$i")" > "$WORK/calm$i.txt" || fail "undisturbed request $i: curl exit $? (7: nothing listened), it got: $(head -c 300 "$WORK/calm$i.txt")"; done
# Write-backs land after each sequence ends: wait (bounded) until store-a holds every block.
for _ in $(seq 300); do [ "$(metric baton_store_blocks)" -ge $((3 * N)) ] 2>/dev/null && break; sleep 0.1; done
[ "$(metric baton_store_blocks)" -ge $((3 * N)) ] || fail "store-a holds $(metric baton_store_blocks) blocks, expected >= $((3 * N))"
# Hits repeat: one prompt twice more, each time loading its prefix from store-a. (Each hit at the
# index touches the blocks on their server; that message once could not cross processes, broke
# the link to store-a at the first hit, and every later prompt missed.)
for k in 1 2; do
  curl -sf -m 60 "$URL" -d "$(body 1 | sed 's/"stream":true/"stream":false/')" > "$WORK/repeat$k.json" ||
    fail "repeat $k of prompt 1 failed"
  python3 -c "import json,sys; u=json.load(open(sys.argv[1]))['usage']; sys.exit(0 if u['prompt_tokens_details']['cached_tokens'] >= 32 else 1)" \
    "$WORK/repeat$k.json" || fail "repeat $k of prompt 1 loaded no prefix from store-a: $(cat "$WORK/repeat$k.json")"
done
CACHED0=$(metric baton_cached_prompt_tokens_total)

PID_S=$(pgrep -f -- "--name store-a --listen 127.0.0.1:$P_STORE" | head -1)
[ -n "$PID_S" ] || fail "no store-a process"
CLIENTS=()
for i in $(seq $N); do
  curl -sN -m 120 "$URL" -d "$(body "$i")" > "$WORK/hit$i.txt" &
  CLIENTS+=($!)
done
# One read takes >= 1 s (4 layers x 250 ms) and store-a serves them one at a time: the kill comes
# once a first prefix has landed (so some were served), while the next ones are half-way or
# queued. Polled, not slept: under load the first read may take longer.
for _ in $(seq 300); do [ "$(metric baton_cached_prompt_tokens_total)" -gt "${CACHED0:-0}" ] 2>/dev/null && break; sleep 0.1; done
kill -9 "$PID_S"
T_KILL=$(date +%s.%N)
wait "${CLIENTS[@]}" || true
echo "store kill e2e: the clients finished $(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$T_KILL" "$(date +%s.%N)") s after the kill"

python3 "$(dirname "$0")/same_answers.py" "$WORK" "$N" calm hit length ||
  fail "a client saw something other than the undisturbed answer"
for _ in $(seq 100); do grep -q "node store-a left (signal 9)" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "node store-a left (signal 9)" "$WORK/launch.log" || fail "the launcher did not report store-a gone"
LOADED=$(( $(metric baton_cached_prompt_tokens_total) - CACHED0 ))
[ "$LOADED" -gt 0 ] || fail "no prefix was loaded from store-a before the kill: the kill came too early"
[ "$LOADED" -lt $((N * 48)) ] || fail "every prefix was loaded ($LOADED tokens): the kill came too late"
echo "store kill e2e: $N clients got the undisturbed text; $LOADED prompt tokens came from store-a before the kill, the rest were recomputed"
curl -sf -m 30 "$URL" -d "$(body 1 | sed 's/"stream":true/"stream":false/')" > "$WORK/after.json" ||
  fail "the cluster does not serve after the kill"
grep -q '"cached_tokens":0' "$WORK/after.json" || fail "a prefix was served from a dead store node: $(cat "$WORK/after.json")"
echo "store kill e2e: afterwards the index names no block on store-a (a miss, recomputed) and the cluster serves on"
HEALTH=$(curl -s -m 10 "http://127.0.0.1:$P_HTTP/health")
echo "$HEALTH" | grep -q '"status":"ok".*"store_servers":1,"store_servers_up":0' ||
  fail "/health does not show the store server down (the cluster still serves: 200): $HEALTH"
echo "store kill e2e: all checks passed"
