#!/usr/bin/env bash
# A multi-process cluster from a spec on 127.0.0.1 (head with router, 2 prefill ranks and 2
# block servers; 2 decode nodes, one with a gateway of its own; a gateway node), launched by
# `baton launch`, serving:
#   1. the C++ client (`baton generate`) gets exactly the text of a single-process cluster;
#   2. curl gets the same text over HTTP, whole and streamed;
#   3. the official OpenAI Node.js SDK passes its checks (tests/node);
#   4. SIGTERM on a decode node while 4 clients stream: every stream ends well (drain);
#   5. SIGINT on the launcher: gateways drain first, the stream in progress
#      finishes, and every process stops.
# Besides: the gateway beside decode-b's ranks joins the head as decode-b/gateway and serves, and
# a gateway started under a live decode node's name is refused by name.
# Usage: launch_e2e.sh BATON_BINARY SOURCE_DIR. Bounded waits throughout; always cleans up.
set -euo pipefail
BATON=$1
SRC=$2
WORK=$(mktemp -d /tmp/baton-launch-e2e-XXXXXX)
LAUNCHER="" SINGLE=""
cleanup() {
  for p in $LAUNCHER $SINGLE; do kill -INT "$p" 2>/dev/null || true; done
  for _ in $(seq 100); do
    alive=0
    for p in $LAUNCHER $SINGLE; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for p in $LAUNCHER $SINGLE; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "launch e2e: FAILED: $*" >&2; echo "--- launcher output:" >&2; cat "$WORK/launch.log" >&2 || true; exit 1; }
wait_for() {  # wait_for FILE PATTERN SECONDS
  for _ in $(seq $(( $3 * 10 ))); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  fail "no '$2' in $1 within $3 s"
}

source "$(dirname "$0")/e2e_lib.sh"
read -r P_ROUTER P_CLUSTER P_HTTP P_HTTP_B < <(free_ports 4)
KEY="sk-e2e-$RANDOM$RANDOM$RANDOM"
MODEL_DIR="$SRC/models/baton-kjv-tiny"
cat > "$WORK/spec.json" <<SPEC
{
  "name": "e2e",
  "model": "$MODEL_DIR",
  "api_keys_env": "BATON_E2E_KEYS",
  "store": {"dir": "$WORK/store", "servers": 2, "block_tokens": 16},
  "nodes": [
    {"name": "head", "host": "127.0.0.1", "roles": ["router", "prefill", "store"], "prefill_ranks": 2,
     "ports": {"router": $P_ROUTER, "cluster": $P_CLUSTER}},
    {"name": "decode-a", "host": "127.0.0.1", "roles": ["decode"]},
    {"name": "decode-b", "host": "127.0.0.1", "roles": ["decode", "gateway"], "ports": {"http": $P_HTTP_B}},
    {"name": "gw", "host": "127.0.0.1", "roles": ["gateway"], "ports": {"http": $P_HTTP}}
  ]
}
SPEC
BATON_E2E_KEYS="$KEY" "$BATON" launch "$WORK/spec.json" --wait-s 90 > "$WORK/launch.log" 2>&1 &
LAUNCHER=$!
wait_for "$WORK/launch.log" "is up" 90
grep -q "node decode-a joined" "$WORK/launch.log" || fail "decode-a did not join"
# "Is up" means every rank takes work: the balancers list all four ranks the moment it is said
# (asked once, no retry), or the first requests would all go to the ranks that registered first.
RANKS=$(curl -s -m 10 -H "Authorization: Bearer $KEY" "http://127.0.0.1:$P_HTTP/metrics" | grep '^baton_rank_kv_pages{' | grep -o 'role="[a-z]*"' | sort | uniq -c | tr -s ' \n' ' ')
[ "$RANKS" = ' 2 role="decode" 2 role="prefill" ' ] || fail "at 'is up' the balancers list ranks: '$RANKS', not 2 decode and 2 prefill"
# One process, one name at the head: decode-b's ranks and its gateway are two entries.
grep -q "node decode-b joined (decode" "$WORK/launch.log" || fail "decode-b did not join as a decode process"
grep -q "node decode-b/gateway joined (gateway" "$WORK/launch.log" || fail "decode-b's gateway did not join as decode-b/gateway"
[ "$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $KEY" "http://127.0.0.1:$P_HTTP_B/v1/models")" = 200 ] ||
  fail "decode-b's gateway does not serve"
set +e
timeout 60 "$BATON" gateway --cluster "127.0.0.1:$P_CLUSTER" --cluster-id e2e --name decode-a --listen 127.0.0.1:0 \
  > "$WORK/dup_gateway.log" 2>&1
DUP_RC=$?
set -e
[ "$DUP_RC" = 1 ] || fail "a gateway under decode-a's name exited $DUP_RC, not 1: $(cat "$WORK/dup_gateway.log")"
grep -q "refused this node: .*node name decode-a is held by a live decode process" "$WORK/dup_gateway.log" ||
  fail "a gateway under decode-a's name was not refused by name: $(cat "$WORK/dup_gateway.log")"
echo "launch e2e: names: decode-b's gateway joined as decode-b/gateway; a gateway named decode-a was refused ($(grep -o 'node name decode-a[^:]*' "$WORK/dup_gateway.log"))"
# The same spec launched again while it runs: refused before any process starts (before, its
# nodes joined the live head under their names, each replacing the live one, before its head
# failed to bind), and the running cluster keeps every node.
set +e
BATON_E2E_KEYS="$KEY" timeout 60 "$BATON" launch "$WORK/spec.json" --wait-s 20 > "$WORK/relaunch.log" 2>&1
RELAUNCH_RC=$?
set -e
[ "$RELAUNCH_RC" = 1 ] || fail "a second launch of the running spec exited $RELAUNCH_RC, not 1: $(cat "$WORK/relaunch.log")"
grep -q "node head's router port 127.0.0.1:$P_ROUTER cannot be bound: .*already running" "$WORK/relaunch.log" ||
  fail "the second launch did not name the taken port: $(cat "$WORK/relaunch.log")"
grep -q "joined\|(pid " "$WORK/relaunch.log" && fail "the second launch started something: $(cat "$WORK/relaunch.log")"
grep -q "newer process\|leaves" "$WORK/launch.log" && fail "a node of the running cluster left: $(grep 'newer\|leaves' "$WORK/launch.log")"
echo "launch e2e: a second launch of the running spec was refused, naming the router's port; no node of the cluster left"

# 1. The same prompts through a single-process cluster and through the launched one.
"$BATON" local --serve --model "$MODEL_DIR" --router-listen 127.0.0.1:0 > "$WORK/single.log" 2>&1 &
SINGLE=$!
wait_for "$WORK/single.log" "router listening" 60
P_SINGLE=$(grep -o "router listening on 127.0.0.1:[0-9]*" "$WORK/single.log" | grep -o "[0-9]*$")
PROMPTS=(--prompt "In the beginning" --prompt "And God said" --prompt "The LORD is my shepherd")
"$BATON" generate --router "127.0.0.1:$P_SINGLE" "${PROMPTS[@]}" --max-tokens 16 > "$WORK/single.txt" || fail "generate (single)"
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id e2e "${PROMPTS[@]}" --max-tokens 16 > "$WORK/cluster.txt" || fail "generate (cluster)"
cmp -s "$WORK/single.txt" "$WORK/cluster.txt" || fail "the cluster's text differs from the single process's: $(diff "$WORK/single.txt" "$WORK/cluster.txt")"
[ "$(wc -l < "$WORK/cluster.txt")" -ge 3 ] || fail "generate printed too little"
echo "launch e2e: C++ client: 3 prompts, same text as the single-process cluster"
# Structured outputs across processes: decode ranks in node processes of their own keep the
# answer to the schema over the model's vocabulary, with the single process's very tokens.
# (One property: the tiny model fills every place whitespace may go, 26 tokens each, and its
# context is 256 tokens.)
SCHEMA='{"type":"object","properties":{"verse":{"type":"integer","minimum":1,"maximum":50}},"required":["verse"]}'
"$BATON" generate --router "127.0.0.1:$P_SINGLE" --json-schema "$SCHEMA" --max-tokens 200 --prompt "In the beginning" > "$WORK/single_json.txt" || fail "generate --json-schema (single)"
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id e2e --json-schema "$SCHEMA" --max-tokens 200 --prompt "In the beginning" > "$WORK/cluster_json.txt" || fail "generate --json-schema (cluster)"
cmp -s "$WORK/single_json.txt" "$WORK/cluster_json.txt" || fail "the cluster's JSON differs: $(cat "$WORK/single_json.txt" "$WORK/cluster_json.txt")"
python3 - "$WORK/cluster_json.txt" <<'PY' || fail "--json-schema: not JSON of the schema: $(cat "$WORK/cluster_json.txt")"
import json, sys
j = json.loads(open(sys.argv[1]).read())
assert list(j) == ["verse"] and isinstance(j["verse"], int) and 1 <= j["verse"] <= 50, j
PY
echo "launch e2e: --json-schema: the same JSON as the single process: $(tr -d ' \n' < "$WORK/cluster_json.txt")"
# Text matching a regular expression whole (guided_regex), and compact JSON, across processes too.
REGEX='(?:Genesis|Exodus) [1-9][0-9]?:[1-9][0-9]?'
"$BATON" generate --router "127.0.0.1:$P_SINGLE" --regex "$REGEX" --max-tokens 40 --prompt "In the beginning" > "$WORK/single_regex.txt" || fail "generate --regex (single)"
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id e2e --regex "$REGEX" --max-tokens 40 --prompt "In the beginning" > "$WORK/cluster_regex.txt" || fail "generate --regex (cluster)"
cmp -s "$WORK/single_regex.txt" "$WORK/cluster_regex.txt" || fail "the cluster's regex answer differs: $(cat "$WORK/single_regex.txt" "$WORK/cluster_regex.txt")"
COMPACT='{"type":"object","properties":{"book":{"enum":["Genesis","Exodus"]},"chapter":{"type":"integer","minimum":1,"maximum":50}},"required":["book","chapter"]}'
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id e2e --json-schema "$COMPACT" --json-compact --max-tokens 60 --prompt "In the beginning" > "$WORK/cluster_compact.txt" || fail "generate --json-compact (cluster)"
python3 - "$WORK/cluster_regex.txt" "$WORK/cluster_compact.txt" "$REGEX" <<'PY' || fail "--regex/--json-compact: $(cat "$WORK/cluster_regex.txt" "$WORK/cluster_compact.txt")"
import json, re, sys
text = open(sys.argv[1]).read().rstrip("\n")
assert re.fullmatch(sys.argv[3], text), text
compact = open(sys.argv[2]).read().rstrip("\n")
j = json.loads(compact)
assert list(j) == ["book", "chapter"] and " " not in compact and "\n" not in compact, compact
PY
# One constraint per request, said by the flags' names before anything is sent.
set +e
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id e2e --json --regex "a+" --prompt "x" > /dev/null 2> "$WORK/mixed.err"
MIXED_RC=$?
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id e2e --regex "a+" --json-compact --prompt "x" > /dev/null 2> "$WORK/compact_text.err"
COMPACT_RC=$?
set -e
[ "$MIXED_RC" = 2 ] && grep -q "give one of --json, --json-schema, --regex and --gbnf" "$WORK/mixed.err" || fail "--json with --regex: rc $MIXED_RC, $(cat "$WORK/mixed.err")"
[ "$COMPACT_RC" = 2 ] && grep -q -e "--json-compact shapes JSON" "$WORK/compact_text.err" || fail "--json-compact with --regex: rc $COMPACT_RC, $(cat "$WORK/compact_text.err")"
echo "launch e2e: --regex: the same text as the single process ($(cat "$WORK/cluster_regex.txt")); --json-compact: $(cat "$WORK/cluster_compact.txt")"
# Prompt scoring across processes (prefill rank -> head -> client, floats as bits): the same
# log-probabilities as in one process, and a real text scores better than noise.
"$BATON" generate --router "127.0.0.1:$P_SINGLE" --score --max-tokens 1 --prompt "$(printf 'In the beginning God created the heaven and the earth.')" --prompt "zqxv jjkw pplq" > "$WORK/single_score.txt" || fail "score (single)"
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id e2e --score --max-tokens 1 --prompt "$(printf 'In the beginning God created the heaven and the earth.')" --prompt "zqxv jjkw pplq" > "$WORK/cluster_score.txt" || fail "score (cluster)"
diff <(grep "^score:" "$WORK/single_score.txt") <(grep "^score:" "$WORK/cluster_score.txt") > /dev/null || fail "the cluster's scores differ: $(grep "^score:" "$WORK/single_score.txt" "$WORK/cluster_score.txt")"
python3 - "$WORK/cluster_score.txt" <<'PY' || fail "scores: $(cat "$WORK/cluster_score.txt")"
import re, sys
ppl = [float(m) for m in re.findall(r"^score: \d+ tokens, log-probability \S+, perplexity (\S+)$", open(sys.argv[1]).read(), re.M)]
assert len(ppl) == 2 and 1.0 < ppl[0] < ppl[1], ppl
PY
echo "launch e2e: scoring: the same perplexities as in one process ($(grep -o 'perplexity [0-9.]*' "$WORK/cluster_score.txt" | tr '\n' ' '))"

# 2. curl: whole and streamed answers carry the same text as the C++ client's first prompt.
URL="http://127.0.0.1:$P_HTTP"
# (generate prints the text and one newline; the file keeps a text that itself ends in newlines)
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id e2e --prompt "In the beginning" --max-tokens 16 > "$WORK/expected.txt"
EXPECTED="$WORK/expected.txt"
curl -sf -H "Authorization: Bearer $KEY" "$URL/v1/completions" \
  -d '{"prompt":"In the beginning","max_tokens":16}' > "$WORK/whole.json" || fail "curl completion"
python3 - "$WORK/whole.json" "$EXPECTED" <<'PY' || fail "curl: whole completion text"
import json, sys
got = json.load(open(sys.argv[1]))["choices"][0]["text"]
want = open(sys.argv[2]).read()[:-1]
assert got == want, (got, want)
PY
curl -sfN -H "Authorization: Bearer $KEY" "$URL/v1/completions" \
  -d '{"prompt":"In the beginning","max_tokens":16,"stream":true}' > "$WORK/stream.txt" || fail "curl stream"
python3 - "$WORK/stream.txt" "$EXPECTED" <<'PY' || fail "curl: streamed text"
import json, sys
events = [l[6:] for l in open(sys.argv[1]).read().split("\n") if l.startswith("data: ")]
assert events[-1] == "[DONE]", events[-1]
text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
want = open(sys.argv[2]).read()[:-1]
assert text == want, (text, want)
PY
[ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/v1/models")" = 401 ] || fail "no key should give 401"
echo "launch e2e: curl: whole and streamed text equal the C++ client's; no key gives 401"

# 3. The OpenAI Node.js SDK.
if [ -f "$SRC/tests/node/node_modules/openai/package.json" ] && command -v node > /dev/null; then
  BATON_GATEWAY_URL="$URL" BATON_API_KEY="$KEY" BATON_MODEL=baton-kjv-tiny BATON_PROMPT="In the beginning" \
    BATON_EXPECTED_FILE="$EXPECTED" BATON_MAX_TOKENS=16 node "$SRC/tests/node/openai_sdk.test.mjs" || fail "OpenAI SDK"
else
  echo "launch e2e: SKIPPED the OpenAI SDK checks: run scripts/setup.sh (Node.js and tests/node/node_modules)"
fi

# 4. Drain: SIGTERM decode-a while four clients stream long answers; every stream ends well.
for i in 1 2 3 4; do
  curl -sN -m 120 -H "Authorization: Bearer $KEY" "$URL/v1/completions" \
    -d "{\"prompt\":\"Stream number $i\",\"max_tokens\":150,\"ignore_eos\":true,\"stream\":true}" > "$WORK/drain$i.txt" &
done
PID_A=$(grep -o "node decode-a joined (decode, pid [0-9]*" "$WORK/launch.log" | grep -o "[0-9]*$")
# Every stream has begun (so some run on decode-a) before the drain, else it would test nothing.
begun() { grep -l "data:" "$WORK"/drain[1-4].txt 2>/dev/null | wc -l; }
for _ in $(seq 600); do [ "$(begun)" = 4 ] && break; sleep 0.05; done
[ "$(begun)" = 4 ] || fail "only $(begun) of 4 streams began within 30 s"
kill -TERM "$PID_A"
wait $(jobs -p | grep -v -e "^$LAUNCHER$" -e "^$SINGLE$") 2>/dev/null || true
for i in 1 2 3 4; do
  grep -q '"finish_reason":"length"' "$WORK/drain$i.txt" || fail "stream $i did not finish during the drain"
  ! grep -q '"error"' "$WORK/drain$i.txt" || fail "stream $i saw an error during the drain"
  [ "$(grep -c '^data: ' "$WORK/drain$i.txt")" -ge 150 ] || fail "stream $i is short"
done
wait_for "$WORK/launch.log" "node decode-a left (exit code 0)" 30
"$BATON" generate --router "127.0.0.1:$P_ROUTER" --cluster-id e2e --prompt "After the drain" --max-tokens 4 > /dev/null || fail "serving after the drain"
echo "launch e2e: drain: 4 streams finished while decode-a drained and left; the cluster still serves"

# 5. Stop: the gateways first (they turn new calls away at once), then the decode nodes drain
# (the stream in progress runs to its end), then every process ends.
PIDS=$(pgrep -P "$LAUNCHER" | tr '\n' ' ')  # its nodes now (pids printed earlier may be reused)
[ -n "$PIDS" ] || fail "the launcher has no node processes left to stop"
curl -sN -m 120 -H "Authorization: Bearer $KEY" "$URL/v1/completions" \
  -d '{"prompt":"The last stream","max_tokens":230,"ignore_eos":true,"stream":true}' > "$WORK/last.txt" &
LAST=$!
for _ in $(seq 600); do [ "$(grep -c '^data: ' "$WORK/last.txt" 2>/dev/null)" -ge 2 ] && break; sleep 0.05; done
kill -INT "$LAUNCHER"
for _ in $(seq 600); do kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
! kill -0 "$LAUNCHER" 2>/dev/null || fail "the launcher did not stop within 60 s"
for p in $PIDS; do ! kill -0 "$p" 2>/dev/null || fail "node process $p outlived the launcher"; done
LAUNCHER=""
wait "$LAST" || true
grep -q '"finish_reason":"length"' "$WORK/last.txt" && ! grep -q '"error"' "$WORK/last.txt" ||
  fail "the stream in progress did not finish well during the stop: $(tail -c 400 "$WORK/last.txt")"
# In the launcher's output (every process writes there, each line flushed): a gateway's drain
# began before decode-b (the decode node left after step 4) had drained and left; signalled
# after the decode nodes, it would come after.
GW_LINE=$(grep -n "baton gateway: draining" "$WORK/launch.log" | head -1 | cut -d: -f1)
LEFT_LINE=$(grep -n "baton node decode-b: drained and left" "$WORK/launch.log" | head -1 | cut -d: -f1)
[ -n "$GW_LINE" ] && [ -n "$LEFT_LINE" ] && [ "$GW_LINE" -lt "$LEFT_LINE" ] ||
  fail "the gateways did not drain before the decode nodes left (lines '$GW_LINE' and '$LEFT_LINE')"
echo "launch e2e: stop: the gateways drained first, the stream in progress finished, every process ended"
echo "launch e2e: all checks passed"
