#!/usr/bin/env bash
# SIGTERM on a serving head (`baton local --serve`, a rolling restart's stop): the streams in
# progress run to their end with [DONE]; meanwhile new calls get 503 "shutting down" with
# Retry-After, /health 503, and a C++ client (`baton generate`) is refused as shutting_down;
# the process then exits 0. A second SIGTERM stops at once. `baton gateway` drains the same way.
# Usage: drain_e2e.sh BATON_BINARY. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-drain-e2e-XXXXXX)
PID=""
cleanup() {
  [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null || true
  [ -n "${GW:-}" ] && kill -9 "$GW" 2>/dev/null || true
  for c in "${CURLS[@]}"; do kill -9 "$c" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "drain e2e: FAILED: $*" >&2; cat "$WORK/serve.log" >&2 2>/dev/null || true; exit 1; }
STREAMS=64
CURLS=()

serve() {
  # One decode rank on one math thread, with KV for all the streams at once: they run together for
  # seconds, not a fraction of one, so that the checks below run while they do, on any machine.
  "$BATON" local --serve --decode-ranks 1 --executor-threads 1 --kv-pages 2048 --http-listen 127.0.0.1:0 --router-listen 127.0.0.1:0 "$@" > "$WORK/serve.log" 2>&1 &
  PID=$!
  for _ in $(seq 600); do grep -q "serving;" "$WORK/serve.log" && break; kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
  grep -q "serving;" "$WORK/serve.log" || fail "it did not start serving"
  HTTP=$(grep -o "gateway listening on http://127.0.0.1:[0-9]*" "$WORK/serve.log" | grep -o "[0-9]*$")
  ROUTER=$(grep -o "router listening on 127.0.0.1:[0-9]*" "$WORK/serve.log" | grep -o "[0-9]*$")
}
# STREAMS long streams (one decode rank holds them all).
start_streams() {
  CURLS=()
  for i in $(seq "$STREAMS"); do
    curl -sN -m 60 "http://127.0.0.1:$HTTP/v1/completions" \
      -d '{"prompt":"In the beginning","max_tokens":230,"ignore_eos":true,"stream":true}' > "$WORK/stream-$i.txt" 2>/dev/null &
    CURLS+=($!)
  done
  # Every call admitted (its first token came) before the stop: one still on its way when the
  # drain begins is refused, rightly, and would not be "in progress".
  started() {
    local n=0
    for i in $(seq "$STREAMS"); do grep -q "^data: {" "$WORK/stream-$i.txt" 2>/dev/null && n=$((n + 1)); done
    [ "$n" = "$STREAMS" ]
  }
  for _ in $(seq 300); do started && break; sleep 0.1; done
  started || fail "not every stream had its first token within 30 s"
}
stopped_within() {  # seconds
  for _ in $(seq $(($1 * 10))); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
  ! kill -0 "$PID" 2>/dev/null
}

serve --drain-timeout-ms 60000
start_streams
kill -TERM "$PID"
RUNNING=0
for i in $(seq "$STREAMS"); do grep -q "data: \[DONE\]" "$WORK/stream-$i.txt" || RUNNING=$((RUNNING + 1)); done
[ "$RUNNING" -gt 0 ] || fail "every stream had ended before SIGTERM: the drain was not exercised"
for _ in $(seq 100); do grep -q "baton local: draining" "$WORK/serve.log" && break; sleep 0.05; done
grep -q "baton local: draining: no new requests" "$WORK/serve.log" || fail "no 'draining' line after SIGTERM"
# New work is refused while the streams finish: HTTP calls and /health with 503, the C++ client
# as shutting_down.
code=$(curl -s -m 30 -o "$WORK/new.json" -D "$WORK/new.head" -w '%{http_code}' "http://127.0.0.1:$HTTP/v1/completions" -d '{"prompt":"In","max_tokens":4}' || true)
[ "$code" = 503 ] || fail "a new call while draining was answered '$code', want 503"
grep -q "shutting down" "$WORK/new.json" || fail "the 503 does not say the gateway is shutting down: $(cat "$WORK/new.json")"
grep -qi "^Retry-After: 1" "$WORK/new.head" || fail "the 503 has no Retry-After"
grep -qi "^Connection: close" "$WORK/new.head" || fail "the 503 does not close its connection"
[ "$(curl -s -m 30 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$HTTP/health")" = 503 ] || fail "/health was not 503 while draining"
if "$BATON" generate --router "127.0.0.1:$ROUTER" --prompt "In" --max-tokens 4 > "$WORK/generate.txt" 2>&1; then
  fail "baton generate was answered while the head drained"
fi
grep -q "shutting down" "$WORK/generate.txt" || fail "baton generate's refusal does not say why: $(cat "$WORK/generate.txt")"
LATE=0
for i in $(seq "$STREAMS"); do grep -q "data: \[DONE\]" "$WORK/stream-$i.txt" || LATE=$((LATE + 1)); done
[ "$LATE" -gt 0 ] || fail "every stream had ended before the checks of the drain were done: they did not run during it"
stopped_within 60 || fail "it did not stop within 60 s of SIGTERM"
wait "$PID" && rc=0 || rc=$?
PID=""
[ "$rc" = 0 ] || fail "the drained head exited with $rc"
wait  # the curls
for i in $(seq "$STREAMS"); do
  tail -c 200 "$WORK/stream-$i.txt" | grep -q "data: \[DONE\]" || fail "stream $i did not end with [DONE]: $(tail -c 300 "$WORK/stream-$i.txt")"
  grep -q '"error"' "$WORK/stream-$i.txt" && fail "stream $i carries an error: $(grep '"error"' "$WORK/stream-$i.txt" | head -1)"
  [ "$(grep -c '^data: {' "$WORK/stream-$i.txt")" -ge 230 ] || fail "stream $i has fewer than 230 token events"
done
grep -q "baton local: stopped" "$WORK/serve.log" || fail "no 'stopped' line"
echo "drain e2e: SIGTERM let $RUNNING running streams (of $STREAMS) finish; new calls got 503 meanwhile; exit 0"

# A second SIGTERM a second or more after the first does not wait for the streams: each stream
# cut ends with an error event saying so. (One sooner is the same request again: a parent's
# death signal repeated, systemd signalling the whole tree.)
serve --drain-timeout-ms 60000
start_streams
kill -TERM "$PID"
kill -TERM "$PID"  # the same request again, at once: not an insistence
for _ in $(seq 100); do grep -q "baton local: draining" "$WORK/serve.log" && break; sleep 0.05; done
sleep 0.3
kill -0 "$PID" 2>/dev/null || fail "a SIGTERM right after the first stopped the head: it must not insist"
sleep 1
kill -TERM "$PID"
stopped_within 10 || fail "a second SIGTERM did not stop it within 10 s"
PID=""
wait || true
CUT=0
for i in $(seq "$STREAMS"); do grep -q "data: \[DONE\]" "$WORK/stream-$i.txt" || CUT=$((CUT + 1)); done
[ "$CUT" -gt 0 ] || fail "every stream ended before the second SIGTERM: it was not what stopped the head"
for i in $(seq "$STREAMS"); do
  grep -q "data: \[DONE\]" "$WORK/stream-$i.txt" && continue
  # Its error event (the gateway's, or a rank's that stopped first), not a dropped connection.
  grep -q '^data: {"error"' "$WORK/stream-$i.txt" ||
    fail "stream $i was cut without an error event: $(tail -c 300 "$WORK/stream-$i.txt")"
done
echo "drain e2e: a second SIGTERM stopped the head at once, cutting $CUT of $STREAMS streams"

# A gateway in its own process (`baton gateway`) drains the same way on SIGTERM.
serve
"$BATON" gateway --router "127.0.0.1:$ROUTER" --listen 127.0.0.1:0 > "$WORK/gateway.log" 2>&1 &
GW=$!
for _ in $(seq 300); do grep -q "listening on" "$WORK/gateway.log" && break; sleep 0.1; done
HTTP=$(grep -o "listening on http://127.0.0.1:[0-9]*" "$WORK/gateway.log" | grep -o "[0-9]*$") || fail "baton gateway did not listen: $(cat "$WORK/gateway.log")"
start_streams
kill -TERM "$GW"
for _ in $(seq 100); do grep -q "baton gateway: draining" "$WORK/gateway.log" && break; sleep 0.05; done
grep -q "baton gateway: draining: no new calls" "$WORK/gateway.log" || fail "baton gateway printed no 'draining' line"
code=$(curl -s -m 30 -o "$WORK/new.json" -w '%{http_code}' "http://127.0.0.1:$HTTP/v1/completions" -d '{"prompt":"In","max_tokens":4}' || true)
[ "$code" = 503 ] || fail "a new call to the draining baton gateway was answered '$code', want 503"
for _ in $(seq 300); do kill -0 "$GW" 2>/dev/null || break; sleep 0.1; done
wait "$GW" && rc=0 || rc=$?
[ "$rc" = 0 ] || fail "the drained baton gateway exited with $rc: $(cat "$WORK/gateway.log")"
for i in $(seq "$STREAMS"); do
  tail -c 200 "$WORK/stream-$i.txt" | grep -q "data: \[DONE\]" || fail "stream $i through baton gateway did not end with [DONE]"
done
echo "drain e2e: baton gateway drained its $STREAMS streams on SIGTERM and exited 0"
kill -TERM "$PID"
stopped_within 30 || fail "the head did not stop"
PID=""
wait || true
echo "drain e2e: all checks passed"
