#!/usr/bin/env bash
# A data-parallel group of EP 3 across three node processes (one member each) loses one node for
# good: the other two re-form it without the lost member after --dp-shrink-after-s, its experts
# spread over the two, and answer as EP 1. When the lost node comes back, the two hear of it,
# the group grows back to three members, and it answers as EP 1 again.
# Usage: dp_shrink_e2e.sh BATON_BINARY. Bounded waits throughout; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-dp-shrink-e2e-XXXXXX)
LAUNCHER="" SINGLE=""
source "$(dirname "$0")/e2e_lib.sh"
HEAD_PID="" N0="" N1="" N2=""
# SIGTERM (a background job may still ignore SIGINT), then SIGKILL: these command lines do not name WORK.
trap 'for p in $N0 $N1 $N2 $HEAD_PID; do kill -TERM "$p" 2>/dev/null || true; done; sleep 1
      for p in $N0 $N1 $N2 $HEAD_PID; do kill -9 "$p" 2>/dev/null || true; done; cleanup_launched' EXIT
fail() {
  echo "dp shrink e2e: FAILED: $*" >&2
  for f in "$WORK"/*.log; do echo "--- $f" >&2; tail -25 "$f" >&2; done
  exit 1
}
count() { grep -c "$1" "$2" || true; }

read -r P_HEAD < <(free_ports 1)
"$BATON" local --serve --model deepseek-v3-tiny --prefill-ranks 1 --decode-ranks 0 --router-listen 127.0.0.1:0 \
  --cluster-listen "127.0.0.1:$P_HEAD" > "$WORK/head.log" 2>&1 &
HEAD_PID=$!
# "serving;" is printed last, once the node directory the nodes join listens too.
for _ in $(seq 300); do grep -q "serving;" "$WORK/head.log" && break; sleep 0.1; done
P_ROUTER=$(grep -o "router listening on 127.0.0.1:[0-9]*" "$WORK/head.log" | grep -o "[0-9]*$") || fail "the head did not start"
node_args=(node --role decode --connect "127.0.0.1:$P_HEAD" --model deepseek-v3-tiny --expert-parallel 3 --dp-attention
           --dp-shrink-after-s 2 --dp-meet-timeout-s 60)
"$BATON" "${node_args[@]}" --name n0 --dp-first-rank 0 > "$WORK/n0.log" 2>&1 &
N0=$!
"$BATON" "${node_args[@]}" --name n1 --dp-first-rank 1 > "$WORK/n1.log" 2>&1 &
N1=$!
"$BATON" "${node_args[@]}" --name n2 --dp-first-rank 2 > "$WORK/n2.log" 2>&1 &
N2=$!
for n in n0 n1 n2; do
  for _ in $(seq 600); do grep -q "joined the head" "$WORK/$n.log" && break; sleep 0.1; done
  grep -q "baton node $n: joined the head; 1 decode rank(s) serving" "$WORK/$n.log" || fail "$n did not join"
done
PROMPTS=("Experts, spread out" "A second prompt, so that more tokens pass the experts")
same_as_single deepseek-v3-tiny baton 12 "${PROMPTS[@]}"
echo "dp shrink e2e: one data-parallel group of EP 3 across three nodes answers as EP 1"

# n2 dies for good. n0 and n1 step aside, wait 2 s for it at the head, then meet without it as a
# group of two (dp0~N), each serving half of every MoE layer's experts.
kill -9 "$N2"; wait "$N2" 2>/dev/null || true
N2=""
for n in n0 n1; do
  for _ in $(seq 300); do grep -q "data-parallel group dp0 re-formed in place as 2 of 3 members" "$WORK/$n.log" && break; sleep 0.1; done
  grep -q "baton node $n: rank $n steps aside: data-parallel group dp0 lost member(s) 2 (node n2" "$WORK/$n.log" ||
    fail "$n did not step aside when n2 died"
  grep -q "baton node $n: data-parallel group dp0 met without member(s) 2 after 2 s: it shrinks to 2 of 3 members" "$WORK/$n.log" ||
    fail "$n did not say its group shrinks"
  grep -q "baton node $n: data-parallel group dp0 re-formed in place as 2 of 3 members (dp0~[0-9]*); its ranks here take work again" \
    "$WORK/$n.log" || fail "$n did not re-form dp0 as 2 of 3 members"
  grep -q "baton node $n: member ${n#n} of data-parallel group dp0 is member ${n#n} of dp0~[0-9]*, serving 4 of 8 routed experts" \
    "$WORK/$n.log" || fail "$n does not serve half of the experts in the shrunk group"
done
same_as_single deepseek-v3-tiny baton 12 "${PROMPTS[@]}"
echo "dp shrink e2e: n2 killed for good: n0 and n1 met without it after 2 s as a group of two and answer as EP 1"

# n2 comes back under its name: n0 and n1 hear that the member their group lacks came back, and
# the three meet at full size.
formed() { count "data-parallel group dp0 re-formed in place; its ranks here take work again" "$WORK/$1.log"; }
"$BATON" "${node_args[@]}" --name n2 --dp-first-rank 2 > "$WORK/n2-again.log" 2>&1 &
N2=$!
for n in n0 n1; do
  for _ in $(seq 600); do [ "$(formed $n)" -ge 1 ] && break; sleep 0.1; done
  grep -q "baton node $n: rank $n steps aside: data-parallel group dp0 re-forms (member 2 came back (node n2): the group meets again at full size)" \
    "$WORK/$n.log" || fail "$n was not told that n2 came back"
  [ "$(formed $n)" -ge 1 ] || fail "$n did not re-form dp0 at full size"
done
for _ in $(seq 300); do grep -q "joined the head" "$WORK/n2-again.log" && break; sleep 0.1; done
grep -q "baton node n2: joined the head" "$WORK/n2-again.log" || fail "n2, started again, did not join"
same_as_single deepseek-v3-tiny baton 12 "${PROMPTS[@]}"
echo "dp shrink e2e: n2 came back: the group grew back to three members and answers as EP 1"
# The head dies and is started again by hand on the same port: the three nodes keep their
# processes, wait for it and join it afresh; their group, broken when their ranks stopped, meets
# again at the new head, and answers as EP 1.
kill -9 "$HEAD_PID"; wait "$HEAD_PID" 2>/dev/null || true
"$BATON" local --serve --model deepseek-v3-tiny --prefill-ranks 1 --decode-ranks 0 --router-listen 127.0.0.1:0 \
  --cluster-listen "127.0.0.1:$P_HEAD" > "$WORK/head2.log" 2>&1 &
HEAD_PID=$!
for _ in $(seq 300); do grep -q "router listening" "$WORK/head2.log" && break; sleep 0.1; done
P_ROUTER=$(grep -o "router listening on 127.0.0.1:[0-9]*" "$WORK/head2.log" | grep -o "[0-9]*$") || fail "the head did not start again"
for n in n0 n1 n2-again; do
  for _ in $(seq 600); do [ "$(count "joined the head" "$WORK/$n.log")" -ge 2 ] && break; sleep 0.1; done
  grep -q "the head went away; its ranks stopped; waiting up to 60 s for a head at 127.0.0.1:$P_HEAD" "$WORK/$n.log" ||
    fail "$n did not wait for the head"
  [ "$(count "joined the head" "$WORK/$n.log")" -ge 2 ] || fail "$n did not join the new head"
done
for n in n0 n1; do
  for _ in $(seq 600); do [ "$(formed $n)" -ge 2 ] && break; sleep 0.1; done
  [ "$(formed $n)" -ge 2 ] || fail "$n did not re-form dp0 at the new head"
done
same_as_single deepseek-v3-tiny baton 12 "${PROMPTS[@]}"
echo "dp shrink e2e: the head killed and started again: the three nodes joined it, re-formed the group there and answer as EP 1"
for p in $N0 $N1 $N2; do kill -INT "$p"; done
for p in $N0 $N1 $N2; do wait_bounded "$p" || fail "a node exited with $? on an orderly stop (124: not within 30 s)"; done
N0="" N1="" N2=""
kill -INT "$HEAD_PID"; wait_bounded "$HEAD_PID" 2>/dev/null || true
HEAD_PID=""
echo "dp shrink e2e: all checks passed"
