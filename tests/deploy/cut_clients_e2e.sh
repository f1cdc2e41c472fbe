#!/usr/bin/env bash
# Clients that hang up at once leave no KV behind on decode ranks in processes of their own
# (`baton local --serve --decode-processes 2`): a request cancelled while its reservation was on
# its way tells the rank, which drops it or frees its grant. Before, the remote rank, never told, held the
# pages through the lease and a minute's quarantine, and new calls were refused for want of KV.
# Usage: cut_clients_e2e.sh BATON_BINARY. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
NAME=cut-clients-e2e
source "$(dirname "$0")/local_serve_lib.sh"
start_local_serve --decode-processes 2 --kv-pages 64 --http-listen 127.0.0.1:0
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
