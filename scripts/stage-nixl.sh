#!/usr/bin/env bash
# Stages what the NIXL tests and benchmark need on a GPU host with no Rust and no network into
# OUTDIR (argument 1, default .gpu-nixl, git-ignored through .git/info/exclude by the caller):
#   OUTDIR/nixl-test   the tests/nixl.rs binary (release, kernels required, feature nixl), stripped
#   OUTDIR/lib         libnixl_capi.so and every library it and the UCX plugin load (stripped)
#   OUTDIR/ucx         UCX's transport modules of one host (CUDA copy and IPC, CMA; no InfiniBand)
#   OUTDIR/plugins     NIXL's UCX plugin, and its POSIX plugin (the storage tier's backend)
#   OUTDIR/env.sh      sets LD_LIBRARY_PATH, NIXL_PLUGIN_DIR and UCX_MODULE_DIR from its folder
# About 35 MB: under the device tool's 64 MiB carry limit (the wheel's full 139 MB is not).
# The libraries need the driver's libcuda (and libnvidia-ml for UCX's CUDA modules) on the host.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-.gpu-nixl}"
nixl="$(scripts/install-nixl.sh)"
wheel="$(dirname "$nixl")/nixl_cu13.libs"
CUDA_HOME="${CUDA_HOME:-$(scripts/install-cuda.sh)}"
export CUDA_HOME

rm -rf "$out"
mkdir -p "$out/lib" "$out/ucx" "$out/plugins"
bin="$(cargo test --release -p kvshard --features "require-kernels nixl" --test nixl --no-run \
  --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"])' | tail -1)"
[[ -x "$bin" ]] || { echo "stage-nixl: the nixl test binary did not build" >&2; exit 1; }
cp "$bin" "$out/nixl-test"

modules=(libuct_cuda.so.0.0.0 libucm_cuda.so.0.0.0 libuct_cma.so.0.0.0)
for m in "${modules[@]}"; do cp "$wheel/ucx/$m" "$out/ucx/"; done
cp "$wheel/nixl/libplugin_UCX.so" "$out/plugins/"
# The storage tier's backend (liburing and libaio bundled beside it in the wheel).
cp "$wheel/nixl/libplugin_POSIX.so" "$out/plugins/"
cp "$nixl/libnixl_capi.so" "$out/lib/"
# Every library the C API, the plugin and the modules load from the wheel (not the system's).
for f in "$nixl/libnixl_capi.so" "$out"/plugins/*.so "$out"/ucx/*.so*; do
  LD_LIBRARY_PATH="$nixl:$wheel" ldd "$f" | awk '/=>/ {print $3}' |
    grep -F -e "$nixl" -e "$wheel" || true
done | sort -u | xargs -r -I{} cp {} "$out/lib/"
strip --strip-unneeded "$out/nixl-test" "$out"/lib/*.so* "$out"/ucx/*.so* "$out"/plugins/*.so \
  2>/dev/null || true

cat >"$out/env.sh" <<'EOF'
# Source me: the staged NIXL runtime, wherever this folder was copied.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$here/plugins"
export UCX_MODULE_DIR="$here/ucx"
EOF
du -sh "$out" >&2
echo "$out"
