#!/usr/bin/env bash
# Goodput under overload (issue 10): the same cluster (admission limit L requests in flight) at
# capacity (L closed-loop HTTP connections) and offered 3x the request rate measured there (3L
# connections, each pacing its requests with wrk's delay(), as clients that honour Retry-After
# would arrive), S seconds each, in one run. Goodput =
# completions per second whose whole generation (TTFT + every TBT, the gateway's
# baton_e2e_seconds histogram, scraped before and after each phase) met the SLO.
#   bench/overload_bench.sh [BUILD_DIR] [L] [S] [SLO_BUCKET_SECONDS]
set -euo pipefail
BUILD=${1:-build} L=${2:-8} S=${3:-10} SLO=${4:-0.1}
BATON="$BUILD/deploy/baton"
WORK=$(mktemp -d /tmp/baton-overload-bench-XXXXXX)
"$BATON" local --serve --http-listen 127.0.0.1:0 --max-active-requests "$L" > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; sleep 1; kill -9 $SERVER 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 600); do grep -q "gateway listening" "$WORK/server.log" && break; sleep 0.1; done
URL=$(grep -o "gateway listening on http://[0-9.:]*" "$WORK/server.log" | awk '{print $4}')
cat > "$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"prompt":"In the beginning","max_tokens":8,"ignore_eos":true}'
wrk.headers["Content-Type"] = "application/json"
local pace_ms = tonumber(os.getenv("PACE_MS") or "0")
function delay() return pace_ms end
LUA
scrape() {  # completions, and those within the SLO bucket
  curl -s "$URL/metrics" | awk -v slo="$SLO" '
    $1 == "baton_e2e_seconds_count" {n = $2}
    $1 ~ "^baton_e2e_seconds_bucket\\{le=\"" slo "\"\\}" {ok = $2}
    END {print n + 0, ok + 0}'
}
echo "== machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%F)"
echo "== admission limit $L, $S s per phase, 8 tokens per request, SLO: whole generation <= ${SLO} s"
wrk -t2 -c"$L" -d2s -s "$WORK/post.lua" "$URL/v1/completions" > /dev/null  # warm up
declare -A GOOD
PACE=0 CAPACITY_RPS=0
for phase in capacity overload; do
  conns=$L
  if [ $phase = overload ]; then
    conns=$((3 * L))
    # 3x capacity's request rate over 3L connections: each waits about 3L / (3 x rate) s between
    # requests (less a little: a refusal's own round trip; the achieved rate is printed)
    PACE=$(awk -v c="$conns" -v r="$CAPACITY_RPS" 'BEGIN {p = 1000 * c / (3 * r) * 0.6; printf "%d", p < 1 ? 1 : p}')
  fi
  read -r n0 ok0 < <(scrape)
  out=$(PACE_MS=$PACE wrk -t2 -c"$conns" -d"${S}s" -s "$WORK/post.lua" "$URL/v1/completions")
  read -r n1 ok1 < <(scrape)
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  non2xx=$(echo "$out" | awk '/Non-2xx/ {print $5}')
  done_per_s=$(awk -v a="$n1" -v b="$n0" -v s="$S" 'BEGIN {print (a - b) / s}')
  good_per_s=$(awk -v a="$ok1" -v b="$ok0" -v s="$S" 'BEGIN {print (a - b) / s}')
  GOOD[$phase]=$good_per_s
  [ $phase = capacity ] && CAPACITY_RPS=$rps
  [ $phase = overload ] && OVER_RPS=$rps
  printf "%-9s %3d connections, pace %3d ms: %8.1f answers/s (%s refused), %6.1f completions/s, %6.1f within SLO/s\n" \
    "$phase" "$conns" "$PACE" "$rps" "${non2xx:-0}" "$done_per_s" "$good_per_s"
done
awk -v o="${GOOD[overload]}" -v c="${GOOD[capacity]}" -v a="$OVER_RPS" -v r="$CAPACITY_RPS" \
  'BEGIN {printf "offered %.1fx the capacity phase'"'"'s request rate; goodput there / at capacity: %.1f %%\n", a / r, 100 * o / c}'
