#!/usr/bin/env bash
# kill -9 of a prefill node mid-prefill (issue 10): a cluster from a spec on 127.0.0.1 whose
# prefill ranks run in their own processes (prefill-a, prefill-b; the head only routes), prompts
# placed round-robin. prefill-a is made slow by fault injection (BATON_FAULT_JOB_DELAY_MS: each
# executor job starts 150 ms late, as on a throttled GPU) so that prompts are still queued and
# computing on it when it is killed. The 20 answers are taken undisturbed first, then the same
# 20 requests streamed at once and prefill-a killed with SIGKILL once the first streams began
# and before all did. Every client must get exactly the undisturbed text; the launcher reports
# the node gone, requests were re-placed, and the cluster serves on.
# Usage: prefill_kill_e2e.sh BATON_BINARY SOURCE_DIR. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
SRC=$(cd "$2" && pwd)
WORK=$(mktemp -d /tmp/baton-prefill-kill-e2e-XXXXXX)
LAUNCHER=""
source "$(dirname "$0")/e2e_lib.sh"
trap stop_launcher EXIT
fail() { echo "prefill kill e2e: FAILED: $*" >&2; echo "--- launcher:" >&2; cat "$WORK/launch.log" >&2; exit 1; }

read -r P_ROUTER P_CLUSTER P_HTTP < <(free_ports 3)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "prefillkill",
  "model": "$SRC/models/baton-kjv-tiny",
  "policies": {"prefill": "round_robin", "decode": "seed"},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "gateway"],
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER, "http": $P_HTTP}},
    {"name": "prefill-a", "host": "127.0.0.1", "roles": ["prefill"], "env": {"BATON_FAULT_JOB_DELAY_MS": "150"}},
    {"name": "prefill-b", "host": "127.0.0.1", "roles": ["prefill"]},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]}
  ]
}
SPEC
launch_cluster
URL="http://127.0.0.1:$P_HTTP/v1/completions"
N=20 TOKENS=24
body() { echo "{\"prompt\":\"Verse $1 of the chapter\",\"max_tokens\":$TOKENS,\"ignore_eos\":true,\"stream\":true}"; }

for i in $(seq $N); do curl -sN -m 60 "$URL" -d "$(body "$i")" > "$WORK/calm$i.txt" || fail "undisturbed request $i: curl exit $? (7: nothing listened), it got: $(head -c 300 "$WORK/calm$i.txt")"; done

PID_A=$(grep -o "node prefill-a joined (prefill, pid [0-9]*" "$WORK/launch.log" | grep -o "[0-9]*$")
CLIENTS=()
for i in $(seq $N); do
  curl -sN -m 120 "$URL" -d "$(body "$i")" > "$WORK/hit$i.txt" &
  CLIENTS+=($!)
done
# prefill-b answers its half at once; prefill-a needs >= 150 ms per prompt for its half. One grep
# per look (not one per client), so that a look stays short on a loaded machine.
started() { { grep -l "data: " "$WORK"/hit*.txt 2>/dev/null || true; } | wc -l; }  # none yet: grep fails, 0
started=0
for _ in $(seq 400); do
  started=$(started)
  [ "$started" -ge 1 ] && break
  sleep 0.01
done
kill -9 "$PID_A"
[ $started -ge 1 ] && [ $started -lt $N ] || fail "the kill did not land mid-prefill ($started of $N streams had begun)"
echo "prefill kill e2e: prefill-a killed with $((N - started)) of $N prompts not yet answered"
wait "${CLIENTS[@]}" || true

python3 "$(dirname "$0")/same_answers.py" "$WORK" "$N" calm hit length ||
  fail "a client saw something other than the undisturbed answer"
for _ in $(seq 100); do grep -q "node prefill-a left (signal 9)" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "node prefill-a left (signal 9)" "$WORK/launch.log" || fail "the launcher did not report prefill-a gone"
MOVED=$(curl -sf "http://127.0.0.1:$P_HTTP/metrics" | grep "^baton_failovers_total" | awk '{print $2}')
[ "${MOVED:-0}" -ge 1 ] || fail "no request was re-placed: the kill hit no prompt (failovers: ${MOVED:-none})"
curl -sf -m 30 "$URL" -d '{"prompt":"And after","max_tokens":4}' > /dev/null || fail "the cluster does not serve after the kill"
echo "prefill kill e2e: $N clients got the undisturbed text; $MOVED prompt(s) re-placed from prefill-a onto prefill-b"
echo "prefill kill e2e: all checks passed"
