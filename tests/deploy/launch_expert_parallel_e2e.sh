#!/usr/bin/env bash
# A cluster spec with expert parallelism, launched by `baton launch` on 127.0.0.1: the head's
# prefill rank with EP 2 and a decode node with EP 4 and dual-batch overlap, KV sent as
# rendezvous active messages (transport.send "am"). Its answers must equal a single process's
# at EP 1, the engines must have started their expert processes, and none may outlive the stop.
# Usage: launch_expert_parallel_e2e.sh BATON_BINARY. Bounded waits throughout; always cleans up.
set -euo pipefail
BATON=$1
WORK=$(mktemp -d /tmp/baton-launch-ep-e2e-XXXXXX)
LAUNCHER="" SINGLE=""
source "$(dirname "$0")/e2e_lib.sh"
HEAD_PID="" ODD_A="" FALL_A="" LOADERS=()
# A node left stopped (SIGSTOP) would hold its ports: it is continued before it is told to stop.
# SIGTERM (a background job may still ignore SIGINT), then SIGKILL: these command lines do not name WORK.
trap 'for p in $HEAD_PID $ODD_A $FALL_A; do kill -CONT "$p" 2>/dev/null || true; kill -TERM "$p" 2>/dev/null || true; done
      touch "$WORK/stop-loaders"; for p in "${LOADERS[@]}"; do kill "$p" 2>/dev/null || true; done
      for f in "$WORK"/loader-*.pid; do [ -e "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done; sleep 1
      for p in $HEAD_PID $ODD_A $FALL_A; do kill -9 "$p" 2>/dev/null || true; done; cleanup_launched' EXIT
fail() { echo "launch EP e2e: FAILED: $*" >&2; echo "--- launcher output:" >&2; cat "$WORK/launch.log" >&2 || true; exit 1; }
experts() { pgrep -f "$BATON experts" | wc -l; }
# Shards of an earlier test may still be on their way out (they follow their engine's death).
for _ in $(seq 100); do [ "$(experts)" = 0 ] && break; sleep 0.1; done
[ "$(experts)" = 0 ] || fail "expert processes of another run are still alive: $(pgrep -af "$BATON experts")"

read -r P_ROUTER P_CLUSTER < <(free_ports 2)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "ep-e2e",
  "model": "deepseek-v3-tiny",
  "transport": {"send": "am"},
  "expert_parallel": {"prefill": 2, "decode": 4, "dual_batch_overlap": true},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "prefill_ranks": 1,
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]}
  ]
}
SPEC
launch_cluster
grep -q "node decode-a joined" "$WORK/launch.log" || fail "decode-a did not join"
# The launcher reports a join when the head hears of it; the node builds its ranks (UCX, shard
# processes) after that, and says so last.
for _ in $(seq 600); do grep -q "baton node decode-a: joined the head" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "baton node decode-a: joined the head" "$WORK/launch.log" || fail "decode-a's ranks did not start"
# One expert process for the prefill rank (EP 2), three for the decode rank (EP 4). A shard may
# still be between fork and exec when the node reports its join (seen under load): wait, bounded.
for _ in $(seq 50); do [ "$(experts)" = 4 ] && break; sleep 0.1; done
[ "$(experts)" = 4 ] || fail "expected 4 expert processes, found $(experts): $(pgrep -af "$BATON experts")"

same_as_single deepseek-v3-tiny ep-e2e 12 "Experts, route this" "A second prompt, longer, so that more tokens pass the experts"
echo "launch EP e2e: prefill EP 2 and decode EP 4 with dual-batch overlap, KV as active messages: the same text as EP 1"
# A shard process killed with SIGKILL, one of the head's prefill rank and then one of decode-a's:
# each engine notices while idle, its rank steps aside, its process's keeper starts a new shard,
# and the cluster answers the same text again.
for who in prefill decode-a; do
  SHARD=$(pgrep -f "$BATON experts .*--name $who" | head -1 || true)
  [ -n "$SHARD" ] || fail "no expert process of $who among: $(pgrep -af "$BATON experts")"
  RANK=$(tr '\0' ' ' < "/proc/$SHARD/cmdline" | grep -o -- "--name [^ ]*" | cut -d' ' -f2)
  kill -9 "$SHARD"
  for _ in $(seq 300); do grep -q "rank $RANK has new expert shards" "$WORK/launch.log" && break; sleep 0.1; done
  grep -q "rank $RANK stepped aside (expert parallelism: expert shard [0-9] of [0-9]: its process ($RANK-ep[0-9], pid $SHARD) ended with signal 9)" \
    "$WORK/launch.log" || fail "$RANK did not say it stepped aside for its shard (pid $SHARD)"
  grep -q "rank $RANK has new expert shards" "$WORK/launch.log" || fail "$RANK got no new shard within 30 s"
  for _ in $(seq 50); do [ "$(experts)" = 4 ] && break; sleep 0.1; done
  [ "$(experts)" = 4 ] || fail "expected 4 expert processes after $RANK's new shard, found $(experts)"
  same_as_single deepseek-v3-tiny ep-e2e 12 "Experts, route this" "A second prompt, longer, so that more tokens pass the experts"
  echo "launch EP e2e: $RANK's shard (pid $SHARD) killed: a new one started, the same text as EP 1"
done
stop_launched
for _ in $(seq 50); do [ "$(experts)" = 0 ] && break; sleep 0.1; done
[ "$(experts)" = 0 ] || fail "$(experts) expert processes outlived the cluster"

# Data-parallel attention: the four decode ranks of two node processes form one group of EP 4
# (members 0 and 1 in decode-a, 2 and 3 in decode-b, meeting through the head), each running its
# own requests' attention and serving a quarter of the experts to all; no decode rank starts an
# expert process. Every step crosses the two processes. Live EPLB re-places the experts every 4
# MoE rounds (4 slots each for 8 experts), moving weights between the processes; dual-batch
# overlap gives every member two channels (two meetings at the head).
cat > "$WORK/spec.json" <<SPEC
{
  "name": "ep-e2e",
  "model": "deepseek-v3-tiny",
  "expert_parallel": {"prefill": 2, "decode": 4, "dp_attention": true, "eplb_slots": 4, "eplb_interval": 4,
                      "dual_batch_overlap": true},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "prefill_ranks": 1,
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"], "gpus": 2},
    {"name": "decode-b", "host": "127.0.0.1", "roles": ["decode"], "gpus": 2},
    {"name": "decode-s", "host": "127.0.0.1", "roles": ["decode"], "gpus": 2, "spare": true}
  ]
}
SPEC
launch_cluster --restart-failed 2
# The spare starts with the others but only stands by: model loaded, not joined, no members.
for _ in $(seq 300); do grep -q "baton node decode-s: standing by with the model loaded" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "baton launch: spare decode-s standing by (pid" "$WORK/launch.log" || fail "the launcher did not start the spare standing by"
grep -q "baton node decode-s: standing by with the model loaded" "$WORK/launch.log" || fail "the spare did not stand by: $(grep decode-s "$WORK/launch.log")"
grep -q -E "node decode-s joined|decode-s-[01] is member" "$WORK/launch.log" && fail "the spare joined while standing by: $(grep decode-s "$WORK/launch.log")"
for n in decode-a decode-b; do grep -q "node $n joined" "$WORK/launch.log" || fail "$n did not join (data-parallel attention)"; done
grep -q "rank decode-a-1 is member 1 of data-parallel group dp0, serving 2 of 8" "$WORK/launch.log" || fail "decode-a-1 is not member 1 of dp0"
grep -q "rank decode-b-0 is member 2 of data-parallel group dp0, serving 2 of 8" "$WORK/launch.log" || fail "decode-b-0 is not member 2 of dp0"
[ "$(experts)" = 1 ] || fail "expected only the prefill rank's expert process, found $(experts)"
same_as_single deepseek-v3-tiny ep-e2e 12 "Experts, route this" "A second prompt, longer, so that more tokens pass the experts" \
  "A third one for the other decode rank" "And a fourth, so both members have rows of their own"
echo "launch EP e2e: four decode ranks in two processes as one data-parallel group of EP 4 with live EPLB and dual-batch overlap: the same text as EP 1"
# decode-a's process dies without a word: it leaves no abort word, so decode-b's members would
# only notice at the all-to-all's timeout in a step, and never while idle. The head's directory
# sees the node go and tells decode-b, whose ranks step aside at once.
kill -9 "$(pgrep -f "$BATON node .*--name decode-a --connect 127.0.0.1:$P_CLUSTER " | head -1)" || fail "no decode-a process to kill"
for _ in $(seq 100); do grep -q "rank decode-b-1 steps aside" "$WORK/launch.log" && break; sleep 0.1; done
for r in decode-b-0 decode-b-1; do
  grep -q "baton node decode-b: rank $r steps aside: data-parallel group dp0 lost member(s) 0 1 (node decode-a, which hosted 2 of its 4 members, went down" \
    "$WORK/launch.log" || fail "$r did not step aside when decode-a died: $(grep 'steps aside' "$WORK/launch.log")"
done
echo "launch EP e2e: a data-parallel member's process killed: the other node's ranks step aside at once, naming it"
# decode-b stays up: its members meet afresh at the head while the launcher restarts decode-a,
# whose new process posts to the same meeting; decode-b's executors then rejoin the re-formed
# group between jobs and its ranks take work again, and the group answers as before.
for _ in $(seq 100); do grep -q "baton node decode-b: data-parallel group dp0 re-forms in place" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "baton node decode-b: data-parallel group dp0 re-forms in place" "$WORK/launch.log" ||
  fail "decode-b did not start re-forming dp0: $(grep 'decode-b' "$WORK/launch.log" | tail -5)"
joined_twice() { [ "$(grep -c "node $1 joined" "$WORK/launch.log")" -ge 2 ]; }
for _ in $(seq 600); do grep -q "baton node decode-b: data-parallel group dp0 re-formed in place" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "baton node decode-b: data-parallel group dp0 re-formed in place; its ranks here take work again" "$WORK/launch.log" ||
  fail "decode-b did not re-form dp0 in place: $(grep 'decode-b' "$WORK/launch.log" | tail -5)"
grep -q "node decode-a restarted (1 of 2" "$WORK/launch.log" || fail "the launcher did not restart decode-a"
for _ in $(seq 300); do joined_twice decode-a && break; sleep 0.1; done  # it joins the head after its meeting
joined_twice decode-a || fail "decode-a did not join again: $(grep "decode-a" "$WORK/launch.log" | tail -5)"
joined_twice decode-b && fail "decode-b joined twice: it should have stayed up"
grep -q "node decode-b left\|decode-b restarted" "$WORK/launch.log" && fail "decode-b left: $(grep 'decode-b' "$WORK/launch.log" | tail -5)"
same_as_single deepseek-v3-tiny ep-e2e 12 "Experts, route this" "A second prompt, longer, so that more tokens pass the experts" \
  "A third one for the other decode rank" "And a fourth, so both members have rows of their own"
echo "launch EP e2e: the group re-formed in place around the restarted decode-a, decode-b never left, and it answers as EP 1 again"
# Once more: a re-formed group loses the same node again and re-forms again.
kill -9 "$(pgrep -f "$BATON node .*--name decode-a --connect 127.0.0.1:$P_CLUSTER " | head -1)" || fail "no decode-a process to kill (second time)"
reformed() { grep -c "baton node decode-b: data-parallel group dp0 re-formed in place" "$WORK/launch.log" || true; }
for _ in $(seq 600); do [ "$(reformed)" -ge 2 ] && break; sleep 0.1; done
[ "$(reformed)" -ge 2 ] || fail "decode-b did not re-form dp0 a second time: $(grep 'decode-b' "$WORK/launch.log" | tail -5)"
grep -q "node decode-a restarted (2 of 2" "$WORK/launch.log" || fail "the launcher did not restart decode-a a second time"
for _ in $(seq 300); do [ "$(grep -c "node decode-a joined" "$WORK/launch.log")" -ge 3 ] && break; sleep 0.1; done
[ "$(grep -c "node decode-a joined" "$WORK/launch.log")" -ge 3 ] || fail "decode-a did not join a third time"
same_as_single deepseek-v3-tiny ep-e2e 12 "Experts, route this" "A third one for the other decode rank"
echo "launch EP e2e: killed again, the group re-formed in place a second time and answers as EP 1"
# A third death: decode-a's restarts are used up, so the spec's spare, decode-s, standing by
# since the launch with the model loaded, is told decode-a's flags and takes its place. It takes
# decode-a's members (0 and 1 of dp0), and decode-b re-forms the group with it in place.
kill -9 "$(pgrep -f "$BATON node .*--name decode-a --connect 127.0.0.1:$P_CLUSTER " | head -1)" || fail "no decode-a process to kill (third time)"
for _ in $(seq 600); do [ "$(reformed)" -ge 3 ] && break; sleep 0.1; done
[ "$(reformed)" -ge 3 ] || fail "decode-b did not re-form dp0 with the spare: $(grep 'decode-[bs]' "$WORK/launch.log" | tail -8)"
grep -q "baton launch: node decode-a failed for good; spare decode-s, standing by, takes its place" "$WORK/launch.log" ||
  fail "the launcher did not call on the spare: $(grep 'decode-[as]' "$WORK/launch.log" | tail -5)"
grep -q "baton node decode-s: stands in (--dp-first-rank 0)" "$WORK/launch.log" ||
  fail "the spare was not told decode-a's flags: $(grep 'decode-s' "$WORK/launch.log")"
# decode-s says which members it took before it joins; decode-b's re-form above may print first.
for _ in $(seq 300); do grep -q "baton launch: node decode-s joined (pid" "$WORK/launch.log" && break; sleep 0.1; done
grep -q "baton launch: node decode-s joined (pid" "$WORK/launch.log" || fail "the spare did not join: $(grep 'decode-s' "$WORK/launch.log")"
grep -q "rank decode-s-1 is member 1 of data-parallel group dp0" "$WORK/launch.log" ||
  fail "the spare did not take decode-a's members: $(grep 'decode-s' "$WORK/launch.log")"
same_as_single deepseek-v3-tiny ep-e2e 12 "Experts, route this" "A spare's turn to serve"
echo "launch EP e2e: decode-a's restarts used up, the spare decode-s, standing by with the model loaded, took its members; the group re-formed in place and answers as EP 1"
stop_launched
# Live EPLB ran in the group across the two processes: decode-b's members received expert weights.
grep -E "rank decode-b-[01]: [1-9][0-9]* EPLB plans, [1-9][0-9]* bytes of expert weights received" "$WORK/launch.log" ||
  fail "no EPLB plan moved weights into decode-b: $(grep 'EPLB plans' "$WORK/launch.log")"
for _ in $(seq 50); do [ "$(experts)" = 0 ] && break; sleep 0.1; done
[ "$(experts)" = 0 ] || fail "$(experts) expert processes outlived the cluster"

# Members started unalike (here: live EPLB on one node only) would run different rounds: both
# nodes refuse at the head's meeting, naming the difference, instead of breaking later.
read -r P_HEAD < <(free_ports 1)
"$BATON" local --serve --model deepseek-v3-tiny --prefill-ranks 1 --decode-ranks 0 --router-listen 127.0.0.1:0 \
  --cluster-listen "127.0.0.1:$P_HEAD" > "$WORK/head.log" 2>&1 &
HEAD_PID=$!
for _ in $(seq 300); do grep -q "cluster listening" "$WORK/head.log" && break; kill -0 "$HEAD_PID" 2>/dev/null || break; sleep 0.1; done
grep -q "cluster listening" "$WORK/head.log" || fail "the directory's head did not start: $(cat "$WORK/head.log")"
node_args=(node --role decode --connect "127.0.0.1:$P_HEAD" --model deepseek-v3-tiny --expert-parallel 2 --dp-attention)
# The fall-* nodes below serve the same model from a directory (`baton export-model`): each loads
# only its member's block of routed experts, and their answers must still equal one process's.
"$BATON" export-model --model deepseek-v3-tiny --out "$WORK/ds3" > /dev/null || fail "export-model failed"
dir_args=(node --role decode --connect "127.0.0.1:$P_HEAD" --model "$WORK/ds3" --expert-parallel 2 --dp-attention)
timeout 60 "$BATON" "${node_args[@]}" --name odd-a --dp-first-rank 0 > "$WORK/odd-a.log" 2>&1 &
ODD_A=$!
timeout 60 "$BATON" "${node_args[@]}" --name odd-b --dp-first-rank 1 --eplb-slots 4 > "$WORK/odd-b.log" 2>&1 && fail "odd-b started"
wait "$ODD_A" && fail "odd-a started"
# A node whose partner never comes: Ctrl-C ends its wait at once, and its own timeout ends it
# with a sentence (before, it sat out 120 s and ignored Ctrl-C).
"$BATON" "${node_args[@]}" --name alone-a --dp-first-rank 2 --dp-meet-timeout-s 60 > "$WORK/alone-a.log" 2>&1 &
ODD_A=$!
for _ in $(seq 300); do grep -q "waiting at the head for the other members of data-parallel group dp1" "$WORK/alone-a.log" && break; sleep 0.1; done
kill -INT "$ODD_A"
for _ in $(seq 50); do kill -0 "$ODD_A" 2>/dev/null || break; sleep 0.1; done
kill -0 "$ODD_A" 2>/dev/null && fail "alone-a did not stop within 5 s of Ctrl-C while meeting"
wait "$ODD_A" || fail "alone-a exited with $? after Ctrl-C (an orderly stop is not a failure)"
ODD_A=""
grep -q "group dp1: stopped while waiting for its other members at the head" "$WORK/alone-a.log" ||
  fail "alone-a did not say why it stopped: $(cat "$WORK/alone-a.log")"
# Started again under its name, its new post replaces the one its stopped process left at the
# head (not "member 0 posted twice"); alone, it runs into its own meeting timeout.
timeout 30 "$BATON" "${node_args[@]}" --name alone-a --dp-first-rank 2 --dp-meet-timeout-s 1 > "$WORK/alone-a2.log" 2>&1 &&
  fail "alone-a started without its partner"
grep -q "group dp1: meeting its members at the head: .*timeout" "$WORK/alone-a2.log" ||
  fail "alone-a, started again, did not name the timeout: $(cat "$WORK/alone-a2.log")"
echo "launch EP e2e: a node waiting for its group stops on Ctrl-C at once; started again, its post replaces the old one and its meeting timeout is named"
# A node stopped on purpose (SIGTERM: it drains and leaves) and started again by hand: its
# partner stays up and re-forms the group in place. Then a group whose lost node does not come
# back within the meeting timeout: the survivor says so and leaves with exit code 3, for a
# restarter to bring back.
"$BATON" "${dir_args[@]}" --name fall-a --dp-first-rank 4 --dp-meet-timeout-s 20 --dp-step-timeout-ms 400 \
  > "$WORK/fall-a.log" 2>&1 &
FALL_A=$!
# fall-b's short timeout bounds its waits for fall-a to come back; fall-a waits first, so the
# first meeting completes as soon as fall-b posts.
for _ in $(seq 300); do grep -q "waiting at the head" "$WORK/fall-a.log" && break; sleep 0.1; done
"$BATON" "${dir_args[@]}" --name fall-b --dp-first-rank 5 --dp-meet-timeout-s 30 --dp-step-timeout-ms 400 \
  > "$WORK/fall-b.log" 2>&1 &
ODD_A=$!
for _ in $(seq 300); do grep -q "joined the head" "$WORK/fall-a.log" && grep -q "joined the head" "$WORK/fall-b.log" && break; sleep 0.1; done
grep -q "baton node fall-a: joined the head; 1 decode rank(s) serving" "$WORK/fall-a.log" || fail "fall-a did not join: $(cat "$WORK/fall-a.log")"
grep -q "baton node fall-b: joined the head; 1 decode rank(s) serving" "$WORK/fall-b.log" || fail "fall-b did not join: $(cat "$WORK/fall-b.log")"
for n in fall-a fall-b; do
  grep -q "baton node $n: loaded 4 of 8 routed experts per layer from $WORK/ds3" "$WORK/$n.log" ||
    fail "$n did not load only its block of experts: $(cat "$WORK/$n.log")"
done
PR=$(grep -o "router listening on 127.0.0.1:[0-9]*" "$WORK/head.log" | grep -o "[0-9]*$") || fail "no router port in head.log"
P_ROUTER=$PR same_as_single deepseek-v3-tiny baton 12 "Experts read from files" "Each node read only its block"
echo "launch EP e2e: data-parallel nodes that loaded only their own experts from a model directory answer as one process"
count() { grep -c "$1" "$2" || true; }
# Each phase waits for one more of its lines than were there before it (a spurious re-form in an
# earlier phase must not pass a later one).
reforms() { count "baton node $1: data-parallel group dp2 re-forms in place" "$WORK/$1.log"; }
reformed() { count "baton node $1: data-parallel group dp2 re-formed in place; its ranks here take work again" "$WORK/$1.log"; }
# A member stalled mid-step (SIGSTOP for 0.7 s: past the 400 ms step timeout, short of the head's
# 2 s heartbeat timeout even with a heartbeat 500 ms old, so no node is seen to go): the group
# breaks with no node lost, both nodes re-form it in place without a restart, and it serves
# again. Four loaders keep both members' ranks stepping (each runs long requests one after
# another, so the group still steps however fast the requests end), and the stall comes only
# once text was seen to grow a moment before it: a stall while nothing steps breaks nothing (an
# idle group waits for no one), so it is tried again (at most 3 times), not failed.
# Each loader's running request's pid is kept (loader-N.pid, overwritten), so that a stop kills
# these and no other run's, nor a pid that ended and may be another's by then.
rm -f "$WORK/stop-loaders" "$WORK"/loader-*.pid
touch "$WORK"/stall{1,2,3,4}.txt
loader() {
  for _ in $(seq 20); do
    [ -e "$WORK/stop-loaders" ] && return 0
    timeout 60 "$BATON" generate --router "127.0.0.1:$PR" --max-tokens 1500 --ignore-eos "Keep stepping $1" \
      >> "$WORK/stall$1.txt" 2>/dev/null &
    echo $! > "$WORK/loader-$1.pid"
    wait $! || true
  done
}
LOADERS=()
for i in 1 2 3 4; do loader $i & LOADERS+=($!); done
# Killed until every loader is gone: one that looked for the stop file just before it was made
# starts one more request, killed on the next pass.
stop_loaders() {
  touch "$WORK/stop-loaders"
  for _ in $(seq 100); do
    for f in "$WORK"/loader-*.pid; do [ -e "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done
    local alive=0
    for p in "${LOADERS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  wait "${LOADERS[@]}" 2>/dev/null || true
  LOADERS=()
}
text_size() { cat "$WORK"/stall*.txt | wc -c; }
# Re-forms counted from here, so that one from before cannot stand for the stall's. The stall
# (0.7 s) is well past the 400 ms step timeout and well inside the head's 2 s heartbeat limit,
# also when the last heartbeat is already 0.5 s old and the machine is loaded.
before_a=$(reformed fall-a) before_b=$(reformed fall-b) before_forms_b=$(reforms fall-b) stalls=0
while :; do
  stalls=$((stalls + 1))
  [ "$stalls" -le 3 ] || fail "no stall came while the group was stepping (3 tries; its text did not grow)"
  grown=0
  for _ in $(seq 200); do
    s0=$(text_size); sleep 0.1
    [ "$(text_size)" -gt "$s0" ] && { grown=1; break; }
  done
  [ "$grown" = 1 ] || fail "the loaders' text did not grow within 20 s: the group does not step"
  kill -STOP "$FALL_A"; sleep 0.7; kill -CONT "$FALL_A"
  for _ in $(seq 50); do [ "$(reforms fall-b)" -gt "$before_forms_b" ] && break; sleep 0.1; done
  [ "$(reforms fall-b)" -gt "$before_forms_b" ] && break
  echo "launch EP e2e: stall $stalls broke nothing (the group was between steps); again"
done
for n in fall-a fall-b; do
  [ $n = fall-a ] && before=$before_a || before=$before_b
  for _ in $(seq 300); do [ "$(reformed $n)" -gt "$before" ] && break; sleep 0.1; done
  [ "$(reformed $n)" -gt "$before" ] || fail "$n did not re-form in place after the stall: $(cat "$WORK/$n.log")"
done
stop_loaders  # their requests failed over, or waited to be placed again
kill -0 "$FALL_A" 2>/dev/null && kill -0 "$ODD_A" 2>/dev/null || fail "a node left after the stall"
grep -q "baton node fall-b: data-parallel group dp2 re-forms in place (data-parallel group" "$WORK/fall-b.log" ||
  fail "fall-b's group did not break on the stalled step: $(cat "$WORK/fall-b.log")"
timeout 60 "$BATON" generate --router "127.0.0.1:$PR" --max-tokens 8 "After the stall" > "$WORK/after-stall.txt" ||
  fail "the re-formed group does not serve: $(cat "$WORK/after-stall.txt")"
echo "launch EP e2e: a member stalled mid-step broke its group with no node lost; both nodes re-formed it in place and it serves"
base_forms=$(reforms fall-b) base_formed=$(reformed fall-b)
kill -TERM "$FALL_A"
rc=0; wait "$FALL_A" || rc=$?
[ "$rc" = 0 ] || fail "fall-a, stopped on purpose, exited with $rc: $(cat "$WORK/fall-a.log")"
for _ in $(seq 100); do [ "$(reforms fall-b)" -gt "$base_forms" ] && break; sleep 0.1; done
[ "$(reforms fall-b)" -gt "$base_forms" ] ||
  fail "fall-b did not start re-forming when fall-a stopped: $(cat "$WORK/fall-b.log")"
"$BATON" "${dir_args[@]}" --name fall-a --dp-first-rank 4 --dp-meet-timeout-s 20 > "$WORK/fall-a2.log" 2>&1 &
FALL_A=$!
for _ in $(seq 600); do [ "$(reformed fall-b)" -gt "$base_formed" ] && break; sleep 0.1; done
[ "$(reformed fall-b)" -gt "$base_formed" ] ||
  fail "fall-b did not re-form in place with fall-a started again: $(cat "$WORK/fall-b.log")"
kill -0 "$ODD_A" 2>/dev/null || fail "fall-b left instead of re-forming in place"
echo "launch EP e2e: a node stopped on purpose and started again by hand: its partner re-formed the group in place"
for _ in $(seq 300); do grep -q "joined the head" "$WORK/fall-a2.log" && break; sleep 0.1; done
grep -q "joined the head" "$WORK/fall-a2.log" || fail "fall-a, started again, did not join: $(cat "$WORK/fall-a2.log")"
# A spare node under another name, started with the lost member's --dp-first-rank, takes its
# place: the head's meeting holds member slots, not node names.
base_formed=$(reformed fall-b)
kill -9 "$FALL_A"
"$BATON" "${dir_args[@]}" --name spare-a --dp-first-rank 4 --dp-meet-timeout-s 20 > "$WORK/spare-a.log" 2>&1 &
FALL_A=$!
for _ in $(seq 600); do [ "$(reformed fall-b)" -gt "$base_formed" ] && break; sleep 0.1; done
[ "$(reformed fall-b)" -gt "$base_formed" ] ||
  fail "fall-b did not re-form in place with the spare: $(cat "$WORK/fall-b.log") $(cat "$WORK/spare-a.log")"
for _ in $(seq 300); do grep -q "joined the head" "$WORK/spare-a.log" && break; sleep 0.1; done
grep -q "baton node spare-a: rank spare-a is member 0 of data-parallel group dp2" "$WORK/spare-a.log" ||
  fail "the spare did not take member 0 of dp2: $(cat "$WORK/spare-a.log")"
timeout 60 "$BATON" generate --router "127.0.0.1:$PR" --max-tokens 8 "After the spare" > "$WORK/after-spare.txt" ||
  fail "the group with the spare does not serve: $(cat "$WORK/after-spare.txt")"
echo "launch EP e2e: a node killed and replaced by a spare under another name: the survivor re-formed the group with it in place"
kill -9 "$FALL_A"
FALL_A=""
for _ in $(seq 600); do kill -0 "$ODD_A" 2>/dev/null || break; sleep 0.1; done  # its 30 s meeting timeout
kill -0 "$ODD_A" 2>/dev/null && fail "fall-b did not leave after its group failed to re-form"
rc=0; wait "$ODD_A" || rc=$?
ODD_A=""
[ "$rc" = 3 ] || fail "fall-b exited with $rc, not 3: $(cat "$WORK/fall-b.log")"
grep -q "baton node fall-b: data-parallel group dp2 could not re-form in place (group dp2: meeting its members at the head: .*timeout.*); leaving" \
  "$WORK/fall-b.log" || fail "fall-b did not say why it left: $(cat "$WORK/fall-b.log")"
echo "launch EP e2e: a group whose lost node does not come back within the meeting timeout: the survivor leaves with exit code 3, saying why"
# A spare standing by that is told flags it cannot take says which and leaves with exit code 2;
# one whose launcher goes away (its stdin closes) leaves with 0, saying so. Neither joins.
echo "--ranks 3" | timeout 60 "$BATON" "${dir_args[@]}" --name bad-spare --standby > "$WORK/bad-spare.log" 2>&1 && fail "a spare took '--ranks 3'"
grep -q "baton node bad-spare: standing by: cannot take '--ranks 3' (only \`--dp-first-rank N\`, or an empty line)" "$WORK/bad-spare.log" ||
  fail "the spare did not name what it could not take: $(cat "$WORK/bad-spare.log")"
timeout 60 "$BATON" "${dir_args[@]}" --name idle-spare --standby < /dev/null > "$WORK/idle-spare.log" 2>&1 ||
  fail "a spare whose stdin closed did not leave with 0: $(cat "$WORK/idle-spare.log")"
grep -q "baton node idle-spare: stood by; its launcher left (stdin closed)" "$WORK/idle-spare.log" ||
  fail "the idle spare did not say why it left: $(cat "$WORK/idle-spare.log")"
grep -q "joined the head" "$WORK/bad-spare.log" "$WORK/idle-spare.log" && fail "a spare joined while standing by"
echo "launch EP e2e: a spare told flags it cannot take names them and leaves (2); one whose launcher left leaves (0)"
kill -INT "$HEAD_PID"; wait_bounded "$HEAD_PID" 2>/dev/null || true
HEAD_PID="" ODD_A=""
grep -q "group dp0: member 0 runs with slot_bytes=[0-9]* dual_batch=0 eplb=0/64, this node with .* eplb=4/64 (every member must be started alike)" \
  "$WORK/odd-b.log" || fail "odd-b did not name the difference: $(cat "$WORK/odd-b.log")"
grep -q "group dp0: member 1 runs with .* eplb=4/64" "$WORK/odd-a.log" || fail "odd-a did not name the difference: $(cat "$WORK/odd-a.log")"
echo "launch EP e2e: members started unalike are refused at the meeting, naming the difference"
echo "launch EP e2e: all checks passed"
