# ucx_perftest as the ceiling beside a Baton figure, for bench scripts (sourced, not run).

# free_ports N (a port below the kernel's ephemeral range): the e2e tests' own.
source "$(dirname "${BASH_SOURCE[0]}")/../tests/deploy/e2e_lib.sh"

# tcp_port_listens PORT: whether a socket listens on PORT (read from /proc/net/tcp{,6}, state 0A,
# so nothing connects to it: ucx_perftest's server takes the first connection as its client).
tcp_port_listens() {
  local hex
  hex=$(printf '%04X' "$1")
  awk -v p=":$hex" '$2 ~ p"$" && $4 == "0A" {found = 1} END {exit !found}' /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

# ucx_perftest_gbps TLS TEST SIZE_BYTES ITERS: GB/s (1e9 B/s) of `ucx_perftest -t TEST` between a
# server on core 0 and a client on core 1 over 127.0.0.1, or "n/a" (and why, on stderr) if it
# did not run. Bounded: the server is awaited until it listens (10 s), each side runs under
# `timeout 120`.
ucx_perftest_gbps() {
  local tls=$1 test=$2 size=$3 iters=$4 port srv mbs
  port=$(free_ports 1)
  UCX_TLS=$tls timeout 120 taskset -c 0 ucx_perftest -p "$port" >/dev/null 2>&1 &
  srv=$!
  for _ in $(seq 100); do tcp_port_listens "$port" && break; kill -0 "$srv" 2>/dev/null || break; sleep 0.1; done
  if ! tcp_port_listens "$port"; then
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
    echo "ucx_perftest's server did not listen on port $port within 10 s" >&2
    echo "n/a"
    return
  fi
  mbs=$(UCX_TLS=$tls timeout 120 taskset -c 1 ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$size" -n "$iters" -w 5 -f 2>/dev/null |
        awk 'NF == 8 && $1 ~ /^[0-9]+$/ {print $5}' | tail -1) || true
  wait "$srv" 2>/dev/null || true
  if [ -z "$mbs" ]; then
    echo "ucx_perftest -t $test -s $size (UCX_TLS=$tls) printed no result" >&2
    echo "n/a"
    return
  fi
  awk -v m="$mbs" 'BEGIN {printf "%.2f", m * 1.048576 / 1000}'
}
