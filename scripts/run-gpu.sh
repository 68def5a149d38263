#!/usr/bin/env bash
# Runs the staged binaries (scripts/stage-gpu.sh) on a GPU host: every test with the GPU required,
# the GPU tests again under compute-sanitizer memcheck and racecheck, then the GPU benchmark.
# Logs go to $OUT (default ./gpu-out): summary.log, tests.log, sanitizer.log, bench.log, bench.md. Usage: run-gpu.sh [tests|sanitize|bench|all] [bench args]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
what="${1:-all}"
shift || true
export KVSHARD_REQUIRE_GPU=1
status=0

echo "commit $(cat "$here/COMMIT")  $(date -u +%FT%TZ)" | tee "$out/summary.log"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader \
  | tee -a "$out/summary.log" || true

if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in "$here"/tests/*; do
    name=$(basename "$t")
    log="$out/tmp-test.log"
    if "$t" --test-threads=4 >"$log" 2>&1; then r=ok; else r=FAILED; status=1; fi
    { echo "===== test $name: $r"; cat "$log"; } >>"$out/tests.log"
    echo "test $name: $r ($(grep -E '^test result' "$log" | tail -1))" | tee -a "$out/summary.log"
    rm -f "$log"
  done
fi

if [ "$what" = sanitize ] || [ "$what" = all ]; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck; do
    for t in "$here"/tests/*; do
      name=$(basename "$t")
      # Only binaries with GPU tests; CPU-only tests gain nothing under the sanitizer.
      "$t" --list 2>/dev/null | grep -q '^gpu_.*: test' || continue
      log="$out/tmp-sanitizer.log"
      if "$cs" --tool "$tool" --error-exitcode 99 "$t" gpu_ --test-threads=1 >"$log" 2>&1; then
        r=clean
      else
        r=FAILED
        status=1
      fi
      { echo "===== $tool $name: $r"; cat "$log"; } >>"$out/sanitizer.log"
      echo "$tool $name: $r ($(grep -E 'ERROR SUMMARY|test result' "$log" | tail -2 | tr '\n' ' '))" | tee -a "$out/summary.log"
      rm -f "$log"
    done
  done
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  OUT="$out" "$here/benches/gpu" "$@" 2>&1 | tee "$out/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
