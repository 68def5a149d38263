#!/usr/bin/env bash
# On a GPU host: the variants scripts/stage-ab.sh packed into .gpu-ab/, side by side in one call.
# First each variant's dcp GPU tests (its kernels byte for byte against the CPU twin, the GPU
# required), with AB_SANITIZE=1 also under compute-sanitizer memcheck and racecheck; a variant
# that fails is left out of the timing. Then AB_ROUNDS rounds (default 4) of the GPU benchmark,
# every variant once a round, the order turned by one each round (no variant always runs first
# or last). Every test and run is bounded to AB_RUN_S seconds (default 150), and none starts
# that could end past AB_BUDGET_S seconds (default 570) from the start, so the default ends
# inside one 10-minute call whatever hangs.
# Writes to $OUT (default ./ab-out): ab.log (every run's output), ab.md (the commits and their
# decode kernels' registers, the tests' verdicts, and from each run's bench.md every row's share
# of its same-run ceiling and its window's, by variant and round), and each run's own files
# under VARIANT.ROUND/ (a name holds no dot).
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
budget=${AB_BUDGET_S:-570}
# Whether a step bounded to run_s seconds, started now, ends within the budget.
fits() { [ $(($(date +%s) - start + run_s)) -le "$budget" ]; }
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
  if ! fits; then
    say "- the budget was spent before $v's tests: neither it nor any later variant is timed"
    status=1
    break
  fi
  ok=1
  echo "===== $v dcp tests" >>"$out/ab.log"
  if timeout "$run_s" "$here/$v/dcp" gpu_ --test-threads=4 >>"$out/ab.log" 2>&1; then r=ok; else r=FAILED; ok=0; fi
  say "- $v: dcp GPU tests $r"
  if [ "${AB_SANITIZE:-0}" = 1 ]; then
    for tool in memcheck racecheck; do
      if ! fits; then
        say "- $v: the budget was spent before $tool: not timed"
        ok=0
        break
      fi
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
    if ! fits; then
      say "- the budget was spent before round $round of $v: not run, nor any later"
      break 2
    fi
    echo "===== $v round $round" >>"$out/ab.log"
    mkdir -p "$out/$v.$round"
    OUT="$out/$v.$round" timeout "$run_s" "$here/$v/gpu" "$@" >>"$out/ab.log" 2>&1
    code=$?
    if [ "$code" != 0 ]; then
      say "- $v round $round: FAILED (exit $code)"
      status=1
    fi
  done
done

# From each run's bench.md (its final figures, against the ceilings as the run ended): every
# row's share of its same-run ceiling and its window's, a column per variant and round, and
# each variant's mean over its rounds.
python3 - "$out" "${passed[@]}" >>"$out/ab.md" <<'EOF'
import pathlib, sys
out, variants = pathlib.Path(sys.argv[1]), sys.argv[2:]
runs = {}  # (variant, round) -> {case: (share, window share)}
for v in variants:
    for bench in sorted(out.glob(f"{v}.*/bench.md")):
        rows = {}
        for line in bench.read_text(errors="replace").splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 12 or not cells[5].endswith("%"):
                continue
            window = cells[7].rstrip("%")
            rows[f"{cells[0]} {cells[1]}"] = (float(cells[5].rstrip("%")),
                                              float(window) if window.replace(".", "").isdigit() else None)
        runs[(v, int(bench.parent.name[len(v) + 1:]))] = rows
columns = sorted(runs, key=lambda c: (variants.index(c[0]), c[1]))
if not columns:
    sys.exit()
cases = list(dict.fromkeys(case for c in columns for case in runs[c]))
for what, at in (("% of the same-run ceiling", 0), ("window, % of the same-run ceiling", 1)):
    heads = [f"{v} r{r}" for v, r in columns] + [f"{v} mean" for v in variants]
    print(f"\n{what}\n\n| row | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for case in cases:
        got = {c: runs[c][case][at] for c in columns if case in runs[c] and runs[c][case][at] is not None}
        cols = [f"{got[c]:.1f}" if c in got else "" for c in columns]
        for v in variants:
            mine = [x for c, x in got.items() if c[0] == v]
            cols.append(f"{sum(mine) / len(mine):.2f}" if mine else "")
        print(f"| {case} | " + " | ".join(cols) + " |")
EOF
exit $status
