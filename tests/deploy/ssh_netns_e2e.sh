#!/usr/bin/env bash
# The ssh path of `baton launch`: two stand-in hosts in network namespaces this test creates
# (10.77.N.1 and 10.77.N.2, joined by a veth pair), each running its own sshd (Debian's,
# extracted from its package into the build folder -- never installed, so no system service is
# enabled), and a spec across them: the head and the gateway on one, a decode node on the other,
# every node started over ssh, KV over UCX on the veth link (the spec's per-node env). A request through the gateway and one through the C++ client get
# the same text; SIGINT on the launcher ends every remote process. Skips with a message where
# namespaces or sshd cannot be had; always removes what it made.
# Usage: ssh_netns_e2e.sh BATON_BINARY SOURCE_DIR BUILD_DIR
set -uo pipefail
BATON=$1 SRC=$2 BUILD=$3
skip() { echo "ssh netns e2e: SKIPPED: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "creating network namespaces needs root"
for c in ip ssh ssh-keygen curl; do command -v "$c" > /dev/null || skip "no $c"; done

SSHD=/usr/sbin/sshd LIBS=""
if [ ! -x "$SSHD" ]; then
  CACHE="$BUILD/test-sshd"
  if [ ! -x "$CACHE/root/usr/sbin/sshd" ]; then
    mkdir -p "$CACHE" && (cd "$CACHE" && apt-get download openssh-server libwrap0 > /dev/null 2>&1 &&
      for d in ./*.deb; do dpkg -x "$d" root; done) || skip "no sshd and cannot download Debian's openssh-server"
  fi
  SSHD="$CACHE/root/usr/sbin/sshd" LIBS="$CACHE/root/usr/lib/x86_64-linux-gnu:$CACHE/root/lib/x86_64-linux-gnu"
fi

ID=$(( $$ % 200 + 20 ))
NS1="baton-a-$$" NS2="baton-b-$$" V1="bta$$" V2="btb$$"
A="10.77.$ID.1" B="10.77.$ID.2"
WORK=$(mktemp -d /tmp/baton-ssh-e2e-XXXXXX)
chmod 755 "$WORK"
LAUNCHER=""
cleanup() {
  [ -n "$LAUNCHER" ] && kill -INT "$LAUNCHER" 2>/dev/null && for _ in $(seq 150); do kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
  [ -n "$LAUNCHER" ] && kill -9 "$LAUNCHER" 2>/dev/null
  for f in "$WORK"/sshd-*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
  pkill -9 -f "$WORK" 2>/dev/null  # anything of ours still running (its command line names WORK)
  ip netns del "$NS1" 2>/dev/null; ip netns del "$NS2" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "ssh netns e2e: FAILED: $*" >&2; for f in "$WORK"/*.log; do echo "--- $f" >&2; tail -20 "$f" >&2; done; exit 1; }

ip netns add "$NS1" 2> /dev/null || skip "cannot create network namespaces here"
ip netns add "$NS2" || fail "second namespace"
ip link add "$V1" type veth peer name "$V2" || fail "veth pair"
ip link set "$V1" netns "$NS1" && ip link set "$V2" netns "$NS2" || fail "veth into namespaces"
ip -n "$NS1" addr add "$A/24" dev "$V1" && ip -n "$NS2" addr add "$B/24" dev "$V2" || fail "addresses"
for ns in "$NS1" "$NS2"; do ip -n "$ns" link set lo up; done
ip -n "$NS1" link set "$V1" up && ip -n "$NS2" link set "$V2" up || fail "links up"

ssh-keygen -q -t ed25519 -N '' -f "$WORK/host_key" && ssh-keygen -q -t ed25519 -N '' -f "$WORK/id" || fail "keys"
cp "$WORK/id.pub" "$WORK/authorized_keys"
mkdir -p /run/sshd  # sshd's privilege-separation directory
for side in a b; do
  addr=$A; ns=$NS1
  [ $side = b ] && addr=$B && ns=$NS2
  cat > "$WORK/sshd_$side.conf" <<CONF
ListenAddress $addr
Port 22
HostKey $WORK/host_key
PidFile $WORK/sshd-$side.pid
AuthorizedKeysFile $WORK/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
CONF
  # sshd wants its privilege-separation user; where the system has none, it sees one in a private
  # mount namespace (a copy of /etc/passwd bound over the real one, for sshd's eyes only).
  if getent passwd sshd > /dev/null; then
    run=(ip netns exec "$ns" env LD_LIBRARY_PATH="$LIBS" "$SSHD" -f "$WORK/sshd_$side.conf" -E "$WORK/sshd_$side.log")
  else
    { cat /etc/passwd; echo "sshd:x:64998:65534::/run/sshd:/usr/sbin/nologin"; } > "$WORK/passwd"
    run=(ip netns exec "$ns" unshare --mount sh -c "mount --bind '$WORK/passwd' /etc/passwd && exec env LD_LIBRARY_PATH='$LIBS' '$SSHD' -f '$WORK/sshd_$side.conf' -E '$WORK/sshd_$side.log'")
  fi
  "${run[@]}" ||
    skip "sshd does not start here: $(cat "$WORK/sshd_$side.log" 2>/dev/null | tail -3)"
done
SSH_OPTS='"-i", "'$WORK'/id", "-o", "UserKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR"'
for h in "$A" "$B"; do
  ok=0
  for _ in $(seq 50); do
    ip netns exec "$NS1" ssh -i "$WORK/id" -o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no -o LogLevel=ERROR \
      -o BatchMode=yes -o ConnectTimeout=2 "root@$h" true 2> /dev/null && ok=1 && break
    sleep 0.1
  done
  [ $ok = 1 ] || fail "ssh to $h"
done

cat > "$WORK/spec.json" <<SPEC
{
  "name": "netns",
  "model": "$SRC/models/baton-kjv-tiny",
  "binary": "$BATON",
  "api_keys": ["sk-netns-test-key"],
  "store": {"dir": "$WORK/store", "servers": 1, "block_tokens": 16},
  "ssh": {"user": "root", "options": [$SSH_OPTS]},
  "nodes": [
    {"name": "head", "host": "$A", "roles": ["router", "prefill", "store", "gateway"],
     "ports": {"router": 7100, "cluster": 7101, "http": 8000}, "env": {"UCX_NET_DEVICES": "$V1", "UCX_TLS": "tcp"}},
    {"name": "decode-remote", "host": "$B", "roles": ["decode"],
     "env": {"UCX_NET_DEVICES": "$V2", "UCX_TLS": "tcp", "BATON_FAULT_JOB_DELAY_MS": "40"}}
  ]
}
SPEC
ip netns exec "$NS1" "$BATON" launch "$WORK/spec.json" --wait-s 90 > "$WORK/launch.log" 2>&1 &
LAUNCHER=$!
for _ in $(seq 900); do grep -q "is up" "$WORK/launch.log" && break; kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
grep -q "is up" "$WORK/launch.log" || fail "the cluster did not come up over ssh"
grep -q "node decode-remote joined" "$WORK/launch.log" || fail "the remote decode node did not join"

code=$(ip netns exec "$NS1" curl -s -o "$WORK/answer.json" -w "%{http_code}" -H "Authorization: Bearer sk-netns-test-key" \
  "http://$A:8000/v1/completions" -d '{"prompt":"In the beginning","max_tokens":12}')
[ "$code" = 200 ] || fail "the gateway answered $code: $(cat "$WORK/answer.json")"
ip netns exec "$NS2" "$BATON" generate --router "$A:7100" --cluster-id netns --prompt "In the beginning" --max-tokens 12 > "$WORK/generate.txt" ||
  fail "generate from the other host"
python3 - "$WORK/answer.json" "$WORK/generate.txt" <<'PY' || fail "the gateway's text differs from the C++ client's"
import json, sys
a = json.load(open(sys.argv[1]))
assert a["choices"][0]["finish_reason"] == "length" and a["usage"]["completion_tokens"] == 12, a
assert a["choices"][0]["text"] == open(sys.argv[2]).read()[:-1]
PY
echo "ssh netns e2e: head and gateway on $A, decode node on $B, all started over ssh; the same 12 tokens over HTTP and the C++ client"

# A stream in flight when the launcher stops: the remote decode node drains it on its host (its
# ssh session ended at once), and the launcher waits for that drain before it stops the head,
# whose gateway carries the stream. Its steps take 40 ms (BATON_FAULT_JOB_DELAY_MS above), so
# the stream lasts ~10 s: longer than the 5 s the launcher gives the head before killing it.
ip netns exec "$NS1" curl -sN -H "Authorization: Bearer sk-netns-test-key" "http://$A:8000/v1/completions" \
  -d '{"prompt":"In the beginning","max_tokens":240,"ignore_eos":true,"stream":true}' > "$WORK/stream.txt" &
CURL=$!
for _ in $(seq 200); do [ -s "$WORK/stream.txt" ] && break; sleep 0.05; done
[ -s "$WORK/stream.txt" ] || fail "the long stream did not start"
kill -INT "$LAUNCHER"
for _ in $(seq 300); do kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
kill -0 "$LAUNCHER" 2>/dev/null && fail "the launcher did not stop"
LAUNCHER=""
wait "$CURL"
grep -q "waiting up to [0-9]* ms for the remote nodes decode-remote to drain" "$WORK/launch.log" ||
  fail "the launcher did not wait for the remote node's drain: $(tail -5 "$WORK/launch.log")"
grep -q '"finish_reason":"length"' "$WORK/stream.txt" && grep -q 'data: \[DONE\]' "$WORK/stream.txt" ||
  fail "the stream in flight was cut when the launcher stopped: $(tail -c 300 "$WORK/stream.txt")"
echo "ssh netns e2e: a 240-token stream in flight at the stop finished: the head outlived the remote node's drain"
# The remote nodes end when their ssh sessions do (SIGHUP through the remote terminal).
for _ in $(seq 150); do pgrep -f "$WORK/store|--name decode-remote" > /dev/null || break; sleep 0.1; done
pgrep -fa "$WORK/store|--name decode-remote" && fail "remote processes outlived the launcher by 15 s"
echo "ssh netns e2e: all checks passed"
