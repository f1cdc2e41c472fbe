#!/usr/bin/env bash
# A decode process of `baton local --serve --decode-processes 1` that dies (SIGKILL) is started
# again: it joins under its name, and calls are answered by it -- before, it was reaped and the
# cluster answered 503 for want of a decode rank until restarted by hand.
# Usage: decode_process_restart_e2e.sh BATON_BINARY. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
NAME=decode-process-restart-e2e
source "$(dirname "$0")/local_serve_lib.sh"
start_local_serve --decode-processes 1 --http-listen 127.0.0.1:0 --drain-timeout-ms 2000
call() {
  curl -s -m 30 "http://127.0.0.1:$HTTP/v1/completions" -H "Content-Type: application/json" \
    -d '{"prompt": "In the beginning", "max_tokens": 8, "temperature": 0}'
}
FIRST=$(call)
echo "$FIRST" | grep -q '"finish_reason"' || fail "the first call was not answered: $FIRST"
CHILD=$(pgrep -P "$PID" -f "node --role decode" | head -1)
[ -n "$CHILD" ] || fail "no decode process found under pid $PID"
kill -9 "$CHILD"
for _ in $(seq 300); do grep -q "decode-0 started again" "$WORK/local.log" && break; sleep 0.1; done
grep -q "decode process decode-0 (pid $CHILD) ended (signal 9)" "$WORK/local.log" || fail "the death was not said"
grep -q "decode-0 started again" "$WORK/local.log" || fail "it was not started again"
NEW=$(pgrep -P "$PID" -f "node --role decode" | head -1)
[ -n "$NEW" ] && [ "$NEW" != "$CHILD" ] || fail "no new decode process"
# Served again once the new process has joined (/health is 200 with a decode rank), the same answer.
for _ in $(seq 300); do curl -sf -m 5 "http://127.0.0.1:$HTTP/health" > /dev/null && break; sleep 0.1; done
AGAIN=$(call)
TEXT1=$(echo "$FIRST" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])')
TEXT2=$(echo "$AGAIN" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])') ||
  fail "the call after the restart was not answered: $AGAIN"
[ "$TEXT1" = "$TEXT2" ] || fail "greedy answers differ before and after the restart: '$TEXT1' vs '$TEXT2'"
echo "decode process restart e2e: killed pid $CHILD, restarted as pid $NEW, the same greedy answer"
