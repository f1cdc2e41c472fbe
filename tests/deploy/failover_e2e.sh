#!/usr/bin/env bash
# kill -9 of a decode node while it streams to 20 clients, half of them sampling (issue 10): a cluster from a spec on
# 127.0.0.1 (head; decode nodes a and b; gateway), the 20 answers taken undisturbed first, then
# the same 20 requests streamed at once while decode-a is killed with SIGKILL mid-stream. Every
# client must get exactly the undisturbed text, with no error, no repeated and no missing token;
# the launcher reports the node gone and the cluster serves on.
# Usage: failover_e2e.sh BATON_BINARY SOURCE_DIR. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
SRC=$2
WORK=$(mktemp -d /tmp/baton-failover-e2e-XXXXXX)
LAUNCHER=""
source "$(dirname "$0")/e2e_lib.sh"
trap stop_launcher EXIT
fail() { echo "failover e2e: FAILED: $*" >&2; echo "--- launcher:" >&2; cat "$WORK/launch.log" >&2; exit 1; }

read -r P_ROUTER P_CLUSTER P_HTTP < <(free_ports 3)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "failover",
  "model": "$SRC/models/baton-kjv-tiny",
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "prefill_ranks": 2,
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"], "env": {"BATON_FAULT_JOB_DELAY_MS": "10"}},
    {"name": "decode-b", "host": "127.0.0.1", "roles": ["decode"]},
    {"name": "gw", "host": "127.0.0.1", "roles": ["gateway"], "ports": {"http": $P_HTTP}}
  ]
}
SPEC
launch_cluster
# The gateway joins the head before it binds its HTTP port; and both decode nodes must serve.
for _ in $(seq 300); do grep -q "baton gateway: listening on http://127.0.0.1:$P_HTTP" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "baton gateway: listening on http://127.0.0.1:$P_HTTP" "$WORK/launch.log" || fail "the gateway did not listen"
for n in decode-a decode-b; do
  for _ in $(seq 300); do grep -q "baton node $n: joined the head" "$WORK/launch.log" && break; sleep 0.1; done
  grep -q "baton node $n: joined the head" "$WORK/launch.log" || fail "$n's ranks did not start"
done
URL="http://127.0.0.1:$P_HTTP/v1/completions"
# decode-a decodes slowly (each step starts 10 ms late: 120 tokens take over 1.2 s), so its
# streams are still going when the first of decode-b's ends and the kill comes.
N=20 TOKENS=120
# Odd clients sample (temperature 0.9, top-p 0.95, their own seed): a draw depends only on the
# seed and the token's position, so a request moved mid-stream must sample the same tokens.
body() {
  local sampling=""
  [ $(($1 % 2)) = 1 ] && sampling=",\"temperature\":0.9,\"top_p\":0.95,\"seed\":$((1000 + $1))"
  echo "{\"prompt\":\"Verse $1 of the chapter\",\"max_tokens\":$TOKENS,\"ignore_eos\":true,\"stream\":true$sampling}"
}

# Undisturbed answers, one at a time.
for i in $(seq $N); do curl -sN -m 120 "$URL" -d "$(body "$i")" > "$WORK/calm$i.txt" || fail "undisturbed request $i: curl exit $? (7: nothing listened), it got: $(head -c 300 "$WORK/calm$i.txt")"; done

# The same requests at once; SIGKILL decode-a once every stream has begun.
for i in $(seq $N); do curl -sN -m 120 "$URL" -d "$(body "$i")" > "$WORK/hit$i.txt" & done
PID_A=$(grep -o "node decode-a joined (decode, pid [0-9]*" "$WORK/launch.log" | grep -o "[0-9]*$")
# One grep per look, and the kill comes at the latest when a first stream has finished: under
# load, 20 greps per look outlasted the streams and the kill hit none of them.
for _ in $(seq 200); do
  started=$({ grep -l "data: " "$WORK"/hit*.txt 2>/dev/null || true; } | wc -l)
  finished=$({ grep -l "\[DONE\]" "$WORK"/hit*.txt 2>/dev/null || true; } | wc -l)
  [ "$started" = $N ] || [ "$finished" -ge 1 ] && break
  sleep 0.05
done
kill -9 "$PID_A"
wait $(jobs -p | grep -v "^$LAUNCHER$") 2>/dev/null || true

python3 "$(dirname "$0")/same_answers.py" "$WORK" "$N" calm hit length ||
  fail "a client saw something other than the undisturbed answer"
echo "failover e2e: $N clients streamed $TOKENS tokens each through a SIGKILL of decode-a: every text equals the undisturbed one"
for _ in $(seq 100); do grep -q "node decode-a left (signal 9)" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "node decode-a left (signal 9)" "$WORK/launch.log" || fail "the launcher did not report decode-a gone"
curl -sf "$URL" -d '{"prompt":"And after","max_tokens":4}' > /dev/null || fail "the cluster does not serve after the kill"
FAILOVERS=$(curl -sf "http://127.0.0.1:$P_HTTP/metrics" | grep "^baton_failovers_total" | awk '{print $2}')
[ "${FAILOVERS:-0}" -ge 1 ] || fail "no request was re-placed: the kill hit no stream (failovers: ${FAILOVERS:-none})"
echo "failover e2e: $FAILOVERS request(s) moved to decode-b mid-stream"
echo "failover e2e: all checks passed"
