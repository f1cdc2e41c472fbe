#!/usr/bin/env bash
# What an idle cluster costs: `baton local --serve` in a few shapes (plain, KV over UCX to a decode
# process, expert parallelism with 2 and 4 EP ranks per engine, whose shards are processes of their
# own, data-parallel attention, whose decode ranks serve each other's experts), left idle after one
# request. Two costs: the CPU time all its processes use, per second of wall time, over 5 s of
# idleness; and what idleness costs the next request: the TTFT (the prefill ranks waking) and
# the first TBT (the decode rank's first step) of a prompt sent after 2-5 s idle, against the same
# prompt's sent right after it, warm (medians of 5 and 15; the cluster's own figures, from `baton
# generate --verbose`, so the client's connection is not in them). Waits that poll less when idle
# answer later when work comes. The floor both chase is the plain cluster's, measured in the same
# run. 127.0.0.1 only.
# Usage: bench/idle_cpu.sh [build dir]
set -euo pipefail
build="${1:-$(dirname "$0")/../build}"
baton="$(cd "$build" && pwd)/deploy/baton"
export UCX_NET_DEVICES=lo
tick=$(getconf CLK_TCK)
cpu_ticks() {  # the user + system time of the process $1 and all its descendants, in ticks
  local total=0 p
  for p in $1 $(pgrep -P "$1" || true); do
    [ "$p" = "$1" ] || { total=$((total + $(cpu_ticks "$p"))); continue; }
    [ -r "/proc/$p/stat" ] && total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat")))
  done
  echo "$total"
}
processes() { echo $((1 + $(pgrep -P "$1" | wc -l))); }
prompt="In the beginning God created the heaven and the earth"
times() {  # "TTFT first-TBT" in ms, a line per request, of $2 requests of one prompt sent one after another to port $1
  local args=() i
  for i in $(seq "$2"); do args+=(--prompt "$prompt"); done
  "$baton" generate --router "127.0.0.1:$1" --max-tokens 2 --verbose "${args[@]}" 2>&1 |
    sed -n 's/.*TTFT \([0-9.]*\) ms, TBT mean [0-9.]* ms (first \([0-9.]*\),.*/\1 \2/p'
}
median() { sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
echo "| cluster | processes | idle CPU (ms per s) | TTFT after idle (ms) | warm TTFT (ms) | first TBT after idle (ms) | warm first TBT (ms) |"
echo "|---|---|---|---|---|---|---|"
while IFS='|' read -r what args; do
  log=$(mktemp)
  # shellcheck disable=SC2086
  "$baton" local --serve --router-listen 127.0.0.1:0 $args >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do grep -q "serving;" "$log" && break; sleep 0.1; done
  grep -q "serving;" "$log" || { cat "$log"; kill -TERM $pid; exit 1; }
  port=$(grep -o "router listening on 127.0.0.1:[0-9]*" "$log" | grep -o "[0-9]*$")
  sleep 2  # let start-up settle (shards' first waits, UCX's first connections)
  first=$(times "$port" 1)  # a first request's one-off costs (connections, first pages) stay out of both
  [ -n "$first" ] || { cat "$log"; kill -TERM $pid; exit 1; }
  sleep 1
  n=$(processes $pid)
  a=$(cpu_ticks $pid); sleep 5; b=$(cpu_ticks $pid)
  after=() warm=()
  for cycle in 1 2 3 4 5; do
    [ $cycle = 1 ] || sleep 2
    mapfile -t t < <(times "$port" 4)
    after+=("${t[0]}") warm+=("${t[@]:1}")
  done
  col() { printf '%s\n' "${@:2}" | cut -d' ' -f"$1" | median; }
  echo "| $what | $n | $(( (b - a) * 1000 / tick / 5 )) | $(col 1 "${after[@]}") | $(col 1 "${warm[@]}") |" \
       "$(col 2 "${after[@]}") | $(col 2 "${warm[@]}") |"
  kill -TERM $pid; wait $pid 2>/dev/null || true
  rm -f "$log"
done <<'SHAPES'
plain, 2 prefill + 2 decode ranks|--model deepseek-v3-tiny
decode in its own process, KV over UCX|--model deepseek-v3-tiny --decode-processes 1 --transport ucx
EP 2 (4 shard processes)|--model deepseek-v3-tiny --expert-parallel 2
EP 4 (12 shard processes)|--model deepseek-v3-tiny --expert-parallel 4
data-parallel attention, 4 decode ranks in one EP 4 group|--model deepseek-v3-tiny --decode-ranks 4 --expert-parallel 4 --dp-attention
SHAPES
