#!/usr/bin/env bash
# A node whose expert shards cannot be started again leaves, to be restarted or replaced
# (issue 14): a head and one decode node with `--expert-parallel 2 --expert-restarts 2` on
# deepseek-v3-tiny. Once it has answered, fault injection makes new shards refuse to start
# (BATON_FAULT_EXPERTS_REFUSE_IF names a file the test creates) and its shard is killed. The
# node must step aside, try twice (1 s apart), give up naming why, drain and exit with code 3;
# its shard must not outlive it.
# Usage: expert_keeper_gives_up_e2e.sh BATON_BINARY. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-keeper-gives-up-e2e-XXXXXX)
export UCX_NET_DEVICES=lo
HEAD_PID="" NODE=""
cleanup() {
  for p in $NODE $HEAD_PID; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 0.5
  pkill -9 -f "$WORK" 2>/dev/null || true
  for p in $NODE $HEAD_PID; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() {
  echo "keeper gives up e2e: FAILED: $*" >&2
  for f in "$WORK"/*.log; do echo "--- $f" >&2; tail -25 "$f" >&2; done
  exit 1
}

"$BATON" local --serve --model deepseek-v3-tiny --prefill-ranks 1 --decode-ranks 0 --router-listen 127.0.0.1:0 \
  --cluster-listen 127.0.0.1:0 > "$WORK/head.log" 2>&1 &
HEAD_PID=$!
for _ in $(seq 300); do grep -q "cluster listening" "$WORK/head.log" && break; kill -0 "$HEAD_PID" 2>/dev/null || break; sleep 0.1; done
P_HEAD=$(grep -o "cluster listening on 127.0.0.1:[0-9]*" "$WORK/head.log" | grep -o "[0-9]*$") || fail "the head did not start"
P_ROUTER=$(grep -o "router listening on 127.0.0.1:[0-9]*" "$WORK/head.log" | grep -o "[0-9]*$") || fail "the head has no router"

BATON_FAULT_EXPERTS_REFUSE_IF="$WORK/refuse" "$BATON" node --role decode --name keep-a --connect "127.0.0.1:$P_HEAD" \
  --model deepseek-v3-tiny --expert-parallel 2 --expert-restarts 2 > "$WORK/node.log" 2>&1 &
NODE=$!
for _ in $(seq 600); do grep -q "joined the head" "$WORK/node.log" && break; kill -0 "$NODE" 2>/dev/null || break; sleep 0.1; done
grep -q "baton node keep-a: joined the head; 1 decode rank(s) serving" "$WORK/node.log" || fail "the node did not join"
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --prompt "Experts, once" --max-tokens 8 > "$WORK/answer.txt" ||
  fail "the node did not answer"
[ -s "$WORK/answer.txt" ] || fail "the answer is empty"

SHARD=$(pgrep -P "$NODE" -f -- "experts .*--name keep-a" || true)
[ -n "$SHARD" ] || fail "no shard process among $(pgrep -a -P "$NODE" || true)"
touch "$WORK/refuse"
kill -9 "$SHARD"
# Idle, the rank notices within 0.1 s; two failed starts 1 s apart, then the node drains and leaves.
RC=""
for _ in $(seq 300); do kill -0 "$NODE" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$NODE" 2>/dev/null; then fail "the node was still running 30 s after its shard was killed"; fi
wait "$NODE" && RC=0 || RC=$?
NODE=""
L="$WORK/node.log"
grep -q "rank keep-a stepped aside (expert parallelism: expert shard 1 of 2: its process (keep-a-ep1, pid $SHARD) ended with signal 9)" "$L" ||
  fail "the rank did not step aside naming its shard"
[ "$(grep -c "refusing to start: fault injected for a test" "$L")" = 2 ] || fail "new shards were not tried exactly twice"
grep -q "starting new expert shards did not work (expert shard keep-a-ep1 did not start (see its stderr)); trying again in 1000 ms" "$L" ||
  fail "the first failed start was not reported with its pause"
grep -q "starting new expert shards did not work 2 times in a row (last: expert shard keep-a-ep1 did not start (see its stderr)); giving up on it" "$L" ||
  fail "the keeper did not say that it gives up"
grep -q "baton node keep-a: rank keep-a's expert shards cannot be started again; leaving so that the node is restarted or replaced" "$L" ||
  fail "the node did not say why it leaves"
grep -q "baton node keep-a: left to be restarted (exit code 3)" "$L" || fail "the node did not say that it left"
[ "$RC" = 3 ] || fail "the node exited with $RC, not 3"
! pgrep -f -- "experts .*--name keep-a" > /dev/null || fail "a shard outlived its node: $(pgrep -a -f -- "experts .*--name keep-a")"
echo "keeper gives up e2e: its shard killed and new ones refused, node keep-a tried twice, gave up and left with exit code 3"
echo "keeper gives up e2e: all checks passed"
