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

# One line per case (a case printing twice, e.g. a retried test, counts once: the last line).
summary="$(grep -o 'fault-injection: [^:]*: injected [0-9]*, survived [0-9]*, served wrong [0-9]*' "$log" |
  awk -F': ' '{ line[$2] = $3 }
    END {
      for (c in line) {
        split(line[c], f, /[ ,]+/)   # injected I survived S served wrong W
        n++; i += f[2]; s += f[4]; w += f[7]
        if (f[2] != f[4] || f[7] != 0 || f[2] == 0) bad++
      }
      printf "fault-injection suite: %d cases, %d faults injected, %d survived, %d served wrong\n", n, i, s, w
      exit (n == 0 || bad > 0)
    }')" || status=1
echo "$summary" | tee -a "$log"
exit "$status"
