# Sourced by the end-to-end scripts that run `baton local --serve`: a work directory, a cleanup
# that stops the server (SIGINT: its decode processes stop with it) and removes it, `fail`, and
# `start_local_serve ARGS...`, which starts the server with ARGS, waits (bounded) until it
# serves, and sets PID and HTTP (the gateway's port). Set NAME before sourcing.
WORK=$(mktemp -d "/tmp/baton-$NAME-XXXXXX")
PID=""
cleanup() {
  if [ -n "$PID" ]; then
    kill -INT "$PID" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$PID" 2>/dev/null || true
  fi
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "$NAME: FAILED: $*" >&2; cat "$WORK"/*.log >&2 2>/dev/null || true; exit 1; }
start_local_serve() {
  "$BATON" local --serve "$@" > "$WORK/local.log" 2>&1 &
  PID=$!
  for _ in $(seq 900); do grep -q "serving;" "$WORK/local.log" && break; kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
  grep -q "serving;" "$WORK/local.log" || fail "it did not start serving"
  HTTP=$(grep -o "gateway listening on http://127.0.0.1:[0-9]*" "$WORK/local.log" | grep -o "[0-9]*$")
  for _ in $(seq 300); do curl -sf -m 5 "http://127.0.0.1:$HTTP/health" > /dev/null && break; sleep 0.1; done
}
