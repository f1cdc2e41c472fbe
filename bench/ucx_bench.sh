#!/usr/bin/env bash
# KV send throughput over Baton's UCX transport vs ucx_perftest (ucp_put_bw) with the same
# transport and message sizes, processes pinned to different cores, 127.0.0.1 only.
# Usage: bench/ucx_bench.sh [build dir]
set -euo pipefail
build="${1:-$(dirname "$0")/../build}"
export UCX_NET_DEVICES=lo
sizes_mib=(1 4 16 64)
port=13500
perftest() {  # tls size_bytes -> GB/s (1e9 B/s)
  local tls=$1 size=$2 iters=$(( (1024 << 20) / $2 ))
  [ "$iters" -lt 20 ] && iters=20
  UCX_TLS=$tls taskset -c 0 ucx_perftest -p $port >/dev/null 2>&1 &
  local srv=$!
  sleep 0.5
  local mbs
  mbs=$(UCX_TLS=$tls taskset -c 1 ucx_perftest 127.0.0.1 -p $port -t ucp_put_bw -s "$size" -n "$iters" -w 5 -f 2>/dev/null |
        awk 'NF == 8 && $1 ~ /^[0-9]+$/ {print $5}' | tail -1)
  wait $srv 2>/dev/null || true
  port=$((port + 1))
  awk -v m="$mbs" 'BEGIN {printf "%.2f", m * 1.048576 / 1000}'
}
for tls in sm tcp; do
  echo "### UCX_TLS=$tls"
  echo
  args=()
  for s in "${sizes_mib[@]}"; do args+=(--layer-mib "$s"); done
  UCX_TLS=$tls taskset -c 0,1 "$build/bench/baton_bench_ucx" "${args[@]}" --total-mib 1024 >/tmp/baton_ucx_$tls.txt
  echo "| layer size | Baton UCX (256 MiB buffers, cold) | ucx_perftest ucp_put_bw (one buffer of the message size) | cold memcpy |"
  echo "|---|---|---|---|"
  for s in "${sizes_mib[@]}"; do
    ours=$(awk -F'|' -v s="$s MiB" '$2 ~ "^ "s" $" {gsub(/ /, "", $3); print $3}' /tmp/baton_ucx_$tls.txt)
    mem=$(awk -F'|' -v s="$s MiB" '$2 ~ "^ "s" $" {gsub(/ /, "", $4); print $4}' /tmp/baton_ucx_$tls.txt)
    echo "| $s MiB | $ours | $(perftest "$tls" $((s << 20))) GB/s | $mem |"
  done
  echo
done
