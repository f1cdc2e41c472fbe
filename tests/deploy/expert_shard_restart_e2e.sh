#!/usr/bin/env bash
# A lost expert shard is started afresh (issue 14): `baton local --serve --expert-parallel 2` on
# deepseek-v3-tiny, one prefill and one decode rank, each with one `baton experts` shard process.
# The answer to a prompt is taken undisturbed. Then, for each rank in turn, its shard is killed
# with SIGKILL and the same prompt sent at once: the rank must notice (idle, or in that request's
# job), step aside, get a new shard process, and both that request and one after must get the
# same text.
# /metrics must show both ranks available again at the end, and no shard may outlive the run.
# Usage: expert_shard_restart_e2e.sh BATON_BINARY. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-shard-restart-e2e-XXXXXX)
export UCX_NET_DEVICES=lo
PID=""
cleanup() {
  if [ -n "$PID" ]; then
    kill -TERM "$PID" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "expert shard restart e2e: FAILED: $*" >&2; echo "--- baton local:" >&2; cat "$WORK/local.log" >&2; exit 1; }

"$BATON" local --serve --model deepseek-v3-tiny --expert-parallel 2 --prefill-ranks 1 --decode-ranks 1 \
  --http-listen 127.0.0.1:0 > "$WORK/local.log" 2>&1 &
PID=$!
for _ in $(seq 600); do grep -q "gateway listening" "$WORK/local.log" && break; kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
PORT=$(grep -o "gateway listening on http://127.0.0.1:[0-9]*" "$WORK/local.log" | grep -o "[0-9]*$") || fail "it did not start"
URL="http://127.0.0.1:$PORT"
ask() { curl -s -m 60 "$URL/v1/completions" -d '{"prompt":"Experts, route this once more","max_tokens":12}'; }
text() { python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])'; }

ask > "$WORK/calm.json" || fail "the undisturbed request"
CALM=$(text < "$WORK/calm.json") || fail "the undisturbed answer: $(cat "$WORK/calm.json")"
[ -n "$CALM" ] || fail "the undisturbed answer is empty"

for rank in prefill-0 decode-0; do
  SHARD=$(pgrep -P "$PID" -f -- "--name $rank --dual-batch" || true)
  [ -n "$SHARD" ] || fail "no shard process of $rank among $(pgrep -a -P "$PID" || true)"
  kill -9 "$SHARD"
  # A request sent at once, during the outage: its attempt fails over or waits at the balancer
  # (the only rank of its kind has stepped aside), and it is answered once the rank is back.
  ask > "$WORK/$rank-during.json" &
  DURING=$!
  # The rank notices its shard's end (idle, or in that request's job), steps aside and gets a new one.
  for _ in $(seq 300); do grep -q "rank $rank has new expert shards" "$WORK/local.log" && break; sleep 0.1; done
  grep -q "rank $rank stepped aside (expert parallelism: expert shard 1 of 2: its process ($rank-ep1, pid $SHARD) ended with signal 9): starting new expert shards" \
    "$WORK/local.log" || fail "$rank did not say that it stepped aside for its shard (pid $SHARD)"
  grep -q "rank $rank has new expert shards" "$WORK/local.log" || fail "$rank got no new shard within 30 s"
  NEW=$(pgrep -P "$PID" -f -- "--name $rank --dual-batch" || true)
  [ -n "$NEW" ] && [ "$NEW" != "$SHARD" ] || fail "$rank has no new shard process (old $SHARD, now '$NEW')"
  wait "$DURING" || fail "the request sent during $rank's outage"
  GOT=$(text < "$WORK/$rank-during.json") || fail "the answer during $rank's outage: $(cat "$WORK/$rank-during.json")"
  [ "$GOT" = "$CALM" ] || fail "during $rank's outage: '$GOT', undisturbed: '$CALM'"
  ask > "$WORK/$rank.json" || fail "the request after $rank's shard was killed"
  GOT=$(text < "$WORK/$rank.json") || fail "the answer after $rank's shard was killed: $(cat "$WORK/$rank.json")"
  [ "$GOT" = "$CALM" ] || fail "after $rank's new shard: '$GOT', undisturbed: '$CALM'"
  echo "expert shard restart e2e: $rank's shard (pid $SHARD) killed; a new one (pid $NEW) serves the same text"
done
METRICS=$(curl -s -m 10 "$URL/metrics")
for role in prefill decode; do
  grep -q "^baton_rank_available{role=\"$role\",rank=\"$role-0\"} 1$" <<< "$METRICS" || fail "$role-0 is not available again"
done
SHARDS=$(pgrep -P "$PID" -f -- "experts" | tr '\n' ' ')
kill -TERM "$PID"
for _ in $(seq 300); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
! kill -0 "$PID" 2>/dev/null || fail "baton local did not stop within 30 s"
PID=""
# Normally reaped as their group ends; one ended by PDEATHSIG instead may take a moment (bounded).
for s in $SHARDS; do
  for _ in $(seq 50); do kill -0 "$s" 2>/dev/null || break; sleep 0.1; done
  ! kill -0 "$s" 2>/dev/null || fail "shard $s outlived its engine by 5 s"
done
echo "expert shard restart e2e: all checks passed"
