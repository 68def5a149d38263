#!/usr/bin/env bash
# Stages what the NIXL tests and benchmark need on a GPU host with no Rust and no network into
# OUTDIR (argument 1, default .gpu-nixl, git-ignored through .git/info/exclude by the caller):
#   OUTDIR/nixl-test   the tests/nixl.rs binary (release, kernels required, feature nixl), stripped
#   OUTDIR/lib         libnixl_capi.so and every library it and the UCX plugin load (stripped)
#   OUTDIR/ucx         UCX's transport modules of one host (CUDA copy and IPC, CMA; no InfiniBand)
#   OUTDIR/plugins     NIXL's UCX plugin, its POSIX plugin (the storage tier's backend) and its
#                      GDS and GDS_MT plugins (GPUDirect Storage through cuFile)
#   OUTDIR/lib         also libcufile.so.0 (PyPI's nvidia-cufile wheel: NIXL does not bundle it)
#                      and libcudart.so.13, which the GDS plugins load
#   OUTDIR/cufile.json cuFile's settings: compat mode allowed (no nvidia-fs module needed)
#   OUTDIR/env.sh      sets LD_LIBRARY_PATH, NIXL_PLUGIN_DIR and UCX_MODULE_DIR from its folder,
#                      and CUFILE_ENV_PATH_JSON (unless set) and CUFILE_LOGFILE_PATH
# About 40 MB: under the device tool's 64 MiB carry limit (the wheel's full 139 MB is not).
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
# GPUDirect Storage: NIXL's GDS plugins, libcufile from its PyPI wheel (downloaded once into
# the cache), the CUDA 13 runtime they load.
cp "$wheel/nixl/libplugin_GDS.so" "$wheel/nixl/libplugin_GDS_MT.so" "$out/plugins/"
cufile_cache="${HOME}/.cache/kvshard/cufile"
cufile_whl="$(ls "$cufile_cache"/nvidia_cufile-1.19.1.55-*.whl 2>/dev/null | head -1 || true)"
if [ -z "$cufile_whl" ]; then
  python3 -m pip download -q nvidia-cufile==1.19.1.55 --no-deps -d "$cufile_cache" >&2
  cufile_whl="$(ls "$cufile_cache"/nvidia_cufile-1.19.1.55-*.whl | head -1)"
fi
python3 - "$cufile_whl" "$out/lib" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith("/libcufile.so.0"))
    with open(sys.argv[2] + "/libcufile.so.0", "wb") as f:
        f.write(z.read(name))
PY
cp "$(find "$CUDA_HOME" -name 'libcudart.so.13' | head -1)" "$out/lib/"
cat >"$out/cufile.json" <<'JSON'
{
  "logging": { "level": "ERROR" },
  "properties": { "allow_compat_mode": true }
}
JSON
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
# cuFile: compat mode allowed (hosts without the nvidia-fs module), its log out of the way.
export CUFILE_ENV_PATH_JSON="${CUFILE_ENV_PATH_JSON:-$here/cufile.json}"
export CUFILE_LOGFILE_PATH="${CUFILE_LOGFILE_PATH:-/tmp/kvshard-cufile.log}"
EOF
du -sh "$out" >&2
# For the device tool's `carry` (scripts/stage-gpu.sh says why apart): unpacked at the
# repository root by scripts/unpack-gpu.sh.
mkdir -p .gpu-pack
tar -cf - "$out" | xz -T0 -6 >.gpu-pack/nixl.tar.xz
echo "$out"
