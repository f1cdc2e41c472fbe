#!/usr/bin/env bash
# `baton launch` killed with SIGKILL (no chance to stop its nodes): every node it started stops on
# its own (each baton process started by a launcher goes when its parent goes), so no orphan
# keeps the cluster's ports. Also: a node's spec "env" wins over the launcher's own environment.
# Usage: launcher_killed_e2e.sh BATON_BINARY SOURCE_DIR. Bounded waits; always cleans up.
set -euo pipefail
BATON=$1
SRC=$2
WORK=$(mktemp -d /tmp/baton-launcher-killed-XXXXXX)
LAUNCHER=""
source "$(dirname "$0")/e2e_lib.sh"
cleanup() {
  [ -n "$LAUNCHER" ] && kill -9 "$LAUNCHER" 2>/dev/null || true
  pkill -9 -f "$WORK" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "launcher killed e2e: FAILED: $*" >&2; cat "$WORK/launch.log" >&2 || true; exit 1; }
read -r P_ROUTER P_CLUSTER < <(free_ports 2)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "killed",
  "model": "$SRC/models/baton-kjv-tiny",
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "d1", "host": "127.0.0.1", "roles": ["decode"], "env": {"BATON_FAULT_JOB_DELAY_MS": "0"}}
  ]
}
SPEC
# The launcher's own environment says otherwise (and would make the node refuse to start): the
# spec's value must win.
BATON_FAULT_JOB_DELAY_MS=not-a-number "$BATON" launch "$WORK/spec.json" --wait-s 90 > "$WORK/launch.log" 2>&1 &
LAUNCHER=$!
for _ in $(seq 900); do grep -q "is up" "$WORK/launch.log" && break; kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
grep -q "is up" "$WORK/launch.log" || fail "the cluster did not come up (the spec's env lost to the launcher's?)"
CHILDREN=$(pgrep -P "$LAUNCHER" | tr '\n' ' ')
[ -n "$CHILDREN" ] || fail "the launcher has no child processes"
echo "launcher killed e2e: cluster up, the spec's env won; children: $CHILDREN"
kill -9 "$LAUNCHER"
wait "$LAUNCHER" 2>/dev/null || true
LAUNCHER=""
for _ in $(seq 300); do
  alive=""
  for p in $CHILDREN; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
  [ -z "$alive" ] && break
  sleep 0.1
done
[ -z "$alive" ] || fail "nodes still running 30 s after the launcher was killed:$alive"
echo "launcher killed e2e: every node stopped after the launcher's SIGKILL"
echo "launcher killed e2e: all checks passed"
