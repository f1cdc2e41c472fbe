#!/usr/bin/env bash
# `baton status` against a serving head: the node that joined is listed as joined with its rank,
# the ranks with their KV; killed (SIGKILL), the node is listed as gone while its rank leaves the
# ranks; --json says the same; a gateway node stopped by SIGTERM is left, not lost; an address
# where nothing listens is named, exit code 1.
# Usage: status_e2e.sh BATON_BINARY. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
NAME=status-e2e
source "$(dirname "$0")/local_serve_lib.sh"
NODE=""
GW=""
trap 'kill -9 $NODE $GW 2>/dev/null || true; cleanup' EXIT
start_local_serve --decode-ranks 1 --http-listen 127.0.0.1:0 --router-listen 127.0.0.1:0 --cluster-listen 127.0.0.1:0
ROUTER=$(grep -o "router listening on 127.0.0.1:[0-9]*" "$WORK/local.log" | grep -o "[0-9]*$" || true)
CLUSTER=$(grep -o "cluster listening on 127.0.0.1:[0-9]*" "$WORK/local.log" | grep -o "[0-9]*$" || true)
[ -n "$ROUTER" ] && [ -n "$CLUSTER" ] || fail "no router or cluster port in the log"
"$BATON" node --role decode --name dec-a --connect "127.0.0.1:$CLUSTER" > "$WORK/node.log" 2>&1 &
NODE=$!
for _ in $(seq 300); do grep -q "joined the head" "$WORK/node.log" && break; sleep 0.1; done
grep -q "joined the head" "$WORK/node.log" || fail "dec-a did not join"
status() { timeout 30 "$BATON" status --cluster "127.0.0.1:$CLUSTER" --router "127.0.0.1:$ROUTER" "$@"; }
# Its rank reports its load within a moment of joining.
for _ in $(seq 100); do status > "$WORK/status.txt" && grep -q "^  decode  *dec-a " "$WORK/status.txt" && break; sleep 0.1; done
grep -Eq "^  dec-a +decode +$NODE +joined +[0-9]+ ms +dec-a$" "$WORK/status.txt" || fail "dec-a not listed as joined: $(cat "$WORK/status.txt")"
grep -Eq "^  decode +dec-a +0 +0 +[0-9]+ of [0-9]+ +taking work$" "$WORK/status.txt" || fail "dec-a's rank not listed: $(cat "$WORK/status.txt")"
grep -Eq "^  prefill +prefill-0 " "$WORK/status.txt" || fail "the head's prefill rank not listed: $(cat "$WORK/status.txt")"
kill -9 "$NODE"
NODE=""
for _ in $(seq 100); do status > "$WORK/status.txt" && grep -Eq "^  dec-a +decode +[0-9]+ +gone " "$WORK/status.txt" && break; sleep 0.1; done
# How it went: its link's loss, or (a stalled host) its heartbeats missed first.
grep -Eq "^  dec-a +decode +[0-9]+ +gone +[0-9]+ ms +dec-a \((went down \(|missed its heartbeats)" "$WORK/status.txt" ||
  fail "dec-a not listed as gone, with how, after SIGKILL: $(cat "$WORK/status.txt")"
grep -Eq "^  decode +dec-a " "$WORK/status.txt" && fail "dec-a's rank still listed after SIGKILL: $(cat "$WORK/status.txt")"
status --json > "$WORK/status.json"
python3 - "$WORK/status.json" <<'PY' || fail "--json does not say the same: $(cat "$WORK/status.json")"
import json, sys
j = json.load(open(sys.argv[1]))
assert [(n["state"], n["left"]) for n in j["nodes"] if n["name"] == "dec-a"] == [("gone", False)], j["nodes"]
assert "dec-a" not in [r["name"] for r in j["ranks"]], j["ranks"]
assert any(r["role"] == "decode" and r["taking_work"] for r in j["ranks"]), j["ranks"]
PY
# The router alone says the same of the nodes (its head's directory), and /metrics has it lost.
timeout 30 "$BATON" status --router "127.0.0.1:$ROUTER" > "$WORK/router-only.txt"
grep -Eq "^  dec-a +decode +[0-9]+ +gone " "$WORK/router-only.txt" || fail "--router alone lists no nodes: $(cat "$WORK/router-only.txt")"
curl -sf -m 10 "http://127.0.0.1:$HTTP/metrics" > "$WORK/metrics.txt" || fail "no /metrics"
grep -q '^baton_node_state{node="dec-a",roles="decode",state="lost"} 1$' "$WORK/metrics.txt" ||
  fail "/metrics does not have dec-a lost: $(grep baton_node "$WORK/metrics.txt")"
# A gateway node stopped by SIGTERM (a rolling restart) drains and leaves: "left", never "lost"
# (it was recorded lost, an alert on every restart).
"$BATON" gateway --cluster "127.0.0.1:$CLUSTER" --name gw-a --listen 127.0.0.1:0 > "$WORK/gw.log" 2>&1 &
GW=$!
for _ in $(seq 300); do grep -q "listening on http" "$WORK/gw.log" && break; sleep 0.1; done
grep -q "listening on http" "$WORK/gw.log" || fail "gw-a did not start: $(cat "$WORK/gw.log")"
kill -TERM "$GW"
for _ in $(seq 300); do kill -0 "$GW" 2>/dev/null || break; sleep 0.1; done
kill -0 "$GW" 2>/dev/null && fail "gw-a did not stop after SIGTERM"
rc=0; wait "$GW" || rc=$?
[ "$rc" = 0 ] || fail "gw-a exited $rc after SIGTERM: $(cat "$WORK/gw.log")"
for _ in $(seq 50); do
  curl -sf -m 10 "http://127.0.0.1:$HTTP/metrics" > "$WORK/metrics.txt" && grep -q 'node="gw-a".*state="left"' "$WORK/metrics.txt" && break
  sleep 0.1
done
grep -q '^baton_node_state{node="gw-a",roles="[a-z]*",state="left"} 1$' "$WORK/metrics.txt" ||
  fail "gw-a not left after its drain: $(grep baton_node "$WORK/metrics.txt")"
# Nothing listening there: said, exit code 1 (the router's table still printed).
rc=0
timeout 30 "$BATON" status --cluster 127.0.0.1:1 --router "127.0.0.1:$ROUTER" > "$WORK/down.txt" 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "status with an unreachable directory exited $rc: $(cat "$WORK/down.txt")"
grep -q "(the node directory at 127.0.0.1:1 could not be reached: " "$WORK/down.txt" || fail "the unreachable directory was not named: $(cat "$WORK/down.txt")"
grep -Eq "^  prefill +prefill-0 " "$WORK/down.txt" || fail "the router's table is missing: $(cat "$WORK/down.txt")"
echo "status e2e: dec-a listed joined, then gone after SIGKILL with its rank out of the ranks; --json agrees; a gateway node's SIGTERM leaves it left; an unreachable directory named"
