#!/usr/bin/env bash
# A node that fails again as soon as it is restarted: `baton launch --restart-failed` waits before
# each restart, twice as long after each quick failure (--restart-backoff-ms), instead of spending
# its restarts at once; the cluster answers through it afterwards.
# Usage: restart_backoff_e2e.sh BATON_BINARY SOURCE_DIR. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
SRC=$2
WORK=$(mktemp -d /tmp/baton-restart-backoff-e2e-XXXXXX)
LAUNCHER=""
source "$(dirname "$0")/e2e_lib.sh"
trap stop_launcher EXIT
fail() { echo "restart backoff e2e: FAILED: $*" >&2; echo "--- launcher:" >&2; cat "$WORK/launch.log" >&2; exit 1; }

read -r P_ROUTER P_CLUSTER < <(free_ports 2)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "backoff",
  "model": "$SRC/models/baton-kjv-tiny",
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "prefill_ranks": 1,
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]}
  ]
}
SPEC
launch_cluster --restart-failed 3 --restart-backoff-ms 400
# This cluster's decode-a only (other scripts, run in parallel by ctest, have their own decode-a).
decode_pid() { pgrep -f "baton node --role decode --name decode-a --connect 127.0.0.1:$P_CLUSTER " | head -1 || true; }
# kill_decode N: kills decode-a's current process and waits (bounded) for restart N's new one.
kill_decode() {
  local old
  old=$(decode_pid)
  [ -n "$old" ] || fail "no decode-a process to kill (round $1)"
  kill -9 "$old"
  for _ in $(seq 300); do
    grep -q "node decode-a restarted ($1 of 3" "$WORK/launch.log" && [ -n "$(decode_pid)" ] && [ "$(decode_pid)" != "$old" ] && break
    sleep 0.1
  done
  grep -q "node decode-a restarted ($1 of 3" "$WORK/launch.log" || fail "decode-a was not restarted a time $1"
}
kill_decode 1
kill_decode 2  # within a minute of its restart: a crash loop, so the wait doubles
kill_decode 3
grep -q "baton launch: node decode-a left (signal 9); restarting it in 0.4 s (1 of 3)" "$WORK/launch.log" ||
  fail "the first restart did not wait the base backoff"
grep -q "baton launch: node decode-a left (signal 9); restarting it in 0.8 s (2 of 3)" "$WORK/launch.log" ||
  fail "the second quick failure did not double the wait"
grep -q "baton launch: node decode-a left (signal 9); restarting it in 1.6 s (3 of 3)" "$WORK/launch.log" ||
  fail "the third quick failure did not double the wait again"
grep -q "node decode-a restarted (3 of 3, pid [0-9]*, after 1.6 s)" "$WORK/launch.log" || fail "the restart does not say its wait"
echo "restart backoff e2e: three quick failures of decode-a, restarted after 0.4, 0.8 and 1.6 s"
# The last restart joins and serves.
for _ in $(seq 600); do [ "$(grep -c "node decode-a joined" "$WORK/launch.log")" -ge 2 ] && break; sleep 0.1; done
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id backoff --prompt "In the beginning" --max-tokens 8 \
  > "$WORK/answer.txt" || fail "the cluster did not answer after the restarts"
[ -s "$WORK/answer.txt" ] || fail "an empty answer after the restarts"
echo "restart backoff e2e: all checks passed"
