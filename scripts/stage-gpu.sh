#!/usr/bin/env bash
# Builds every test and benchmark binary in release mode with kernels required (the library's and
# the applications', cli/), and stages them, with the kvshard binary and scripts/run-gpu.sh, in
# .gpu/ (git-ignored). A GPU host needs no
# Rust: copy what its steps need from .gpu-pack/ there (or name those files in the device tool's
# `carry`), run scripts/unpack-gpu.sh, then `.gpu/run-gpu.sh`.
# Binaries built on Debian 12 need glibc >= 2.34 and only libc/libgcc_s; libcuda is loaded at
# run time.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=.gpu
rm -rf "$stage"
mkdir -p "$stage/tests" "$stage/benches"

list() {
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"])
'
}

# Both crates have these features (kvshard-cli forwards them to kvshard); the workspace's
# default members are the library and the applications.
features="require-kernels nccl"
# The command line also with `nixl` (NIXL is loaded at run time: without it the storage step
# and `kvshard storage-bench` say so), for the `storage` step of run-gpu.sh.
cargo build --release -p kvshard-cli --features "$features nixl" --bin kvshard
cp target/release/kvshard "$stage/"
cargo test --release --features "$features" --no-run --message-format=json 2>/dev/null | list |
  while read -r kind name exe; do
    case "$kind" in
      # Each crate's unit tests: unit-kvshard, unit-kvshard_cli.
      lib) cp "$exe" "$stage/tests/unit-$name" ;;
      # The bindings check needs libclang and the source tree: it runs where the crate is built.
      test) [ "$name" = bindings ] || cp "$exe" "$stage/tests/$name" ;;
    esac
  done
# The storage tier's test binaries (feature `nixl`), run by run-gpu.sh's `storage` step with the
# staged NIXL runtime: their gpu_* cases order the store after work queued on the GPU (reload:
# a prefix reloaded from disk by another parallelism, against the CPU twin).
mkdir -p "$stage/storage-tests"
cargo test --release -p kvshard --features "$features nixl" --test storage --test faults_storage --test reload \
  --no-run --message-format=json 2>/dev/null | list |
  while read -r kind name exe; do
    if [ "$kind" = test ]; then cp "$exe" "$stage/storage-tests/$name"; fi
  done
# The benchmark kernels and gpu::bench exist only with `bench-kernels`; the tests above run the
# fatbin engines get, without them.
cargo bench -p kvshard-cli --features "$features bench-kernels" --no-run --message-format=json 2>/dev/null | list |
  while read -r kind name exe; do
    # Only the GPU benchmark (the applications' crate holds it: it measures with their
    # measurement module); the library's criterion benches measure CPU paths, here.
    # (an `if`: a false test as the loop's last command would fail the pipeline)
    if [ "$kind" = bench ] && [ "$name" = gpu ]; then cp "$exe" "$stage/benches/$name"; fi
  done
cp scripts/run-gpu.sh "$stage/"
# The storage step's NIXL runtime is scripts/stage-nixl.sh's (.gpu-nixl, with the POSIX plugin;
# ~35 MB, carried beside .gpu). With KVSHARD_STAGE_FIO=1, Debian's fio with its libraries
# (glibc and libstdc++ excepted: every host has them; install it with `apt-get install -y
# --no-install-recommends fio`: the recommended ibverbs-providers make UCX crash NIXL processes
# at exit here) as fio.tar.xz (~21 MB; the GPU host has no
# network to install it): the same-run ceiling of `kvshard storage-bench`.
if [ "${KVSHARD_STAGE_FIO:-0}" = 1 ]; then
  fio_bin="$(command -v fio)" || { echo "stage-gpu: KVSHARD_STAGE_FIO=1 but no fio (apt-get install -y --no-install-recommends fio)" >&2; exit 1; }
  tmp="$(mktemp -d)"
  mkdir -p "$tmp/lib"
  cp "$fio_bin" "$tmp/"
  ldd "$fio_bin" | awk '/=>/ {print $1, $3}' | while read -r name path; do
    case "$name" in
      libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|ld-linux*|libgcc_s*|libstdc++*) ;;
      *) [ -f "$path" ] && cp -L "$path" "$tmp/lib/" ;;
    esac
  done
  strip --strip-unneeded "$tmp/fio" "$tmp"/lib/* 2>/dev/null || true
  tar -C "$tmp" -cJf "$stage/fio.tar.xz" .
  rm -rf "$tmp"
fi
# The Python wheel (abi3, kernels embedded, the storage tier for kvshard.sglang_storage) for the
# GPU pytest and its benchmark.
venv=target/python-ci-venv
[ -x "$venv/bin/maturin" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install --quiet "maturin==1.16.*"; }
rm -f target/wheels/kvshard-*.whl
"$venv/bin/maturin" build --release --features "require-kernels nixl" -m python/Cargo.toml --quiet
cp target/wheels/kvshard-*.whl "$stage/"
# The Mooncake runtime for the `mooncake` step: the CUDA 13 engine and what it loads, ~12 MB
# compressed (scripts/stage-mooncake.sh says why not the 50 MB wheel).
scripts/stage-mooncake.sh "$stage/mooncake.tar.xz" >/dev/null
# Symbols are not needed there, and the device tool carries at most 64 MiB.
find "$stage" -type f -perm -u+x ! -name '*.sh' -exec strip --strip-unneeded {} +
git rev-parse --short HEAD >"$stage/COMMIT" 2>/dev/null || echo unknown >"$stage/COMMIT"
du -sh "$stage"
# Stripped, the binaries still exceed the device tool's 64 MiB (each embeds the fatbin): they
# travel as one xz archive, about a quarter of their size (~13 MB). fio's and Mooncake's
# runtimes (xz archives already, ~21 and ~12 MB) and the wheel (~2.5 MB) go beside it, not in
# it: all of it with NIXL's (~9 MB) and the working tree comes near 64 MiB, so a run carries
# only what its steps use (storage: fio and nixl; mooncake: mooncake; python and sglang: the
# wheel). On the GPU host:
#   scripts/unpack-gpu.sh && .gpu/run-gpu.sh STEPS
rm -rf .gpu-pack/gpu.tar.xz .gpu-pack/fio.tar.xz .gpu-pack/mooncake.tar.xz .gpu-pack/kvshard-*.whl
mkdir -p .gpu-pack
tar --exclude="$stage/fio.tar.xz" --exclude="$stage/mooncake.tar.xz" --exclude="$stage/*.whl" \
  -cf - "$stage" | xz -T0 -6 >.gpu-pack/gpu.tar.xz
for side in "$stage"/fio.tar.xz "$stage"/mooncake.tar.xz "$stage"/kvshard-*.whl; do
  if [ -f "$side" ]; then cp "$side" .gpu-pack/; fi
done
du -sh .gpu-pack/*
ls "$stage/tests" "$stage/benches"
