#!/usr/bin/env bash
# Where colocated serving beats disaggregation, and heterogeneous GPUs (issue 8, docs/sims.md):
# `baton sim compare` on synthetic Poisson workloads, one row per (model, cluster, prompt
# length), goodput under fixed SLOs for a disaggregated cluster and a colocated one of the same
# GPUs. Virtual time only: the figures do not depend on this machine's speed.
# Usage: bench/sim_sweep.sh [BUILD_DIR]   (prints markdown tables)
set -euo pipefail
BATON=${1:-build}/deploy/baton
SEARCH=(--lo 0.25 --hi 128 --steps 8 --rate 1 --duration-s 120 --seed 1)

row() {  # row LABEL MODEL TP P D INPUT OUTPUT TTFT_SLO_MS TBT_SLO_MS
  local label=$1 model=$2 tp=$3 p=$4 d=$5 in=$6 out=$7
  "$BATON" sim compare --model "$model" --tp "$tp" --input-mean "$in" --output-mean "$out" --ttft-slo-ms "$8" \
    --tbt-slo-ms "$9" "${SEARCH[@]}" \
    --variant "disaggregated=--prefill-instances $p --decode-instances $d" \
    --variant "colocated=--colocated --decode-instances $((p + d))" |
    awk -v label="$label" -v slo="$8 ms / $9 ms" 'NR > 1 { g[$1] = $8 }
      END { printf "| %s | %s | %s | %s |\n", label, slo, g["disaggregated"], g["colocated"] }'
}

echo "Goodput (requests/s with >= 90% of requests within both SLOs), synthetic Poisson arrivals,"
echo "lognormal lengths (cv 1) around the means shown:"
echo
echo "| workload and cluster | SLO TTFT / TBT | disaggregated | colocated |"
echo "|---|---|---|---|"
row "Llama-3-8B, 2 x H200 (1P+1D vs 2 colocated), prompts ~128, outputs ~512" llama-3-8b 1 1 1 128 512 1000 50
row "Llama-3-8B, 2 x H200, prompts ~256, outputs ~256" llama-3-8b 1 1 1 256 256 1000 50
row "Llama-3-8B, 2 x H200, prompts ~4096, outputs ~256" llama-3-8b 1 1 1 4096 256 1000 50
row "Llama-3-8B, 8 x H200 (4P+4D vs 8), prompts ~4096, outputs ~256" llama-3-8b 1 4 4 4096 256 1000 50
row "Llama-3-70B, 8 x H200 as TP2 (2P+2D vs 4), prompts ~256, outputs ~256" llama-3-70b 2 2 2 256 256 1000 50
row "Llama-3-70B, 8 x H200 as TP2, prompts ~4096, outputs ~256" llama-3-70b 2 2 2 4096 256 2000 100
echo
echo "Heterogeneous GPUs (Qwen3-32B TP2, 2 prefill + 2 decode instances, prompts ~4096, outputs ~256, SLO"
echo "TTFT <= 2 s, TBT <= 100 ms):"
echo
echo "| prefill GPUs | decode GPUs | goodput (requests/s) |"
echo "|---|---|---|"
for pair in "H200 H200" "H200 H800" "H800 H200" "H800 H800"; do
  set -- $pair
  g=$("$BATON" sim goodput --model qwen3-32b --tp 2 --prefill-instances 2 --decode-instances 2 --prefill-gpu "$1" \
        --decode-gpu "$2" --input-mean 4096 --output-mean 256 --ttft-slo-ms 2000 --tbt-slo-ms 100 "${SEARCH[@]}" |
        grep -o "= [>= ]*[0-9.]* requests/s" | sed "s/^= //; s/ requests\/s//") ||
    g="below the lowest rate tried"  # goodput says so and exits 1
  echo "| $1 | $2 | $g |"
done
