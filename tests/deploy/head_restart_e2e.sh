#!/usr/bin/env bash
# kill -9 of the head (router, balancers, node directory, prefill rank) of a launched cluster:
# `baton launch --restart-failed` starts it again, the decode nodes and the gateway keep their
# processes (and models), wait for it and join it afresh, the store node's block server is
# adopted again, and the cluster answers as before -- through the C++ client and through the
# gateway on its same port, which answered 503 (not a refused connection) meanwhile.
# Usage: head_restart_e2e.sh BATON_BINARY SOURCE_DIR. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
SRC=$2
WORK=$(mktemp -d /tmp/baton-head-restart-e2e-XXXXXX)
LAUNCHER=""
source "$(dirname "$0")/e2e_lib.sh"
trap stop_launcher EXIT
fail() { echo "head restart e2e: FAILED: $*" >&2; echo "--- launcher:" >&2; cat "$WORK/launch.log" >&2; exit 1; }
count() { grep -c "$1" "$WORK/launch.log" || true; }

read -r P_ROUTER P_CLUSTER P_HTTP P_STORE < <(free_ports 4)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "headless",
  "model": "$SRC/models/baton-kjv-tiny",
  "store": {"dir": "$WORK/store", "block_tokens": 16},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "prefill_ranks": 1,
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "store-a", "host": "127.0.0.1", "roles": ["store"], "ports": {"store": $P_STORE}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]},
    {"name": "decode-b", "host": "127.0.0.1", "roles": ["decode"]},
    {"name": "gw", "host": "127.0.0.1", "roles": ["gateway"], "ports": {"http": $P_HTTP}}
  ]
}
SPEC
# The head is restarted 2 s after its death: a window in which the gateway must answer 503.
launch_cluster --restart-failed 1 --restart-backoff-ms 2000
URL="http://127.0.0.1:$P_HTTP/v1/completions"
ask() {
  "$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id headless --prompt "In the beginning" \
    --prompt "And the earth was" --max-tokens 16 > "$WORK/$1.txt" || fail "generate ($1)"
  curl -sf "$URL" -d '{"prompt":"Let there be","max_tokens":12}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])' \
    > "$WORK/$1-http.txt" || fail "the gateway did not answer ($1)"
  [ -s "$WORK/$1.txt" ] && [ -s "$WORK/$1-http.txt" ] || fail "an empty answer ($1)"
}
ask before
PIDS_BEFORE=$(pgrep -f "baton (node|gateway) .*127.0.0.1:$P_CLUSTER" | sort | tr '\n' ' ')
STORE_PID=$(pgrep -f "baton node --role store .*127.0.0.1:$P_STORE" | head -1) || fail "no store node process found"
[ "$(echo $PIDS_BEFORE | wc -w)" = 3 ] || fail "expected 3 node processes (2 decode, 1 gateway), found: $PIDS_BEFORE"
HEAD_PID=$(pgrep -f "baton local .*--cluster-listen 127.0.0.1:$P_CLUSTER" | head -1) || fail "no head process found"
kill -9 "$HEAD_PID"
# While the head is away the gateway keeps its port: a load balancer's probe gets 503 saying so
# (with Retry-After), never a refused connection, until it serves again through the restarted
# head (2 s and a model load later: many probes).
AWAY=0
for _ in $(seq 600); do
  code=$(curl -s -m 10 -o "$WORK/away.json" -D "$WORK/away.head" -w '%{http_code}' "http://127.0.0.1:$P_HTTP/health" || true)
  case "$code" in
    200) ;;  # the restarted head is serving already
    503) grep -q "went away; this gateway waits" "$WORK/away.json" && grep -qi "^Retry-After: 1" "$WORK/away.head" && AWAY=1 ;;
    *) fail "while the head was away the gateway answered /health with '$code' (want 503): $(cat "$WORK/away.json" 2>/dev/null)" ;;
  esac
  grep -q "baton gateway: serving again" "$WORK/launch.log" && break
  sleep 0.05
done
[ "$AWAY" = 1 ] || fail "no /health probe while the head was away was answered 503 naming the wait"
for _ in $(seq 600); do grep -q "baton launch: head head up again" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "baton launch: the head exited (signal 9); restarted it (1 of 1" "$WORK/launch.log" || fail "the launcher did not restart the head"
grep -q "baton launch: head head up again" "$WORK/launch.log" || fail "the restarted head did not listen"
for n in decode-a decode-b; do
  for _ in $(seq 600); do [ "$(count "baton node $n: joined the head")" -ge 2 ] && break; sleep 0.1; done
  grep -q "baton node $n: the head went away; its ranks stopped; waiting up to 120 s for a head at" "$WORK/launch.log" ||
    fail "$n did not say it waits for the head (as long as the launcher: --wait-s 90 plus 30 s of backoff)"
  [ "$(count "baton node $n: joined the head")" -ge 2 ] || fail "$n did not join the restarted head"
done
for _ in $(seq 600); do grep -q "baton gateway: serving again on http://127.0.0.1:$P_HTTP" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "baton gateway: serving again on http://127.0.0.1:$P_HTTP, through the head that came back" "$WORK/launch.log" ||
  fail "the gateway did not serve again through the restarted head"
ask after
cmp -s "$WORK/before.txt" "$WORK/after.txt" || fail "the client's answers changed: $(diff "$WORK/before.txt" "$WORK/after.txt")"
cmp -s "$WORK/before-http.txt" "$WORK/after-http.txt" || fail "the gateway's answer changed"
PIDS_AFTER=$(pgrep -f "baton (node|gateway) .*127.0.0.1:$P_CLUSTER" | sort | tr '\n' ' ')
[ "$PIDS_BEFORE" = "$PIDS_AFTER" ] || fail "node processes changed: before $PIDS_BEFORE, after $PIDS_AFTER"
kill -0 "$STORE_PID" 2>/dev/null || fail "the store node's process ended"
[ "$(count "store node(s) adopted")" -ge 2 ] || fail "the restarted head did not adopt the store node again"
# The store serves the new head: a long prompt's blocks are written back, and asked again, its
# prefix is loaded from store-a instead of computed.
metric() { curl -sf "http://127.0.0.1:$P_HTTP/metrics" | grep "^$1 " | awk '{print $2}'; }
LONG='{"prompt":"In the beginning God created the heaven and the earth. And the earth was without form, and void.","max_tokens":4}'
curl -sf "$URL" -d "$LONG" > /dev/null || fail "the long prompt was not answered"
for _ in $(seq 100); do [ "$(metric baton_store_blocks)" -ge 1 ] 2>/dev/null && break; sleep 0.1; done
[ "$(metric baton_store_blocks)" -ge 1 ] || fail "no block reached the store after the restart"
# The write-back of the first ask's block lands after its answer (and the store may already hold
# blocks from before the restart, so the count above does not say it landed): ask again, bounded,
# until an ask loads a prefix.
CACHED0=$(metric baton_cached_prompt_tokens_total)
for _ in $(seq 50); do
  curl -sf "$URL" -d "$LONG" > /dev/null || fail "the long prompt was not answered again"
  [ "$(metric baton_cached_prompt_tokens_total)" -gt "${CACHED0:-0}" ] 2>/dev/null && break
  sleep 0.1
done
[ "$(metric baton_cached_prompt_tokens_total)" -gt "${CACHED0:-0}" ] || fail "no later ask (50, 5 s) loaded a prefix from the store"
grep -q "node decode-[ab] restarted\|node gw restarted" "$WORK/launch.log" && fail "a node was restarted instead of waiting"
echo "head restart e2e: the head killed with SIGKILL and restarted: decode nodes and gateway kept their processes, joined it again, and the answers are the same"
stop_launched
echo "head restart e2e: all checks passed"
