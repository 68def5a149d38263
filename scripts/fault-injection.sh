#!/usr/bin/env bash
# The fault-injection suite in one command, summed into one line.
#
#   scripts/fault-injection.sh [PYTHON]
#
# Runs every fault-injection case: the Rust test binaries tests/faults_*.rs (the storage tier and
# the transports; NIXL's runtime required, from scripts/install-nixl.sh) and, when PYTHON (an
# interpreter with kvshard and Mooncake's non-CUDA engine installed, as .ci/run's venv) is
# given, python/tests/test_faults_*_cpu.py. Each case prints
#   fault-injection: CASE: injected I, survived S, served wrong W
# and fails by itself unless every fault was survived and nothing was served wrong; this script
# then prints, last,
#   fault-injection suite: C cases, I faults injected, S survived, W served wrong
# and exits non-zero if any run failed, any case lost a fault or served a wrong byte, or no
# case ran at all. The whole output is kept in target/fault-injection.log.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${1:-}"
log=target/fault-injection.log
mkdir -p target
: >"$log"
nixl_lib="$(scripts/install-nixl.sh)"
status=0

binaries=()
for f in tests/faults_*.rs; do binaries+=(--test "$(basename "$f" .rs)"); done
LD_LIBRARY_PATH="$nixl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" KVSHARD_REQUIRE_NIXL=1 \
  cargo test --release -p kvshard --features "require-kernels nixl" "${binaries[@]}" -- --nocapture fault_ \
  2>&1 | tee -a "$log" || status=1

if [ -n "$python" ]; then
  KVSHARD_REQUIRE_MOONCAKE=1 LD_LIBRARY_PATH="$nixl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$python" -m pytest -q -s -rs python/tests/test_faults_*_cpu.py 2>&1 | tee -a "$log" || status=1
fi

# One line per case (a case printing twice, e.g. a retried test, counts once: its last line).
# Case names may hold ": ", so the numbers are taken from the end of the line.
summary="$(grep -oE 'fault-injection: .*: injected [0-9]+, survived [0-9]+, served wrong [0-9]+' "$log" |
  sed -E 's/^fault-injection: (.*): injected ([0-9]+), survived ([0-9]+), served wrong ([0-9]+)$/\1\t\2\t\3\t\4/' |
  awk -F'\t' '{ inj[$1] = $2; sur[$1] = $3; wrong[$1] = $4 }
    END {
      for (c in inj) {
        n++; i += inj[c]; s += sur[c]; w += wrong[c]
        if (inj[c] != sur[c] || wrong[c] != 0 || inj[c] == 0) bad++
      }
      printf "fault-injection suite: %d cases, %d faults injected, %d survived, %d served wrong\n", n, i, s, w
      exit (n == 0 || bad > 0)
    }')" || status=1
echo "$summary" | tee -a "$log"
exit "$status"
