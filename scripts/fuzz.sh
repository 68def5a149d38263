#!/usr/bin/env bash
# Runs every cargo-fuzz target on the stable toolchain for SECONDS each (default 12: the whole
# set stays inside CI's 60-second budget), starting from the corpus committed under fuzz/corpus.
# New inputs go to target/fuzz-corpus/TARGET (git-ignored), so a CI run leaves the checkout
# clean; FUZZ_GROW=1 writes them into fuzz/corpus instead, to commit after a long run.
# A crash fails the run and leaves its input under fuzz/artifacts/TARGET/.
# Longer runs: FUZZ_GROW=1 scripts/fuzz.sh 3600, or one target: scripts/fuzz.sh 600 send_plan.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-12}"
shift || true
if ! command -v cargo-fuzz >/dev/null; then
  cargo install cargo-fuzz --locked --version 0.13.2 >&2
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cd fuzz && cargo fuzz list)
fi
# cargo-fuzz needs nightly-only compiler flags; RUSTC_BOOTSTRAP lets the stable toolchain take
# them. No sanitizer: the crate has no C code, and Rust's own checks are what we fuzz for.
export RUSTC_BOOTSTRAP=1
cargo fuzz build --sanitizer none -O
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  # libFuzzer writes new inputs into the first corpus folder it is given.
  corpora=("fuzz/corpus/$t")
  if [ "${FUZZ_GROW:-0}" != 1 ]; then
    mkdir -p "target/fuzz-corpus/$t"
    corpora=("target/fuzz-corpus/$t" "fuzz/corpus/$t")
  fi
  echo "fuzz $t for ${seconds}s"
  cargo fuzz run --sanitizer none -O "$t" "${corpora[@]}" -- -max_total_time="$seconds" 2>&1 | grep -E "^Done|panicked|ERROR|SUMMARY" || true
  # cargo fuzz run exits non-zero on a crash; PIPESTATUS keeps that visible under pipefail.
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "fuzz target $t FAILED" >&2; exit 1; }
done
