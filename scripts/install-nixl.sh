#!/usr/bin/env bash
# Installs the NIXL runtime (the `nixl-cu13` PyPI wheel: libnixl, its C API libnixl_capi, UCX with
# its CUDA transports, and the backend plugins) into PREFIX (argument 1, else $KVSHARD_NIXL_PREFIX,
# else ~/.cache/kvshard/nixl-1.5) and prints the folder holding libnixl_capi.so: put it on
# LD_LIBRARY_PATH for anything built with `--features nixl` (kvshard loads the library at run time
# and says what to install when it is missing). Idempotent: a complete install is reused.
#
# Why a wheel: NIXL has no Debian package; the wheel is what vLLM and SGLang install. The wheel
# ships neither libcudart nor libcufile: on a GPU host the driver's libcuda is enough for UCX's
# CUDA transports (cuda_copy, cuda_ipc); DRAM-only use (CI) needs no CUDA at all.
#
# `--plugins` as argument 2 prints the plugin folder instead (NIXL_PLUGIN_DIR, which the kvshard
# transport sets itself when it is unset).
set -euo pipefail

prefix="${1:-${KVSHARD_NIXL_PREFIX:-$HOME/.cache/kvshard/nixl-1.5}}"
what="${2:-lib}"
pin="nixl-cu13==1.5.1"
stamp="$prefix/.kvshard-installed"
lib="$prefix/.nixl_cu13.mesonpy.libs"
plugins="$prefix/nixl_cu13.libs/nixl"

print() {
  if [[ "$what" == "--plugins" ]]; then echo "$plugins"; else echo "$lib"; fi
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$pin" && -f "$lib/libnixl_capi.so" ]]; then
  print
  exit 0
fi

rm -rf "$prefix"
mkdir -p "$prefix"
# --no-deps: the wheel's own dependencies are the Python API's (numpy, torch extras), not the
# libraries; the C API and UCX are inside the wheel.
python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$prefix" "$pin" >&2
# The torch extension modules (nixl_ep, ~90 MB) are never loaded by kvshard: dropping them keeps
# the prefix small enough to carry to a GPU host.
rm -rf "$prefix"/nixl_ep_cu13* "$prefix"/bin
for f in libnixl_capi.so libnixl.so; do
  [[ -f "$lib/$f" ]] || { echo "install-nixl: $f missing from $pin (layout changed?)" >&2; exit 1; }
done
[[ -f "$plugins/libplugin_UCX.so" ]] || { echo "install-nixl: UCX plugin missing" >&2; exit 1; }
echo "$pin" >"$stamp"
print
