#!/usr/bin/env bash
# A node cut off by its network link (issue 10): two stand-in hosts in network namespaces this
# test creates, joined by a veth pair. Host A runs the head (router, prefill ranks, gateway) and
# decode node "near"; host B runs decode node "far". While 8 clients stream, B's link goes down:
# the head's node directory declares "far" gone when its heartbeats stop (2 s), the balancer
# forgets its ranks and every request on them is re-placed onto "near" -- the token deadline is
# set to 10 minutes, so only the heartbeat path can do it within this test's bounded wait. Every
# client gets exactly the undisturbed text. Host B also runs the cluster's store node "vault",
# which the head gives up after a probe goes unanswered for 3 s while the link is down (its TCP links
# linger: no down message comes). Then the link comes back: "far" heartbeats again, rejoins, and
# serves, and the head adopts "vault" again. Skips where namespaces cannot be made; always
# removes what it made.
# Usage: partition_e2e.sh BATON_BINARY SOURCE_DIR
set -uo pipefail
BATON=$1 SRC=$2
skip() { echo "partition e2e: SKIPPED: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "creating network namespaces needs root"
for c in ip curl python3; do command -v "$c" > /dev/null || skip "no $c"; done
ID=$(( ($$ + 97) % 200 + 20 ))
NS1="baton-pa-$$" NS2="baton-pb-$$" V1="bpa$$" V2="bpb$$"
A="10.78.$ID.1" B="10.78.$ID.2"
WORK=$(mktemp -d /tmp/baton-partition-XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null; done
  for _ in $(seq 100); do
    alive=0; for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.1
  done
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
  for ns in "$NS1" "$NS2"; do ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null; done
  wait 2>/dev/null
  ip netns del "$NS1" 2>/dev/null; ip netns del "$NS2" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "partition e2e: FAILED: $*" >&2; for f in "$WORK"/*.log; do echo "--- $f" >&2; tail -8 "$f" >&2; done; exit 1; }
ip netns add "$NS1" 2> /dev/null || skip "cannot create network namespaces here"
ip netns add "$NS2" && ip link add "$V1" type veth peer name "$V2" && ip link set "$V1" netns "$NS1" &&
  ip link set "$V2" netns "$NS2" && ip -n "$NS1" addr add "$A/24" dev "$V1" && ip -n "$NS2" addr add "$B/24" dev "$V2" &&
  ip -n "$NS1" link set lo up && ip -n "$NS2" link set lo up && ip -n "$NS1" link set "$V1" up &&
  ip -n "$NS2" link set "$V2" up || fail "network setup"
MODEL="$SRC/models/baton-kjv-tiny"
# Only run in the background: exec makes the job's pid baton's own, so cleanup can stop it.
in_a() { exec ip netns exec "$NS1" env UCX_TLS=tcp UCX_NET_DEVICES="$V1" "$@"; }
in_b() { exec ip netns exec "$NS2" env UCX_TLS=tcp UCX_NET_DEVICES="$V2" "$@"; }
in_b "$BATON" node --role store --name vault --listen "$B:7200" --store-dir "$WORK/store" --cluster-id cut \
  > "$WORK/vault.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 300); do grep -q "waiting for the head" "$WORK/vault.log" && break; sleep 0.1; done
in_a "$BATON" local --serve --model "$MODEL" --decode-ranks 0 --router-listen "$A:7100" --cluster-listen "$A:7101" \
  --http-listen "$A:8000" --token-timeout-ms 600000 --cluster-id cut --store-node "$B:7200" --block-tokens 16 \
  > "$WORK/head.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 600); do grep -q "serving" "$WORK/head.log" && break; sleep 0.1; done
grep -q "serving" "$WORK/head.log" || fail "the head did not start"
in_a "$BATON" node --role decode --name near --connect "$A:7101" --model "$MODEL" --cluster-id cut > "$WORK/near.log" 2>&1 &
PIDS+=($!)
# far decodes slowly (each step starts 10 ms late: 240 tokens take over 2.4 s), so its streams are
# still going when the first of near's ends and the link is cut; on an idle machine both once
# finished before the cut, and nothing was left to move.
in_b "$BATON" node --role decode --name far --connect "$A:7101" --model "$MODEL" --cluster-id cut \
  --fault-job-delay-ms 10 > "$WORK/far.log" 2>&1 &
PIDS+=($!)
URL="http://$A:8000"
ranks() { ip netns exec "$NS1" curl -s "$URL/metrics" | grep "^baton_rank_kv_pages{role=\"decode\"" | grep -o 'rank="[a-z]*"' | sort | tr '\n' ' '; }
for _ in $(seq 300); do [ "$(ranks)" = 'rank="far" rank="near" ' ] && break; sleep 0.1; done
[ "$(ranks)" = 'rank="far" rank="near" ' ] || fail "both decode nodes should serve, the balancer has: $(ranks)"

N=8 TOKENS=240  # long enough that far still streams when the last client has begun, even under load (the model holds 256 positions)
body() { echo "{\"prompt\":\"Psalm $1\",\"max_tokens\":$TOKENS,\"ignore_eos\":true,\"stream\":true}"; }
for i in $(seq $N); do ip netns exec "$NS1" curl -sN -m 120 "$URL/v1/completions" -d "$(body "$i")" > "$WORK/calm$i.txt"; done
CLIENTS=()
for i in $(seq $N); do
  ip netns exec "$NS1" curl -sN -m 120 "$URL/v1/completions" -d "$(body "$i")" > "$WORK/cut$i.txt" &
  CLIENTS+=($!)
done
for _ in $(seq 200); do  # one grep per look; cut at the latest when a first stream has finished
  n=$({ grep -l "data: " "$WORK"/cut*.txt 2>/dev/null || true; } | wc -l)
  finished=$({ grep -l "\[DONE\]" "$WORK"/cut*.txt 2>/dev/null || true; } | wc -l)
  [ "$n" = $N ] || [ "$finished" -ge 1 ] && break; sleep 0.05
done
ip -n "$NS2" link set "$V2" down  # host B is cut off; its processes live on
wait "${CLIENTS[@]}"
python3 "$(dirname "$0")/same_answers.py" "$WORK" "$N" calm cut || fail "a client did not get the undisturbed text"
moved=$(ip netns exec "$NS1" curl -s "$URL/metrics" | grep "^baton_failovers_total" | awk '{print $2}')
[ "${moved:-0}" -ge 1 ] || fail "no request was re-placed (failovers: ${moved:-none})"
[ "$(ranks)" = 'rank="near" ' ] || fail "the balancer should have forgotten far, it has: $(ranks)"
echo "partition e2e: far cut off: declared gone by missed heartbeats, $moved request(s) re-placed onto near, $N clients got the undisturbed text"
GIVEN_UP="store node 0 (block server 0) answered no probe within"
for _ in $(seq 200); do grep -q "$GIVEN_UP" "$WORK/head.log" && break; sleep 0.1; done
grep -q "$GIVEN_UP" "$WORK/head.log" || fail "the head did not give up the cut-off store node"
health() { ip netns exec "$NS1" curl -s -m 10 "$URL/health"; }
health | grep -q '"store_servers":1,"store_servers_up":0' || fail "/health counts the cut-off store node up: $(health)"
echo "partition e2e: vault cut off: given up after a probe went unanswered for 3 s; /health counts it down"

ip -n "$NS2" link set "$V2" up
ip netns exec "$NS1" curl -s "$URL/v1/completions" -d '{"prompt":"After","max_tokens":4}' > /dev/null
for _ in $(seq 300); do [ "$(ranks)" = 'rank="far" rank="near" ' ] && break; sleep 0.1; done
[ "$(ranks)" = 'rank="far" rank="near" ' ] || fail "far did not rejoin after the link came back: $(ranks)"
kill -0 "${PIDS[3]}" 2>/dev/null || fail "far's process ended"
echo "partition e2e: the link came back: far heartbeats again and rejoined the balancer"
for _ in $(seq 600); do grep -q "store node 0 (block server 0) adopted again" "$WORK/head.log" && break; sleep 0.1; done
grep -q "store node 0 (block server 0) adopted again" "$WORK/head.log" || fail "the head did not adopt vault again"
for _ in $(seq 100); do health | grep -q '"store_servers":1,"store_servers_up":1' && break; sleep 0.1; done
health | grep -q '"store_servers":1,"store_servers_up":1' || fail "/health does not count vault up again: $(health)"
kill -0 "${PIDS[0]}" 2>/dev/null || fail "vault's process ended"
echo "partition e2e: the link came back: vault adopted again and counted up"
echo "partition e2e: all checks passed"
