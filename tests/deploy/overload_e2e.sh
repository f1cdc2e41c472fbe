#!/usr/bin/env bash
# Overload (issue 10): a cluster admitting at most 8 requests in flight, offered 3x that (24
# closed-loop HTTP connections, wrk) for 10 s. Asserted: the server stays up; every answer is a
# 200, or a 429 (admission control) / 503 with Retry-After -- never another status, never a
# dropped connection; the server's peak resident memory stays under 1 GiB; and it serves
# normally afterwards. Usage: overload_e2e.sh BATON_BINARY. Bounded; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-overload-XXXXXX)
SERVER=""
cleanup() {
  [ -n "$SERVER" ] && kill -INT "$SERVER" 2>/dev/null && for _ in $(seq 100); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.1; done
  [ -n "$SERVER" ] && kill -9 "$SERVER" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "overload e2e: FAILED: $*" >&2; tail -20 "$WORK/server.log" >&2; exit 1; }
command -v wrk > /dev/null || { echo "overload e2e: SKIPPED: no wrk (scripts/setup.sh installs it)"; exit 0; }
LIMIT=8 CONNS=24 SECS=10 PEAK_KB_MAX=$((1024 * 1024))
"$BATON" local --serve --http-listen 127.0.0.1:0 --max-active-requests $LIMIT > "$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 600); do grep -q "gateway listening" "$WORK/server.log" && break; sleep 0.1; done
URL=$(grep -o "gateway listening on http://[0-9.:]*" "$WORK/server.log" | awk '{print $4}')
[ -n "$URL" ] || fail "the server did not start"
cat > "$WORK/count.lua" <<'LUA'
-- Counts answers by status, across wrk's threads; requests that got no answer show as errors.
wrk.method = "POST"
wrk.body = '{"prompt":"In the beginning","max_tokens":8,"ignore_eos":true}'
wrk.headers["Content-Type"] = "application/json"
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) codes = {} retry_after = 0 end
function response(status, headers, body)
  codes[status] = (codes[status] or 0) + 1
  if headers["Retry-After"] then retry_after = retry_after + 1 end
end
function done(summary, latency, requests)
  local total, ra = {}, 0
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("codes")) do total[k] = (total[k] or 0) + v end
    ra = ra + t:get("retry_after")
  end
  for k, v in pairs(total) do io.write(string.format("status %d: %d\n", k, v)) end
  io.write(string.format("retry-after: %d\n", ra))
  local e = summary.errors
  io.write(string.format("socket errors: %d\n", e.connect + e.read + e.write + e.timeout))
end
LUA
wrk -t2 -c$CONNS -d${SECS}s --timeout 30s -s "$WORK/count.lua" "$URL/v1/completions" > "$WORK/wrk.txt" 2>&1 || fail "wrk"
kill -0 "$SERVER" 2>/dev/null || fail "the server died under overload"
cat "$WORK/wrk.txt" | grep -E "status|retry-after|socket errors|Requests/sec"
OK=$(grep -o "status 200: [0-9]*" "$WORK/wrk.txt" | grep -o "[0-9]*$" || echo 0)
REFUSED=$(grep -oE "status (429|503): [0-9]*" "$WORK/wrk.txt" | awk '{s += $3} END {print s + 0}')
OTHER=$(grep -oE "status [0-9]+: [0-9]*" "$WORK/wrk.txt" | grep -vE "status (200|429|503):" || true)
RETRY_AFTER=$(grep -o "retry-after: [0-9]*" "$WORK/wrk.txt" | grep -o "[0-9]*$")
SOCKET_ERRORS=$(grep -o "socket errors: [0-9]*" "$WORK/wrk.txt" | grep -o "[0-9]*$")
[ -z "$OTHER" ] || fail "answers other than 200/429/503: $OTHER"
[ "$OK" -gt 0 ] || fail "nothing was served under overload"
[ "$REFUSED" -gt 0 ] || fail "nothing was refused at 3x the admission limit"
[ "$RETRY_AFTER" -ge "$REFUSED" ] || fail "$REFUSED refusals but only $RETRY_AFTER had Retry-After"
[ "$SOCKET_ERRORS" = 0 ] || fail "$SOCKET_ERRORS requests got no answer at all"
PEAK_KB=$(grep VmHWM "/proc/$SERVER/status" | awk '{print $2}')
[ "$PEAK_KB" -lt "$PEAK_KB_MAX" ] || fail "peak resident memory $PEAK_KB kB is over the bound of $PEAK_KB_MAX kB"
code=$(curl -s -o /dev/null -w "%{http_code}" "$URL/v1/completions" -d '{"prompt":"After the storm","max_tokens":4}')
[ "$code" = 200 ] || fail "after the overload a request got $code"
echo "overload e2e: $OK served, $REFUSED refused with Retry-After, none lost; peak RSS $((PEAK_KB / 1024)) MiB (bound $((PEAK_KB_MAX / 1024)) MiB)"
echo "overload e2e: all checks passed"
