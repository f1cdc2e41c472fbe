#!/usr/bin/env bash
# Clients that hang up at once leave no KV behind on decode ranks in processes of their own
# (`baton local --serve --decode-processes 2`): a request cancelled while its reservation was on
# its way waits for the grant to give it back. Before, the remote rank, never told, held the
# pages through the lease and a minute's quarantine, and new calls were refused for want of KV.
# Usage: cut_clients_e2e.sh BATON_BINARY. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-cut-clients-e2e-XXXXXX)
PID=""
cleanup() {
  if [ -n "$PID" ]; then  # SIGINT: its decode processes are stopped with it
    kill -INT "$PID" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$PID" 2>/dev/null || true
  fi
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "cut clients e2e: FAILED: $*" >&2; cat "$WORK"/*.log >&2 2>/dev/null || true; exit 1; }

"$BATON" local --serve --decode-processes 2 --kv-pages 64 --http-listen 127.0.0.1:0 > "$WORK/local.log" 2>&1 &
PID=$!
for _ in $(seq 900); do grep -q "serving;" "$WORK/local.log" && break; kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
grep -q "serving;" "$WORK/local.log" || fail "it did not start serving"
HTTP=$(grep -o "gateway listening on http://127.0.0.1:[0-9]*" "$WORK/local.log" | grep -o "[0-9]*$")
for _ in $(seq 300); do curl -sf -m 5 "http://127.0.0.1:$HTTP/health" > /dev/null && break; sleep 0.1; done
# Free decode pages, summed over the decode ranks, and their total.
pages() {
  curl -sf -m 10 "http://127.0.0.1:$HTTP/metrics" | python3 -c '
import sys
free = total = 0
for line in sys.stdin:
    if line.startswith("baton_rank_free_kv_pages{role=\"decode\""): free += int(float(line.split()[-1]))
    if line.startswith("baton_rank_kv_pages{role=\"decode\""): total += int(float(line.split()[-1]))
print(free, total)'
}
# 80 calls of 200 tokens, 8 at a time, each connection closed as soon as its request is sent.
python3 - "$HTTP" <<'PY'
import json, socket, sys, time
port = int(sys.argv[1])
body = json.dumps({"prompt": "In the beginning", "max_tokens": 200, "ignore_eos": True}).encode()
req = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
for _ in range(10):
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
    for s in socks: s.sendall(req)
    for s in socks: s.close()
    time.sleep(0.05)
PY
# Every page back within seconds (the lease is 2 s; the quarantine it used to fall into, 60 s).
for _ in $(seq 100); do
  read -r FREE TOTAL < <(pages)
  [ "$FREE" = "$TOTAL" ] && break
  sleep 0.1
done
read -r FREE TOTAL < <(pages)
[ "$TOTAL" -gt 0 ] || fail "no decode rank in /metrics"
[ "$FREE" = "$TOTAL" ] || fail "$FREE of $TOTAL decode pages free 10 s after the clients hung up"
# And a call that needs most of a rank's KV is served.
curl -sf -m 60 "http://127.0.0.1:$HTTP/v1/completions" -d '{"prompt":"In the beginning","max_tokens":200,"ignore_eos":true}' > /dev/null ||
  fail "a 200-token call after the cut clients failed"
echo "cut clients e2e: passed ($FREE of $TOTAL decode pages free)"
