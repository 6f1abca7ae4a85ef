#!/usr/bin/env bash
# Runs a benchmark with redis-server and the client pinned to fixed CPUs.
#
#   benches/pin.sh <server cpus> <client cpus> <command...>
#   benches/pin.sh 0 1 cargo bench --bench lock        # server on CPU 0, client on CPU 1
#   benches/pin.sh 0 0 cargo bench --bench lock        # both on CPU 0
#
# On a 2-core machine, placement alone moves results up to 3x, so every figure
# in BENCHMARKS.md says which placement produced it. The servers are started by
# lockgate::testing, which runs $LOCKGATE_REDIS_SERVER: this script points it
# at a small wrapper that execs the real binary under `taskset` (same pid, so
# the harness still recognises its own server). Build first (`cargo bench
# --no-run`), or the compiler runs pinned too.
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '4,6p' "$0" >&2
  exit 2
fi
server_cpus=$1 client_cpus=$2
shift 2
real=$(command -v "${LOCKGATE_REDIS_SERVER:-redis-server}") || {
  echo "pin.sh: redis-server not found (sudo apt-get install redis-server)" >&2
  exit 1
}
wrapper=$(mktemp -t lockgate-pinned-redis.XXXXXX)
trap 'rm -f "$wrapper"' EXIT
printf '#!/bin/sh\nexec taskset -c %s %q "$@"\n' "$server_cpus" "$real" >"$wrapper"
chmod +x "$wrapper"
LOCKGATE_REDIS_SERVER=$wrapper taskset -c "$client_cpus" "$@"
