#!/usr/bin/env bash
# The P/D-across-processes matrix of issue 16 on the GPUs of this host, with `kvshard pd`:
# 61 target layers + the MTP draft (latent and indexer), requests of 64 to 4,096 pages, the
# one-launch block copy at 8 to 132 CTAs, the copy-engine executor and the naive one copy per
# (page, layer) baseline, each next to the copy ceiling measured in the same run. Every first
# request of a case is verified block by block.
#
# - one GPU: prefill and decode as two processes on GPU 0 (same-device IPC), then CP2 (three
#   processes); the ceiling is the local D2D copy;
# - two or more GPUs: prefill on GPU 0 -> decode on GPU 1, then CP2 prefill on GPUs 0 and 1 ->
#   decode on GPU 1; the ceiling is the peer copy engine (cuMemcpyPeerAsync, GPU 0 -> GPU 1).
#   (`--gpus` names each rank's GPU, then the decode's.)
#
# Then the GPU tests of tests/pd_procs (two processes on one GPU: byte identity, VMM and legacy
# IPC pools, killed prefill, killed decode) with the GPU required.
#
# Writes $OUT/pd.md (every table), one .md and .log per run, topology.txt and tests.log.
# The kvshard binary: $KVSHARD, else .gpu/kvshard (scripts/stage-gpu.sh), else
# target/release/kvshard, else it is built (cargo, kernels required).
# Knobs: PAGES (default 64,512,2048), CTAS (132), CHUNK (pages per chunk of the chunked runs,
# 64), ITER (2), RUNS (run names to run, space-separated; default all), TESTS=0 (skip the
# tests). The defaults fit the GPU script's one-call budget (about a minute on one H200);
# FULL=1 is the whole matrix (pages 64 to 4,096, 8 to 132 CTAs, 3 iterations: over 8 minutes
# on one H200, so run it as a call of its own).
#
# `scripts/pd-gpu.sh stage` (where the crate builds) puts only what this script runs in .gpu/
# (git-ignored, a few MB: name it in the device tool's `carry`): kvshard and the pd_procs test.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = stage ]; then
  set -e
  cargo build --release -p kvshard-cli --features require-kernels --bin kvshard
  exe=$(cargo test --release -p kvshard-cli --features require-kernels --test pd_procs --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "pd_procs":
        print(m["executable"])')
  mkdir -p .gpu/tests
  cp target/release/kvshard .gpu/
  cp "$exe" .gpu/tests/pd_procs
  git rev-parse --short HEAD >.gpu/COMMIT 2>/dev/null || echo unknown >.gpu/COMMIT
  du -sh .gpu
  exit 0
fi
out="${OUT:-$PWD/pd-out}"
mkdir -p "$out"
status=0

bin="${KVSHARD:-}"
for candidate in .gpu/kvshard target/release/kvshard; do
  if [ -z "$bin" ] && [ -x "$candidate" ]; then bin="$candidate"; fi
done
if [ -z "$bin" ]; then
  cargo build --release -p kvshard-cli --features require-kernels --bin kvshard || exit 1
  bin=target/release/kvshard
fi
tests=""
if [ -x .gpu/tests/pd_procs ]; then tests=.gpu/tests/pd_procs; fi

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || cat .gpu/COMMIT 2>/dev/null)  $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  nvidia-smi topo -m
} >"$out/topology.txt" 2>&1
cat "$out/topology.txt"

if [ "${FULL:-0}" = 1 ]; then
  pages="${PAGES:-64,256,512,1024,2048,4096}"
  ctas="${CTAS:-8,16,32,64,132}"
  iter="${ITER:-3}"
else
  pages="${PAGES:-64,512,2048}"
  ctas="${CTAS:-132}"
  iter="${ITER:-2}"
fi
common=(--layers 61 --pages "$pages" --ctas "$ctas" --threads 512 --iterations "$iter")
# Every method in chunks of CHUNK pages; then the two bulk methods with each request in one
# chunk (what a prefill that sends after its last chunk does).
chunked=(--chunk-pages "${CHUNK:-64}" --methods blocks,ce,naive)
whole=(--chunk-pages 4096 --methods blocks,ce)

: >"$out/pd.md"
run() {
  local name="$1"
  shift
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then return; fi
  echo "=== $name: $bin pd ${common[*]} $*"
  if "$bin" pd "${common[@]}" "$@" --markdown "$out/$name.md" >"$out/$name.log" 2>&1; then
    r=ok
  else
    r=FAILED
    status=1
  fi
  tail -n 20 "$out/$name.log"
  { echo "## $name ($r)"; echo; echo "\`kvshard pd ${common[*]} $*\`"; echo;
    cat "$out/$name.md" 2>/dev/null; echo; } >>"$out/pd.md"
}

if [ "$gpus" -ge 2 ]; then
  run pd-gpu0-to-gpu1 --ranks 1 --gpus 0,1 "${chunked[@]}"
  run pd-gpu0-to-gpu1-whole --ranks 1 --gpus 0,1 "${whole[@]}"
  run pd-cp2-gpus01-to-gpu1 --ranks 2 --gpus 0,1,1 "${chunked[@]}"
  run pd-cp2-gpus01-to-gpu1-whole --ranks 2 --gpus 0,1,1 "${whole[@]}"
  run pd-same-gpu --ranks 1 --gpus 0,0 "${chunked[@]}"
elif [ "$gpus" -eq 1 ]; then
  run pd-one-gpu --ranks 1 --gpus 0,0 "${chunked[@]}"
  run pd-one-gpu-whole --ranks 1 --gpus 0,0 "${whole[@]}"
  run pd-one-gpu-cp2 --ranks 2 --gpus 0,0,0 "${chunked[@]}"
else
  echo "no GPU: nothing to run" | tee -a "$out/pd.md"
  exit 1
fi

if [ "${TESTS:-1}" = 0 ]; then
  :
elif [ -n "$tests" ]; then
  if KVSHARD_REQUIRE_GPU=1 "$tests" gpu_ --test-threads=1 >"$out/tests.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
  echo "tests/pd_procs gpu_: $r ($(grep -E '^test result' "$out/tests.log" | tail -1))" | tee -a "$out/pd.md"
elif command -v cargo >/dev/null; then
  if KVSHARD_REQUIRE_GPU=1 cargo test --release -p kvshard-cli --features require-kernels --test pd_procs -- gpu_ --test-threads=1 >"$out/tests.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
  echo "tests/pd_procs gpu_: $r ($(grep -E '^test result' "$out/tests.log" | tail -1))" | tee -a "$out/pd.md"
fi
cat "$out/pd.md"
exit $status
