#!/usr/bin/env bash
# Expert-parallel dispatch/combine between processes over Baton's all-to-all (UCX shared memory)
# beside ucx_perftest ucp_put_bw with the same transport and per-destination message sizes, in the
# same run; 127.0.0.1 only. Two ranks on a 2-vCPU machine: each rank both sends and receives.
# Usage: bench/a2a_bench.sh [build dir] [tokens per rank ...]
set -euo pipefail
build="${1:-$(dirname "$0")/../build}"
shift || true
tokens=("${@:-64 256}")
export UCX_NET_DEVICES=lo UCX_TLS=sm
source "$(dirname "$0")/perftest_lib.sh"
perftest() {  # size_bytes -> GB/s (1e9 B/s)
  local iters=$(( (512 << 20) / $1 ))
  [ "$iters" -lt 20 ] && iters=20
  ucx_perftest_gbps sm ucp_put_bw "$1" "$iters"
}
echo "| tokens per rank | chunk to the peer (dispatch / combine) | Baton dispatch, direct stores | Baton combine, direct stores | Baton dispatch, puts | Baton combine, puts | ucx_perftest put_bw at the dispatch / combine size |"
# Baton's figures: bytes each rank received from its peer over the exchange's time (median of 20),
# with chunks stored straight into the peer's mapped slots (--direct 1, the default) and with
# every chunk a put (--direct 0).
echo "|---|---|---|---|---|---|---|"
run() {  # tokens direct -> "dispatch_gbps combine_gbps dispatch_us combine_us chunk_kib"
  local out
  out=$("$build/bench/baton_bench_a2a" --ranks 2 --tokens "$1" --rounds 20 --direct "$2")
  echo "$out" | grep -q "every byte verified" || { echo "$out" >&2; exit 1; }
  if [ "$2" = 1 ] && ! echo "$out" | grep -q "1 of 1 peers by direct stores"; then
    echo "$out" >&2; echo "direct stores were asked for but UCX mapped no peer" >&2; exit 1
  fi
  # Both ranks' medians, averaged.
  echo "$out" | awk '/^rank/ {
      for (i = 1; i <= NF; ++i) {
        if ($i == "dispatch") { dus += $(i+1); d += substr($(i+3), 2) }
        if ($i == "combine") { cus += $(i+1); c += substr($(i+3), 2) }
        if ($i ~ /^~/) k = substr($i, 2) }
      n++ } END {printf "%.2f %.2f %.0f %.0f %s\n", d / n, c / n, dus / n, cus / n, k}'
}
for t in ${tokens[@]}; do
  read -r d c dus cus kib < <(run "$t" 1)
  read -r pd pc pdus pcus _ < <(run "$t" 0)
  dsize=$(awk -v k="$kib" 'BEGIN {printf "%d", k * 1024}')
  echo "| $t | ${kib} KiB / $((kib * 2)) KiB | $d GB/s ($dus us) | $c GB/s ($cus us) | $pd GB/s ($pdus us) | $pc GB/s ($pcus us) | $(perftest "$dsize") / $(perftest $((dsize * 2))) GB/s |"
done
