#!/usr/bin/env bash
# `baton local` throughput on the built-in model with 1 and 2 ranks of each kind: 64 requests at
# once, 32 tokens each (ignoring <eos>), 3 runs per configuration, the median run by tokens/s.
# Usage: bench/local_throughput.sh [path/to/baton]
set -euo pipefail
baton="${1:-$(dirname "$0")/../build/deploy/baton}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "| prefill + decode ranks | requests/s | tokens/s | TTFT p50 / p99 ms | TBT p50 / p99 ms |"
echo "|---|---|---|---|---|"
for r in 1 2; do
  for rep in 1 2 3; do
    "$baton" local --prefill-ranks $r --decode-ranks $r --num-requests 64 --max-tokens 32 --ignore-eos --quiet \
      >"$tmp/run.$rep"
    echo "$(sed -n 's/.* \([0-9.]*\) tokens\/s$/\1/p' "$tmp/run.$rep") $tmp/run.$rep"
  done >"$tmp/index"
  median=$(sort -g "$tmp/index" | sed -n 2p | cut -d' ' -f2)
  rps=$(sed -n 's/.*: \([0-9.]*\) requests\/s.*/\1/p' "$median")
  tps=$(sed -n 's/.* \([0-9.]*\) tokens\/s$/\1/p' "$median")
  ttft=$(awk '/TTFT/ {print $3 " / " $7}' "$median")
  tbt=$(awk '/TBT/ {print $5 " / " $9}' "$median")
  echo "| $r + $r | $rps | $tps | $ttft | $tbt |"
done
