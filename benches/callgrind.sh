#!/usr/bin/env bash
# Runs a benchmark with every redis-server it starts under Valgrind's
# callgrind, so that a bench that reads the servers' instruction counts
# (benches/shards.rs) can report them: a count that stays the same however
# the servers share the machine's cores, where CPU time does not.
#
#   benches/callgrind.sh <command...>
#   benches/callgrind.sh benches/pin.sh 0 1 target/release/deps/shards-<hash> --bench cluster
#
# The servers run some 30-50 times slower; give the bench fewer messages
# (SHARDS_MESSAGES). Needs valgrind (sudo apt-get install valgrind).
set -euo pipefail
if [ $# -lt 1 ]; then
  sed -n '7,8p' "$0" >&2
  exit 2
fi
real=$(command -v "${LOCKGATE_REDIS_SERVER:-redis-server}") || {
  echo "callgrind.sh: redis-server not found (sudo apt-get install redis-server)" >&2
  exit 1
}
command -v valgrind > /dev/null || {
  echo "callgrind.sh: valgrind not found (sudo apt-get install valgrind)" >&2
  exit 1
}
wrapper=$(mktemp -t lockgate-callgrind-redis.XXXXXX)
trap 'rm -f "$wrapper"' EXIT
printf '#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file=/dev/null -q %q "$@"\n' "$real" >"$wrapper"
chmod +x "$wrapper"
LOCKGATE_CALLGRIND=1 LOCKGATE_REDIS_SERVER=$wrapper "$@"
