#!/usr/bin/env bash
# KV send throughput over Baton's UCX transport, RMA puts and rendezvous active messages, vs
# ucx_perftest (ucp_put_bw, ucp_am_bw) with the same transport and message sizes, processes pinned
# to different cores, 127.0.0.1 only. The receiver's buffer is the transport's own memory, as a
# rank's KV pool is; one more column puts into ordinary heap memory (what pools were before).
# Two more columns send from and to offset 0 every time ("hot": both ends in the cache), which is
# what ucx_perftest does: the like-for-like comparison, next to a hot memcpy of the same chunk.
# Usage: bench/ucx_bench.sh [build dir]   (BATON_BENCH_UCX: another baton_bench_ucx binary;
# BATON_UCX_TLS: the transports, "sm tcp" by default)
set -euo pipefail
build="${1:-$(dirname "$0")/../build}"
bench_ucx="${BATON_BENCH_UCX:-$build/bench/baton_bench_ucx}"
export UCX_NET_DEVICES=lo
sizes_mib=(1 4 16 64)
source "$(dirname "$0")/perftest_lib.sh"
perftest() {  # test tls size_bytes -> GB/s (1e9 B/s)
  local iters=$(( (1024 << 20) / $3 ))
  [ "$iters" -lt 20 ] && iters=20
  ucx_perftest_gbps "$2" "$1" "$3" "$iters"
}
for tls in ${BATON_UCX_TLS:-sm tcp}; do
  echo "### UCX_TLS=$tls"
  echo
  args=()
  for s in "${sizes_mib[@]}"; do args+=(--layer-mib "$s"); done
  for mode in put am; do
    UCX_TLS=$tls taskset -c 0,1 "$bench_ucx" --send $mode "${args[@]}" --total-mib 1024 >/tmp/baton_ucx_${tls}_$mode.txt
  done
  UCX_TLS=$tls taskset -c 0,1 "$bench_ucx" --send put --receiver-memory heap "${args[@]}" --total-mib 1024 \
    >/tmp/baton_ucx_${tls}_heap.txt
  for inflight in 4 16; do
    UCX_TLS=$tls taskset -c 0,1 "$bench_ucx" --send put --buffers hot --inflight $inflight "${args[@]}" \
      --total-mib 1024 >/tmp/baton_ucx_${tls}_hot$inflight.txt
  done
  echo "| layer size | Baton UCX put (256 MiB buffers, cold) | Baton UCX rendezvous active messages | Baton put into heap memory | ucx_perftest ucp_put_bw | ucx_perftest ucp_am_bw | cold memcpy | Baton UCX put, hot (one chunk, as ucx_perftest), 4 / 16 in flight | hot memcpy |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for s in "${sizes_mib[@]}"; do
    col() { awk -F'|' -v s="$s MiB" -v c="$2" '$2 ~ "^ "s" $" {gsub(/ /, "", $c); print $c}' "$1"; }
    echo "| $s MiB | $(col /tmp/baton_ucx_${tls}_put.txt 3) | $(col /tmp/baton_ucx_${tls}_am.txt 3) | $(col /tmp/baton_ucx_${tls}_heap.txt 3) | $(perftest ucp_put_bw "$tls" $((s << 20))) GB/s | $(perftest ucp_am_bw "$tls" $((s << 20))) GB/s | $(col /tmp/baton_ucx_${tls}_put.txt 4) | $(col /tmp/baton_ucx_${tls}_hot4.txt 3) / $(col /tmp/baton_ucx_${tls}_hot16.txt 3) | $(col /tmp/baton_ucx_${tls}_hot4.txt 4) |"
  done
  echo
done
