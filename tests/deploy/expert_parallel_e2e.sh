#!/usr/bin/env bash
# Expert parallelism across processes: `baton local --expert-parallel N` splits every engine's
# routed experts over N EP ranks, N - 1 of them `baton experts` processes reached over UCX. The
# answers must equal EP 1's exactly, and no expert process may outlive the run.
# Usage: expert_parallel_e2e.sh <baton binary>
set -euo pipefail
baton="$1"
export UCX_NET_DEVICES=lo
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for model in deepseek-v3-tiny deepseek-v2-tiny; do
  for ep in 1 2 4; do
    "$baton" local --model "$model" --expert-parallel "$ep" --max-tokens 10 --prompt "Experts, route this" \
      --prompt "A second prompt, longer, to fill a chunk of the prefill with more than a few tokens" \
      >"$out/$model-$ep.txt" 2>&1 || { cat "$out/$model-$ep.txt"; exit 1; }
    grep -q "2 requests, 0 failed" "$out/$model-$ep.txt" || { cat "$out/$model-$ep.txt"; exit 1; }
    grep "output :" "$out/$model-$ep.txt" >"$out/$model-$ep.answers"
  done
  # Live EPLB re-places experts every 4 MoE rounds: where experts run changes, the answers do not.
  "$baton" local --model "$model" --expert-parallel 4 --eplb-slots 4 --eplb-interval 4 --max-tokens 10 \
    --prompt "Experts, route this" \
    --prompt "A second prompt, longer, to fill a chunk of the prefill with more than a few tokens" \
    >"$out/$model-eplb.txt" 2>&1 || { cat "$out/$model-eplb.txt"; exit 1; }
  grep "output :" "$out/$model-eplb.txt" >"$out/$model-eplb.answers"
  # Dual-batch overlap: two micro-batches per MoE layer on two channels; the same answers.
  "$baton" local --model "$model" --expert-parallel 2 --dual-batch-overlap --max-tokens 10 \
    --prompt "Experts, route this" \
    --prompt "A second prompt, longer, to fill a chunk of the prefill with more than a few tokens" \
    >"$out/$model-dbo.txt" 2>&1 || { cat "$out/$model-dbo.txt"; exit 1; }
  grep "output :" "$out/$model-dbo.txt" >"$out/$model-dbo.answers"
  # The decode rank in its own process (`baton node`), with its own expert process.
  "$baton" local --model "$model" --decode-processes 1 --expert-parallel 2 --max-tokens 10 \
    --prompt "Experts, route this" \
    --prompt "A second prompt, longer, to fill a chunk of the prefill with more than a few tokens" \
    >"$out/$model-node.txt" 2>&1 || { cat "$out/$model-node.txt"; exit 1; }
  grep "output :" "$out/$model-node.txt" >"$out/$model-node.answers"
  # Elastic instances (one executor, one expert group, both roles) beside fixed ranks.
  "$baton" local --model "$model" --prefill-ranks 1 --decode-ranks 1 --elastic-ranks 2 --elastic-prefill 1 \
    --expert-parallel 2 --max-tokens 10 --prompt "Experts, route this" \
    --prompt "A second prompt, longer, to fill a chunk of the prefill with more than a few tokens" \
    >"$out/$model-elastic.txt" 2>&1 || { cat "$out/$model-elastic.txt"; exit 1; }
  grep "output :" "$out/$model-elastic.txt" >"$out/$model-elastic.answers"
  # Data-parallel attention: the decode ranks form groups (2 of 2, then 1 of 4) that serve each
  # other's experts in lockstep; four prompts so that every decode rank has rows of its own.
  for dp in 2 4 4e 2d; do
    extra=()
    [ "$dp" = 4e ] && extra=(--eplb-slots 4 --eplb-interval 4)  # live EPLB inside the groups
    [ "$dp" = 2d ] && extra=(--dual-batch-overlap)              # two channels per member
    "$baton" local --model "$model" --decode-ranks 4 --expert-parallel "${dp%[ed]}" --dp-attention "${extra[@]}" --max-tokens 10 \
      --prompt "Experts, route this" \
      --prompt "A second prompt, longer, to fill a chunk of the prefill with more than a few tokens" \
      --prompt "Third" --prompt "The fourth prompt of this run" \
      >"$out/$model-dp$dp.txt" 2>&1 || { cat "$out/$model-dp$dp.txt"; exit 1; }
    grep -q "4 requests, 0 failed" "$out/$model-dp$dp.txt" || { cat "$out/$model-dp$dp.txt"; exit 1; }
  done
  "$baton" local --model "$model" --decode-ranks 4 --max-tokens 10 \
    --prompt "Experts, route this" \
    --prompt "A second prompt, longer, to fill a chunk of the prefill with more than a few tokens" \
    --prompt "Third" --prompt "The fourth prompt of this run" >"$out/$model-dp1.txt" 2>&1 || { cat "$out/$model-dp1.txt"; exit 1; }
  for f in dp1 dp2 dp4 dp4e dp2d; do grep "output :" "$out/$model-$f.txt" >"$out/$model-$f.answers"; done
  for dp in 2 4 4e 2d; do
    if ! cmp -s "$out/$model-dp1.answers" "$out/$model-dp$dp.answers"; then
      echo "$model: data-parallel attention in groups of $dp answered differently from EP 1:"
      diff "$out/$model-dp1.answers" "$out/$model-dp$dp.answers"; exit 1
    fi
  done
  for ep in 2 4 eplb dbo node elastic; do
    if ! cmp -s "$out/$model-1.answers" "$out/$model-$ep.answers"; then
      echo "$model: EP $ep answered differently from EP 1:"; diff "$out/$model-1.answers" "$out/$model-$ep.answers"; exit 1
    fi
  done
  echo "$model: EP 2, EP 4, EP 4 with live EPLB, EP 2 with dual-batch overlap, EP 2 in a decode process, EP 2 on elastic ranks and data-parallel attention in groups of 2 and 4 (4 with live EPLB, 2 with dual-batch overlap) answer as EP 1 ($(wc -l <"$out/$model-1.answers") answers)"
done
sleep 0.2
if pgrep -f "$baton experts" >/dev/null; then echo "expert processes outlived their engines"; exit 1; fi
# Refusals name the problem.
if "$baton" local --model random --expert-parallel 2 --max-tokens 2 >"$out/refused.txt" 2>&1; then exit 1; fi
grep -q "needs a model with routed experts" "$out/refused.txt" || { cat "$out/refused.txt"; exit 1; }
if "$baton" local --model deepseek-v3-tiny --expert-parallel 4 --eplb-slots 1 >"$out/refused.txt" 2>&1; then exit 1; fi
grep -q "EPLB: 4 ranks x 1 slots cannot hold 8 experts" "$out/refused.txt" || { cat "$out/refused.txt"; exit 1; }
if "$baton" local --model deepseek-v3-tiny --decode-ranks 3 --expert-parallel 2 --dp-attention >"$out/refused.txt" 2>&1; then exit 1; fi
grep -q "needs --decode-ranks a multiple of 2 (not 3)" "$out/refused.txt" || { cat "$out/refused.txt"; exit 1; }
echo "expert parallel e2e: all checks passed"
