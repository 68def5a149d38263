#!/usr/bin/env bash
# On a GPU host: the variants scripts/stage-ab.sh packed into .gpu-ab/, side by side in one call.
# First each variant's dcp GPU tests (its kernels byte for byte against the CPU twin, the GPU
# required), with AB_SANITIZE=1 also under compute-sanitizer memcheck and racecheck; a variant
# that fails is left out of the timing. Then AB_ROUNDS rounds (default 4) of the GPU benchmark,
# every variant once a round, the order turned by one each round (no variant always runs first
# or last), each run bounded to AB_RUN_S seconds (default 150); no run starts once AB_BUDGET_S
# seconds (default 540) have passed since the start, so the default fits one 10-minute call.
# Writes to $OUT (default ./ab-out): ab.log (every run's output), ab.md (the commits and their
# decode kernels' registers, the tests' verdicts, and every benchmark row's share of its
# same-run ceiling by variant and round), and each run's own files under VARIANT-ROUND/.
# Usage: run-ab.sh [-- BENCH ARGS]   (default: --quick dcp; DCP_N, DCP_M, DCP_I, ... pass through)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$PWD/ab-out}"
mkdir -p "$out"
[ "${1:-}" = "--" ] && shift
[ $# -eq 0 ] && set -- --quick dcp
export KVSHARD_REQUIRE_GPU=1
# The CPU twin the tests compare against, in the order every test run uses (run-gpu.sh).
export KVSHARD_CPU_STREAMS="${KVSHARD_CPU_STREAMS:-adversarial}"
start=$(date +%s)
run_s=${AB_RUN_S:-150}
status=0
say() { echo "$*" | tee -a "$out/ab.md"; }
{
  echo "# A/B of $(date -u +%FT%TZ): $*"
  echo
  echo '```'
  cat "$here/REFS"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
  echo '```'
  echo
} >"$out/ab.md"
: >"$out/ab.log"

variants=()
for dir in "$here"/*/; do
  if [ -x "$dir/gpu" ]; then variants+=("$(basename "$dir")"); fi
done
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
passed=()
for v in "${variants[@]}"; do
  ok=1
  echo "===== $v dcp tests" >>"$out/ab.log"
  if timeout "$run_s" "$here/$v/dcp" gpu_ --test-threads=4 >>"$out/ab.log" 2>&1; then r=ok; else r=FAILED; ok=0; fi
  say "- $v: dcp GPU tests $r"
  if [ "${AB_SANITIZE:-0}" = 1 ]; then
    for tool in memcheck racecheck; do
      echo "===== $v $tool" >>"$out/ab.log"
      if timeout "$run_s" "$cs" --tool "$tool" --report-api-errors no --error-exitcode 99 \
        "$here/$v/dcp" gpu_ --test-threads=1 >>"$out/ab.log" 2>&1; then r=clean; else r=FAILED; ok=0; fi
      say "- $v: $tool $r"
    done
  fi
  if [ "$ok" = 1 ]; then passed+=("$v"); else status=1; fi
done

n=${#passed[@]}
for ((round = 1; round <= ${AB_ROUNDS:-4}; round++)); do
  for ((k = 0; k < n; k++)); do
    v=${passed[$(((k + round - 1) % n))]}
    if [ $(($(date +%s) - start)) -ge "${AB_BUDGET_S:-540}" ]; then
      say "- the budget was spent before round $round of $v: not run, nor any later"
      break 2
    fi
    echo "===== $v round $round" >>"$out/ab.log"
    OUT="$out/$v-$round" timeout "$run_s" "$here/$v/gpu" "$@" >>"$out/ab.log" 2>&1
    code=$?
    if [ "$code" != 0 ]; then
      say "- $v round $round: FAILED (exit $code)"
      status=1
    fi
  done
done

# Every row's share of its same-run ceiling: a column per variant and round, and each variant's
# mean over its rounds.
python3 - "$out/ab.log" >>"$out/ab.md" <<'EOF'
import re, sys
variants, rounds, rows, cells = [], {}, [], {}
at = None
for line in open(sys.argv[1], errors="replace"):
    head = re.match(r"===== (\S+) round (\d+)$", line.strip())
    if line.startswith("====="):
        at = (head.group(1), int(head.group(2))) if head else None
        if at:
            if at[0] not in variants:
                variants.append(at[0])
            rounds.setdefault(at[0], []).append(at[1])
        continue
    if at is None:
        continue
    ceiling = re.match(r"ceilings \(this run\): D2D ([\d.]+) GB/s", line)
    row = re.match(r"^(\S+)\s+(.+?)\s+\d+ B\s+.*?\s([\d.]+)% of (\S+)", line)
    if ceiling:
        key, value = "D2D ceiling (GB/s)", float(ceiling.group(1))
    elif row:
        key, value = f"{row.group(1)} {row.group(2)} (% of {row.group(4)})", float(row.group(3))
    else:
        continue
    if key not in rows:
        rows.append(key)
    cells[(key, at)] = value
columns = [(v, r) for v in variants for r in sorted(rounds[v])]
if not columns:
    sys.exit()
heads = [f"{v} r{r}" for v, r in columns] + [f"{v} mean" for v in variants]
print("\n| row | " + " | ".join(heads) + " |")
print("|---|" + "---:|" * len(heads))
for key in rows:
    cols = [f"{cells[(key, c)]:.1f}" if (key, c) in cells else "" for c in columns]
    for v in variants:
        got = [cells[(key, (v, r))] for r in rounds[v] if (key, (v, r)) in cells]
        cols.append(f"{sum(got) / len(got):.2f}" if got else "")
    print(f"| {key} | " + " | ".join(cols) + " |")
EOF
exit $status
