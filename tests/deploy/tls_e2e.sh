#!/usr/bin/env bash
# Confinement between processes (issue 10): a spec with "tls": true on 127.0.0.1. `baton launch`
# makes the cluster CA and a certificate per node; every node joins over mutual TLS and serves.
# Asserted: the C++ client with the cluster's client certificate gets the same text as without
# TLS elsewhere; refused, each with a sentence that says why: a client without TLS, a client
# whose certificate another CA signed, a client of another cluster id, and a decode node with a
# foreign certificate (it cannot join) -- and the nodes' own TLS connections survive all of that.
# Usage: tls_e2e.sh BATON_BINARY SOURCE_DIR.
set -euo pipefail
BATON=$1
SRC=$2
WORK=$(mktemp -d /tmp/baton-tls-e2e-XXXXXX)
LAUNCHER=""
source "$(dirname "$0")/e2e_lib.sh"
trap stop_launcher EXIT
fail() { echo "tls e2e: FAILED: $*" >&2; cat "$WORK/launch.log" >&2; exit 1; }
command -v openssl > /dev/null || { echo "tls e2e: SKIPPED: no openssl command (scripts/setup.sh installs it)"; exit 0; }
read -r P_ROUTER P_CLUSTER P_HTTP < <(free_ports 3)
cat > "$WORK/spec.json" <<SPEC
{
  "name": "secure",
  "model": "$SRC/models/baton-kjv-tiny",
  "tls": true,
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill"], "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]},
    {"name": "gw", "host": "127.0.0.1", "roles": ["gateway"], "ports": {"http": $P_HTTP}}
  ]
}
SPEC
launch_cluster
T="$WORK/.baton-tls-secure"
for f in ca.pem client.pem client.key head.pem decode-a.pem gw.pem; do [ -f "$T/$f" ] || fail "no $T/$f"; done
R="127.0.0.1:$P_ROUTER"
CLIENT=(--cluster-id secure --tls-cert "$T/client.pem" --tls-key "$T/client.key" --tls-ca "$T/ca.pem")
"$BATON" generate --router "$R" "${CLIENT[@]}" --max-tokens 12 "In the beginning" > "$WORK/tls.txt" || fail "the TLS client was refused"
curl -sf "http://127.0.0.1:$P_HTTP/v1/completions" -d '{"prompt":"In the beginning","max_tokens":12}' > "$WORK/http.json" ||
  fail "the gateway (a TLS client of the cluster) did not answer"
python3 - "$WORK/http.json" "$WORK/tls.txt" <<'PY' || fail "the gateway's text differs from the TLS client's"
import json, sys
assert json.load(open(sys.argv[1]))["choices"][0]["text"] == open(sys.argv[2]).read()[:-1]
PY
echo "tls e2e: the cluster's client certificate works; the gateway, itself a TLS node, gives the same text"

refused() {  # refused WHAT EXPECTED_HINT COMMAND...
  local what=$1 hint=$2
  shift 2
  if timeout 30 "$@" > "$WORK/out.txt" 2> "$WORK/err.txt"; then fail "$what was not refused"; fi
  grep -q "$hint" "$WORK/err.txt" || fail "$what: no '$hint' in: $(cat "$WORK/err.txt")"
  echo "tls e2e: refused $what: $(head -c 200 "$WORK/err.txt")"
}
refused "a client without TLS" "may require mutual TLS" "$BATON" generate --router "$R" --cluster-id secure "x"
mkdir -p "$WORK/evil"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$WORK/evil/ca.key" \
  -out "$WORK/evil/ca.pem" -days 1 -subj /CN=evil > /dev/null 2>&1
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$WORK/evil/c.key" -out "$WORK/evil/c.csr" \
  -subj /CN=evil > /dev/null 2>&1
openssl x509 -req -in "$WORK/evil/c.csr" -CA "$WORK/evil/ca.pem" -CAkey "$WORK/evil/ca.key" -CAcreateserial \
  -out "$WORK/evil/c.pem" -days 1 > /dev/null 2>&1
refused "a client with another CA's certificate" "TLS handshake failed" \
  "$BATON" generate --router "$R" --cluster-id secure --tls-cert "$WORK/evil/c.pem" --tls-key "$WORK/evil/c.key" --tls-ca "$T/ca.pem" "x"
refused "a client of another cluster id" "another cluster" \
  "$BATON" generate --router "$R" --cluster-id other --tls-cert "$T/client.pem" --tls-key "$T/client.key" --tls-ca "$T/ca.pem" "x"
refused "a decode node with a foreign certificate" "TLS handshake failed" \
  "$BATON" node --role decode --name intruder --connect "127.0.0.1:$P_CLUSTER" --model "$SRC/models/baton-kjv-tiny" \
  --cluster-id secure --tls-cert "$WORK/evil/c.pem" --tls-key "$WORK/evil/c.key" --tls-ca "$T/ca.pem"
"$BATON" generate --router "$R" "${CLIENT[@]}" --max-tokens 12 "In the beginning" | cmp -s - "$WORK/tls.txt" ||
  fail "the cluster does not serve the same after the intruders"
# The nodes' own TLS connections survived every refused one (client/openssl_error_queue.cpp).
curl -sf "http://127.0.0.1:$P_HTTP/v1/completions" -d '{"prompt":"In the beginning","max_tokens":12}' > "$WORK/http2.json" ||
  fail "the gateway lost the cluster when intruders were refused"
grep -q "left" "$WORK/launch.log" && fail "a node left while intruders were refused"
echo "tls e2e: all checks passed"
