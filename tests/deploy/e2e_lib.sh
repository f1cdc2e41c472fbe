# Shared by the multi-process end-to-end scripts in tests/deploy/ (sourced, not run).
# Expects WORK (a temporary folder of the script's own) and LAUNCHER (a pid, or empty).

# free_ports N: N free TCP ports on 127.0.0.1, space-separated.
free_ports() {
  python3 -c '
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])' "$1"
}

# stop_launcher: SIGINT to the launcher, up to 30 s for it to stop its nodes, then SIGKILL for
# anything of ours still running (every command line of ours names WORK), and WORK removed.
stop_launcher() {
  if [ -n "${LAUNCHER:-}" ] && kill -INT "$LAUNCHER" 2>/dev/null; then
    for _ in $(seq 300); do kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$LAUNCHER" 2>/dev/null
  fi
  pkill -9 -f "$WORK" 2>/dev/null || true
  rm -rf "$WORK"
}

# launch_cluster: starts `baton launch WORK/spec.json` in the background (LAUNCHER is its pid,
# its output WORK/launch.log) and waits (bounded: 90 s) until it reports the cluster up; calls
# the script's `fail` otherwise. Needs BATON.
launch_cluster() {
  "$BATON" launch "$WORK/spec.json" --wait-s 90 > "$WORK/launch.log" 2>&1 &
  LAUNCHER=$!
  for _ in $(seq 900); do grep -q "is up" "$WORK/launch.log" && break; kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
  grep -q "is up" "$WORK/launch.log" || fail "the cluster did not come up"
}
