#!/usr/bin/env bash
# A store node lost while the head lives, and adopted again: a cluster from a spec on 127.0.0.1
# whose only block server runs in store node store-a, launched with --restart-failed. Prompts are
# written back to store-a and hit; then, by MODE:
# - kill: store-a is killed with SIGKILL; the launcher starts it again on the same directory and
#   port, and the head adopts it again (store_keeper) without restarting. Then /health counts the
#   server up again, a prompt written before the kill is a hit again from the blocks the new
#   process found on its disk (read by the head's prefill rank), with the same text, and a prompt
#   first asked after the restart is written back to it by the decode node (in a process of its
#   own) and hits too.
# - stall: store-a is stopped with SIGSTOP: alive, its TCP links open, answering nothing (a hung
#   node, or one whose packets are dropped). The head gives it up after a probe goes unanswered for 3 s;
#   /health counts it down and prompts are answered meanwhile, with the same text. Then SIGCONT:
#   the head adopts it again (the node's host replaces its old server), /health counts it up, and
#   a prompt written before the stall is a hit again, with the same text.
# Usage: store_restart_e2e.sh BATON_BINARY SOURCE_DIR [kill|stall]. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
SRC=$(cd "$2" && pwd)
MODE=${3:-kill}
case "$MODE" in kill|stall) ;; *) echo "store restart e2e: MODE must be kill or stall, not '$MODE'" >&2; exit 2 ;; esac
WORK=$(mktemp -d /tmp/baton-store-restart-e2e-XXXXXX)
LAUNCHER=""
source "$(dirname "$0")/e2e_lib.sh"
PID_S=""
# A stopped store-a would ignore the launcher's stop signal until continued.
trap '{ [ -n "$PID_S" ] && kill -CONT "$PID_S" 2>/dev/null; } || true; stop_launcher' EXIT
fail() { echo "store restart e2e ($MODE): FAILED: $*" >&2; echo "--- launcher:" >&2; cat "$WORK/launch.log" >&2; exit 1; }

read -r P_ROUTER P_CLUSTER P_HTTP P_STORE < <(free_ports 4)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "storerestart",
  "model": "$SRC/models/baton-kjv-tiny",
  "store": {"dir": "$WORK/store", "block_tokens": 16, "rank_cache_blocks": 0},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill", "gateway"],
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER, "http": $P_HTTP}},
    {"name": "store-a", "host": "127.0.0.1", "roles": ["store"], "ports": {"store": $P_STORE}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]}
  ]
}
SPEC
launch_cluster --restart-failed 1 --restart-backoff-ms 200
URL="http://127.0.0.1:$P_HTTP/v1/completions"
# Each prompt's first block differs (the verse number leads): 3 blocks of its own.
body() {
  echo "{\"prompt\":\"Verse $1. In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness was upon the face of the deep.\",\"max_tokens\":16,\"ignore_eos\":true}"
}
metric() { curl -sf "http://127.0.0.1:$P_HTTP/metrics" | grep "^$1 " | awk '{print $2}'; }
cached() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['usage']['prompt_tokens_details']['cached_tokens'])" "$1"; }
text() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['choices'][0]['text'])" "$1"; }
ask() { curl -sf -m 60 "$URL" -d "$(body "$1")" > "$WORK/$2.json" || fail "prompt $1 ($2) failed"; }
wait_blocks() {
  for _ in $(seq 300); do [ "$(metric baton_store_blocks)" -ge "$1" ] 2>/dev/null && break; sleep 0.1; done
  [ "$(metric baton_store_blocks)" -ge "$1" ] || fail "the store holds $(metric baton_store_blocks) blocks, expected >= $1"
}

# wait_log TEXT WHAT: up to 30 s for TEXT in the launcher's log, else fail naming WHAT.
wait_log() {
  for _ in $(seq 300); do grep -q "$1" "$WORK/launch.log" && break; sleep 0.1; done
  grep -q "$1" "$WORK/launch.log" || fail "$2"
}
# wait_health UP: up to 10 s for /health to count UP of the 1 block server, else fail.
wait_health() {
  for _ in $(seq 100); do
    curl -s -m 10 "http://127.0.0.1:$P_HTTP/health" | grep -q "\"store_servers\":1,\"store_servers_up\":$1" && break
    sleep 0.1
  done
  HEALTH=$(curl -s -m 10 "http://127.0.0.1:$P_HTTP/health")
  echo "$HEALTH" | grep -q "\"status\":\"ok\".*\"store_servers\":1,\"store_servers_up\":$1" ||
    fail "/health does not count $1 store server(s) up (or the cluster is not ok): $HEALTH"
}
# hit_again WHEN: prompt 2, written before the fault, is a hit again (the ranks learn of the new
# server asynchronously, so a few tries), with the text it had; sets k to the try.
hit_again() {
  for k in $(seq 20); do
    ask 2 "after$k"
    [ "$(cached "$WORK/after$k.json")" -ge 32 ] && break
    sleep 0.2
  done
  [ "$(cached "$WORK/after$k.json")" -ge 32 ] || fail "prompt 2 is no hit $1: $(cat "$WORK/after$k.json")"
  [ "$(text "$WORK/after$k.json")" = "$(text "$WORK/calm2.json")" ] || fail "prompt 2's text changed $1"
}
ADOPTED="store node 0 (block server 0) adopted again"

for i in 1 2 3; do ask "$i" "calm$i"; done
wait_blocks 9
ask 1 before
[ "$(cached "$WORK/before.json")" -ge 32 ] || fail "prompt 1 was no hit before the kill: $(cat "$WORK/before.json")"

PID_S=$(pgrep -f -- "--name store-a --listen 127.0.0.1:$P_STORE" | head -1)
[ -n "$PID_S" ] || fail "no store-a process"
if [ "$MODE" = stall ]; then
  kill -STOP "$PID_S"
  wait_log "store node 0 (block server 0) answered no probe within" "the head did not give up the stopped store-a"
  wait_health 0
  # Served while store-a hangs, from computation: the same text.
  ask 3 stalled
  [ "$(text "$WORK/stalled.json")" = "$(text "$WORK/calm3.json")" ] || fail "prompt 3's text changed while store-a hung"
  echo "store restart e2e: the stopped store-a was given up; /health counts it down and prompts are answered"
  kill -CONT "$PID_S"
  wait_log "$ADOPTED" "the head did not adopt store-a again"
  wait_health 1
  hit_again "after store-a resumed"
  grep -q "node store-a restarted" "$WORK/launch.log" && fail "the launcher restarted store-a, which only hung"
  echo "store restart e2e: store-a resumed, adopted again, and a prompt written before the stall is a hit again (try $k)"
  echo "store restart e2e (stall): all checks passed"
  exit 0
fi

kill -9 "$PID_S"
T_KILL=$(date +%s.%N)
wait_log "node store-a restarted" "the launcher did not restart store-a"
wait_log "$ADOPTED" "the head did not adopt store-a again"
wait_health 1
echo "store restart e2e: store-a adopted again and counted up $(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$T_KILL" "$(date +%s.%N)") s after the kill"
FOUND=$(grep -o "store-a: found [0-9]* blocks" "$WORK/launch.log" | grep -o "[0-9]*" | tail -1)
[ "${FOUND:-0}" -ge 9 ] || fail "the restarted store-a did not find the prompts' 9 blocks on its disk (found ${FOUND:-none})"

# Written before the kill, found on disk by the new process: a hit again, with the same text.
hit_again "after the restart"
echo "store restart e2e: a prompt written before the kill is a hit again (try $k), same text"

# First asked after the restart: the decode node writes it back to the new server, and it hits.
ask 7 fresh
wait_blocks $((FOUND + 3))
ask 7 fresh_again
[ "$(cached "$WORK/fresh_again.json")" -ge 32 ] || fail "prompt 7 is no hit: the decode node wrote nothing to store-a: $(cat "$WORK/fresh_again.json")"
echo "store restart e2e: a prompt first asked after the restart is written to store-a and hits"
echo "store restart e2e (kill): all checks passed"
