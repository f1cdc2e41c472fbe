#!/usr/bin/env bash
# Gateway overhead (issue 9): short completions (max_tokens 1) at the same concurrency, in the
# same run, (a) straight to the router through the C++ client, (b) through the HTTP gateway in
# the router's process, (c) through a gateway in its own process (`baton gateway`, one more CAF
# hop); load from wrk (Debian) with a Lua script, on 127.0.0.1.
#   bench/gateway_bench.sh [BUILD_DIR] [CONCURRENCY] [SECONDS]
set -euo pipefail
BUILD=${1:-build}
C=${2:-8}
T=$(( C < 2 ? 1 : 2 ))  # wrk threads (at most one per connection)
S=${3:-10}
BATON="$BUILD/deploy/baton"
WORK=$(mktemp -d /tmp/baton-gateway-bench-XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null || true; done; sleep 1; for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT
export UCX_NET_DEVICES=lo
wait_line() { for _ in $(seq 600); do grep -qs "$2" "$1" && return 0; sleep 0.1; done; echo "no '$2' in $1" >&2; exit 1; }  # -s: the log may not exist yet

"$BATON" local --serve --router-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --api-key sk-bench-key > "$WORK/head.log" 2>&1 &
PIDS+=($!)
wait_line "$WORK/head.log" "gateway listening"
ROUTER=$(grep -o "router listening on [0-9.:]*" "$WORK/head.log" | awk '{print $4}')
HTTP=$(grep -o "gateway listening on http://[0-9.:]*" "$WORK/head.log" | awk '{print $4}')
"$BATON" gateway --router "$ROUTER" --listen 127.0.0.1:0 --api-key sk-bench-key > "$WORK/gw.log" 2>&1 &
PIDS+=($!)
wait_line "$WORK/gw.log" "listening on"
HTTP2=$(grep -o "listening on http://[0-9.:]*" "$WORK/gw.log" | awk '{print $3}')

cat > "$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"prompt":"In the beginning","max_tokens":1}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench-key"
LUA
echo "== machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%F)"
echo "== concurrency $C, $S s each, max_tokens 1, prompt 'In the beginning'"
"$BUILD/bench/baton_bench_client_load" "$ROUTER" 1 2 1 "In the beginning" > /dev/null  # warm up
echo "-- (a) router directly, C++ client"
"$BUILD/bench/baton_bench_client_load" "$ROUTER" "$C" "$S" 1 "In the beginning"
echo "-- (b) gateway in the router's process, wrk"
wrk -t"$T" -c"$C" -d"${S}s" --latency -s "$WORK/post.lua" "$HTTP/v1/completions" | grep -E "Latency|50%|99%|Requests/sec|Non-2xx|requests in"
echo "-- (c) gateway in its own process, wrk"
wrk -t"$T" -c"$C" -d"${S}s" --latency -s "$WORK/post.lua" "$HTTP2/v1/completions" | grep -E "Latency|50%|99%|Requests/sec|Non-2xx|requests in"
echo "-- (d) the gateway alone: GET /v1/models (no generation), wrk"
cat > "$WORK/get.lua" <<'LUA'
wrk.headers["Authorization"] = "Bearer sk-bench-key"
LUA
wrk -t"$T" -c"$C" -d"${S}s" --latency -s "$WORK/get.lua" "$HTTP/v1/models" | grep -E "Latency|50%|99%|Requests/sec|Non-2xx"
