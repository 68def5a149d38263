#!/usr/bin/env bash
# Kernel variants side by side on a GPU host in one call: builds, for each NAME=REF (a git commit,
# branch or tag), the GPU benchmark binary and the dcp test binary of that commit (release,
# kernels required, as scripts/stage-gpu.sh builds them), each in a worktree of its own under
# target/ab/ with one target directory for all (between two refs only the workspace's crates
# rebuild), and packs them with scripts/run-ab.sh as .gpu-pack/ab.tar.xz (.gpu-ab/NAME/{gpu,dcp},
# and .gpu-ab/REFS: each name's commit and its decode kernels' registers and spills). On the GPU
# host: `tar -xJf .gpu-pack/ab.tar.xz && OUT=... .gpu-ab/run-ab.sh [-- BENCH ARGS]`.
# Usage: scripts/stage-ab.sh NAME=REF [NAME=REF ...]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: scripts/stage-ab.sh NAME=REF [NAME=REF ...]" >&2; exit 2; }
stage=.gpu-ab
trees=target/ab/trees
export CARGO_TARGET_DIR="$PWD/target/ab/target"
features="require-kernels nccl"

# From cargo's JSON messages on stdin: `exe NAME KIND`, the executable of that artifact; `out`,
# the library's build-script output directory (where build.rs left its register table).
from_json() {
  python3 -c '
import json, re, sys
for line in sys.stdin:
    m = json.loads(line)
    if sys.argv[1] == "exe":
        if m.get("reason") == "compiler-artifact" and m.get("executable") and \
                m["target"]["name"] == sys.argv[2] and m["target"]["kind"][0] == sys.argv[3]:
            print(m["executable"])
    elif m.get("reason") == "build-script-executed" and re.search(r"[#/ ]kvshard[@ #]", m["package_id"]):
        print(m["out_dir"])
' "$@"
}

# Every argument is checked before the first build.
names=()
commits=()
for arg in "$@"; do
  name=${arg%%=*}
  ref=${arg#*=}
  if [ "$name" = "$arg" ] || ! [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]]; then
    echo "stage-ab: '$arg' is not NAME=REF (NAME: letters, digits, - and _)" >&2
    exit 2
  fi
  commit=$(git rev-parse --verify --quiet "$ref^{commit}") || { echo "stage-ab: no commit '$ref'" >&2; exit 2; }
  names+=("$name")
  commits+=("$commit")
done

rm -rf "$stage"
mkdir -p "$stage" "$trees" "$CARGO_TARGET_DIR"
# The worktrees go however the script ends (a failed build included).
trap 'for t in "$trees"/*/; do [ -d "$t" ] && git worktree remove --force "$t"; done; git worktree prune' EXIT
for i in "${!names[@]}"; do
  name=${names[$i]}
  commit=${commits[$i]}
  tree="$trees/$name"
  git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
  git worktree add --quiet --detach "$tree" "$commit"
  mkdir -p "$stage/$name"
  log="$CARGO_TARGET_DIR/ab-$name.log"
  echo "stage-ab: $name = $(git log -1 --format='%h %s' "$commit")"
  json="$CARGO_TARGET_DIR/ab-$name.json"
  if ! (cd "$tree" &&
    cargo bench -p kvshard-cli --features "$features bench-kernels" --no-run --message-format=json >"$json" 2>"$log" &&
    cargo test --release -p kvshard --features "$features" --test dcp --no-run --message-format=json >>"$json" 2>>"$log"); then
    tail -30 "$log" >&2
    echo "stage-ab: $name did not build (log: $log)" >&2
    exit 1
  fi
  for artifact in gpu:bench dcp:test; do
    bin=${artifact%%:*}
    path=$(from_json exe "$bin" "${artifact#*:}" <"$json" | tail -1)
    [ -x "$path" ] || { echo "stage-ab: $name: cargo named no $bin binary (log: $log)" >&2; exit 1; }
    cp "$path" "$stage/$name/$bin"
  done
  # The register table build.rs wrote for the fatbin these binaries embed.
  out=$(from_json out <"$json" | tail -1)
  {
    echo "$name $commit $(git log -1 --format=%s "$commit")"
    grep -E '^kvs_decode_scatter' "$out/resource-usage.txt" | sed 's/^/    /'
  } >>"$stage/REFS"
  git worktree remove --force "$tree"
done
cp scripts/run-ab.sh "$stage/"
mkdir -p .gpu-pack
rm -f .gpu-pack/ab.tar.xz
tar -cf - "$stage" | xz -T0 -6 >.gpu-pack/ab.tar.xz
du -sh .gpu-pack/ab.tar.xz
