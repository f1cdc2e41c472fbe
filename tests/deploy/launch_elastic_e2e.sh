#!/usr/bin/env bash
# Elastic P/D from a cluster spec: `baton launch` starts the head (with the elastic controller:
# --elastic-nodes), a decode node and an elastic node whose two ranks start one as prefill and one
# as decode. The node joins and the cluster answers as a single process. (That both ranks register
# with their balancers is checked, with the head in-process, in the doctest named below.)
# A load that moves them is tested in tests/deploy/cross_process.test.cpp ("elastic ranks in a
# node process"); here, the launch path.
# Usage: launch_elastic_e2e.sh BATON_BINARY. Bounded waits throughout; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-launch-elastic-e2e-XXXXXX)
LAUNCHER="" SINGLE=""
source "$(dirname "$0")/e2e_lib.sh"
trap cleanup_launched EXIT
fail() { echo "launch elastic e2e: FAILED: $*" >&2; echo "--- launcher output:" >&2; cat "$WORK/launch.log" >&2 || true; exit 1; }

read -r P_ROUTER P_CLUSTER < <(free_ports 2)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "elastic-e2e",
  "model": "random",
  "elastic": {"ttft_ms": 2000, "tbt_ms": 100},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "prefill_ranks": 1,
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]},
    {"name": "flex", "host": "127.0.0.1", "roles": ["elastic"], "gpus": 2, "prefill_at_start": 1}
  ]
}
SPEC
"$BATON" launch "$WORK/spec.json" --dry-run > "$WORK/dry.txt" || fail "dry run"
grep -q -- "--elastic-nodes" "$WORK/dry.txt" || fail "the head is not told to run the elastic controller"
grep -q -- "--role' 'elastic\|--role elastic" "$WORK/dry.txt" || fail "no elastic node in the plan: $(cat "$WORK/dry.txt")"
launch_cluster
grep -q "node flex joined" "$WORK/launch.log" || fail "the elastic node did not join"

PROMPTS=()
for i in 1 2 3 4 5 6 7 8; do PROMPTS+=("Elastic prompt number $i, with a few words"); done
same_as_single random elastic-e2e 8 "${PROMPTS[@]}"
echo "launch elastic e2e: the elastic node joined; 8 answers equal a single process's"
stop_launched
echo "launch elastic e2e: all checks passed"
