#!/usr/bin/env bash
# `baton local --serve`'s ports: (1) the gateway listens before the node directory does, since
# `baton launch` takes the directory's answer as "the head is up" and sends clients to the
# gateway right after; (2) a port already taken is refused with the flag and port named, and the
# process exits (it once hung there: the cluster's actors were left running); (3) the gateway's
# body limit is a flag of local --serve as of baton gateway.
# Usage: serve_ports_e2e.sh BATON_BINARY. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-serve-ports-e2e-XXXXXX)
PID=""
HOLDER=""
cleanup() {
  [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null || true
  if [ -n "$HOLDER" ]; then kill -9 "$HOLDER" 2>/dev/null; wait "$HOLDER" 2>/dev/null; fi || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "serve ports e2e: FAILED: $*" >&2; cat "$WORK"/*.log >&2 2>/dev/null || true; exit 1; }

"$BATON" local --serve --http-listen 127.0.0.1:0 --cluster-listen 127.0.0.1:0 --max-body-bytes 100 > "$WORK/serve.log" 2>&1 &
PID=$!
for _ in $(seq 600); do grep -q "serving;" "$WORK/serve.log" && break; kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
grep -q "serving;" "$WORK/serve.log" || fail "it did not start serving"
G=$(grep -n "gateway listening" "$WORK/serve.log" | cut -d: -f1)
C=$(grep -n "cluster listening" "$WORK/serve.log" | cut -d: -f1)
[ -n "$G" ] && [ -n "$C" ] && [ "$G" -lt "$C" ] || fail "the gateway (line ${G:-none}) must listen before the node directory (line ${C:-none})"
# The gateway's limits are local --serve's flags too.
HTTP=$(grep -o "gateway listening on http://127.0.0.1:[0-9]*" "$WORK/serve.log" | grep -o "[0-9]*$")
LONG=$(python3 -c 'print("{\"prompt\":\"" + "x" * 120 + "\",\"max_tokens\":1}")')
[ "$(curl -s -m 30 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$HTTP/v1/completions" -d "$LONG")" = 413 ] ||
  fail "a body past --max-body-bytes 100 was not refused with 413"
[ "$(curl -s -m 30 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$HTTP/v1/completions" -d '{"prompt":"In","max_tokens":1}')" = 200 ] ||
  fail "a body within --max-body-bytes 100 was not answered"
kill -TERM "$PID"
for _ in $(seq 300); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
! kill -0 "$PID" 2>/dev/null || fail "it did not stop within 30 s of SIGTERM"
PID=""
echo "serve ports e2e: the gateway listens before the node directory"

# A port held by a listener of our own.
python3 -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(120)' > "$WORK/port.txt" &
HOLDER=$!
for _ in $(seq 100); do [ -s "$WORK/port.txt" ] && break; sleep 0.1; done
TAKEN=$(cat "$WORK/port.txt")
[ -n "$TAKEN" ] || fail "no port held"
for flag in --router-listen --http-listen; do
  rc=0
  timeout 60 "$BATON" local --serve "$flag" 127.0.0.1:0 --cluster-listen "127.0.0.1:$TAKEN" > "$WORK/taken.log" 2>&1 || rc=$?
  [ "$rc" -ne 124 ] || fail "with $flag and a taken --cluster-listen port it did not exit within 60 s"
  [ "$rc" -ne 0 ] || fail "with $flag it served on a taken port"
  # Checked before anything starts (no store node adopted, no node met), the flag named.
  grep -q "cannot listen on --cluster-listen 127.0.0.1:$TAKEN: Address already in use" "$WORK/taken.log" ||
    fail "no sentence naming the taken port"
done
echo "serve ports e2e: a taken port is refused by name and the process exits"
echo "serve ports e2e: all checks passed"
