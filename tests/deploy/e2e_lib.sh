# Shared by the multi-process end-to-end scripts in tests/deploy/ (sourced, not run).
# Expects WORK (a temporary folder of the script's own) and LAUNCHER (a pid, or empty).

# free_ports N: N free TCP ports on 127.0.0.1, space-separated. Drawn below the kernel's
# ephemeral range (ip_local_port_range): a port the kernel handed out for binding to 0 is also
# one it may hand to any outgoing connection (CAF, UCX's TCP wireup, curl) before our node binds it.
free_ports() {
  python3 -c '
import random, socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
socks = []
for _ in range(10000):
    if len(socks) == int(sys.argv[1]): break
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", random.randrange(10000, max(low, 10001))))
        socks.append(s)
    except OSError:
        s.close()
print(*[s.getsockname()[1] for s in socks])' "$1"
}

# wait_bounded PID [SECONDS]: waits up to SECONDS (30) for our child PID to exit and returns its
# exit status; one still running then is killed (SIGKILL) and 124 returned, so no test hangs on it.
wait_bounded() {
  local pid=$1 secs=${2:-30}
  for _ in $(seq $((secs * 10))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null
    return 124
  fi
  wait "$pid"
}

# stop_launcher: SIGINT to the launcher, up to 30 s for it to stop its nodes, then SIGKILL for
# anything of ours still running (every command line of ours names WORK), and WORK removed.
stop_launcher() {
  if [ -n "${LAUNCHER:-}" ] && kill -INT "$LAUNCHER" 2>/dev/null; then
    for _ in $(seq 300); do kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
    # Its nodes first: a command line of a built-in model's node does not name WORK.
    pkill -9 -P "$LAUNCHER" 2>/dev/null || true
    kill -9 "$LAUNCHER" 2>/dev/null || true  # gone already: set -e would end the trap before WORK is removed
  fi
  pkill -9 -f "$WORK" 2>/dev/null || true
  rm -rf "$WORK"
}

# launch_cluster [FLAG...]: starts `baton launch WORK/spec.json [FLAG...]` in the background
# (LAUNCHER is its pid, its output WORK/launch.log) and waits (bounded: 90 s) until it reports
# the cluster up; calls the script's `fail` otherwise. Needs BATON.
launch_cluster() {
  # A background job truncates its log only once its shell has forked: removed first, a log of an
  # earlier launch cannot answer the wait below (seen under load as a stale "is up").
  rm -f "$WORK/launch.log"
  "$BATON" launch "$WORK/spec.json" --wait-s 90 "$@" > "$WORK/launch.log" 2>&1 &
  LAUNCHER=$!
  for _ in $(seq 900); do grep -q "is up" "$WORK/launch.log" && break; kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
  grep -q "is up" "$WORK/launch.log" || fail "the cluster did not come up"
}

# same_as_single MODEL CLUSTER_ID MAX_TOKENS PROMPT...: starts a single-process cluster of MODEL
# (`baton local --serve`, its pid in SINGLE), asks it and the launched cluster (router port
# P_ROUTER) the same prompts and calls `fail` unless the texts are equal and not empty; the
# single process is stopped again. Needs BATON, WORK and P_ROUTER.
same_as_single() {
  local model=$1 id=$2 max=$3 args=() p
  shift 3
  for p in "$@"; do args+=(--prompt "$p"); done
  rm -f "$WORK/single.log"  # else the last call's log may answer the wait (see launch_cluster)
  "$BATON" local --serve --model "$model" --router-listen 127.0.0.1:0 > "$WORK/single.log" 2>&1 &
  SINGLE=$!
  for _ in $(seq 600); do grep -q "router listening" "$WORK/single.log" && break; sleep 0.1; done
  local port
  port=$(grep -o "router listening on 127.0.0.1:[0-9]*" "$WORK/single.log" | grep -o "[0-9]*$") || fail "the single process did not start: $(cat "$WORK/single.log")"
  # Bounded, and what a failed generate printed is shown (a request that failed leaves an empty
  # line on stdout and says why on stderr).
  timeout 120 "$BATON" generate --router "127.0.0.1:$port" "${args[@]}" --max-tokens "$max" > "$WORK/single.txt" \
    2> "$WORK/single.err" || fail "generate (single): $(cat "$WORK/single.err")"
  timeout 120 "$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id "$id" "${args[@]}" --max-tokens "$max" \
    > "$WORK/cluster.txt" 2> "$WORK/cluster.err" || fail "generate (cluster): $(cat "$WORK/cluster.err")"
  [ -s "$WORK/cluster.txt" ] || fail "the cluster answered nothing"
  cmp -s "$WORK/single.txt" "$WORK/cluster.txt" ||
    fail "the cluster answered differently: $(diff "$WORK/single.txt" "$WORK/cluster.txt"); its stderr: $(cat "$WORK/cluster.err")"
  kill -TERM "$SINGLE"  # not SIGINT: a non-interactive shell starts background jobs ignoring it
  wait "$SINGLE" 2>/dev/null || true
  SINGLE=""
}

# stop_launched: SIGINT to the launcher; `fail` unless it (and so its nodes) stops within 60 s.
stop_launched() {
  kill -INT "$LAUNCHER"
  for _ in $(seq 600); do kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
  ! kill -0 "$LAUNCHER" 2>/dev/null || fail "the launcher did not stop within 60 s"
  LAUNCHER=""
}

# cleanup_launched: for `trap ... EXIT`: stops a single process left by same_as_single, then the
# launcher and everything of WORK (stop_launcher).
cleanup_launched() {
  if [ -n "${SINGLE:-}" ]; then
    # SIGTERM (background jobs ignore SIGINT until baton installs its handlers), then SIGKILL.
    kill -TERM "$SINGLE" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$SINGLE" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SINGLE" 2>/dev/null || true
  fi
  stop_launcher
}
