#!/usr/bin/env bash
# A cluster spec with expert parallelism, launched by `baton launch` on 127.0.0.1: the head's
# prefill rank with EP 2 and a decode node with EP 4 and dual-batch overlap, KV sent as
# rendezvous active messages (transport.send "am"). Its answers must equal a single process's
# at EP 1, the engines must have started their expert processes, and none may outlive the stop.
# Usage: launch_expert_parallel_e2e.sh BATON_BINARY. Bounded waits throughout; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-launch-ep-e2e-XXXXXX)
LAUNCHER="" SINGLE=""
source "$(dirname "$0")/e2e_lib.sh"
trap cleanup_launched EXIT
fail() { echo "launch EP e2e: FAILED: $*" >&2; echo "--- launcher output:" >&2; cat "$WORK/launch.log" >&2 || true; exit 1; }
experts() { pgrep -f "$BATON experts" | wc -l; }
# Shards of an earlier test may still be on their way out (they follow their engine's death).
for _ in $(seq 100); do [ "$(experts)" = 0 ] && break; sleep 0.1; done
[ "$(experts)" = 0 ] || fail "expert processes of another run are still alive: $(pgrep -af "$BATON experts")"

read -r P_ROUTER P_CLUSTER < <(free_ports 2)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "ep-e2e",
  "model": "deepseek-v3-tiny",
  "transport": {"send": "am"},
  "expert_parallel": {"prefill": 2, "decode": 4, "dual_batch_overlap": true},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "prefill_ranks": 1,
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]}
  ]
}
SPEC
launch_cluster
grep -q "node decode-a joined" "$WORK/launch.log" || fail "decode-a did not join"
# One expert process for the prefill rank (EP 2), three for the decode rank (EP 4).
[ "$(experts)" = 4 ] || fail "expected 4 expert processes, found $(experts): $(pgrep -af "$BATON experts")"

same_as_single deepseek-v3-tiny ep-e2e 12 "Experts, route this" "A second prompt, longer, so that more tokens pass the experts"
echo "launch EP e2e: prefill EP 2 and decode EP 4 with dual-batch overlap, KV as active messages: the same text as EP 1"
stop_launched
for _ in $(seq 50); do [ "$(experts)" = 0 ] && break; sleep 0.1; done
[ "$(experts)" = 0 ] || fail "$(experts) expert processes outlived the cluster"

# Data-parallel attention in groups of EP 2 over four decode ranks in two node processes: two of
# decode-a's ranks form a group inside it, its third and decode-b's rank one across the two
# processes (they meet through the head). Each member runs its own requests' attention and serves
# half the experts to the other; no decode rank starts an expert process.
cat > "$WORK/spec.json" <<SPEC
{
  "name": "ep-e2e",
  "model": "deepseek-v3-tiny",
  "expert_parallel": {"prefill": 2, "decode": 2, "dp_attention": true},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "prefill_ranks": 1,
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"], "gpus": 3},
    {"name": "decode-b", "host": "127.0.0.1", "roles": ["decode"]}
  ]
}
SPEC
launch_cluster
for n in decode-a decode-b; do grep -q "node $n joined" "$WORK/launch.log" || fail "$n did not join (data-parallel attention)"; done
grep -q "rank decode-a-2 is member 0 of data-parallel group dp1, serving 4 of 8" "$WORK/launch.log" || fail "decode-a-2 is not in group dp1"
grep -q "rank decode-b is member 1 of data-parallel group dp1, serving 4 of 8" "$WORK/launch.log" || fail "decode-b is not in group dp1"
[ "$(experts)" = 1 ] || fail "expected only the prefill rank's expert process, found $(experts)"
same_as_single deepseek-v3-tiny ep-e2e 12 "Experts, route this" "A second prompt, longer, so that more tokens pass the experts" \
  "A third one for the other decode rank" "And a fourth, so both members have rows of their own"
echo "launch EP e2e: decode ranks in data-parallel groups of 2 (dp_attention), one inside a node and one across two: the same text as EP 1"
stop_launched
for _ in $(seq 50); do [ "$(experts)" = 0 ] && break; sleep 0.1; done
[ "$(experts)" = 0 ] || fail "$(experts) expert processes outlived the cluster"
echo "launch EP e2e: all checks passed"
