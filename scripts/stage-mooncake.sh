#!/usr/bin/env bash
# Stages the smallest Mooncake runtime the GPU step needs (`run-gpu.sh mooncake`) as one
# archive, OUT (argument 1, default .gpu/mooncake.tar.xz): the GPU host has no network and the
# device tool carries at most 64 MiB, and the CUDA 13 wheel is 50 MB (172 MB unpacked: the
# store, the EP kernels, the master and client binaries, none of which the transfer engine
# loads). The archive holds:
#   site/mooncake/{__init__.py,engine.so,libasio.so,libetcd_wrapper.so}  the engine's module
#   site/mooncake_transfer_engine_cuda13.libs/   the bundled libraries engine.so loads
#   sys/   the system libraries it loads beyond glibc, libstdc++ and the driver (libibverbs,
#          libmlx5, libnuma, libcurl and theirs; libcudart 13), from this machine, for a host
#          that lacks them: run-gpu.sh puts on LD_LIBRARY_PATH only those the host cannot find.
# libetcd_wrapper.so (19 MB) is loaded though P2PHANDSHAKE never calls it: engine.so names it.
# Compressed with xz: about a quarter of the raw size.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-.gpu/mooncake.tar.xz}"
version=0.3.14
# The GPU host's Python (3.12; MOONCAKE_PY=311 for this machine's, to try the set here): the
# engine module is built per CPython version.
py="${MOONCAKE_PY:-312}"
cache=target/mooncake-wheel
wheel="$cache/mooncake_transfer_engine_cuda13-$version-cp$py-cp$py-manylinux_2_28_x86_64.whl"
[ -f "$wheel" ] || python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${py:0:1}.${py:1}" \
  -d "$cache" "mooncake-transfer-engine-cuda13==$version"
CUDA_HOME="${CUDA_HOME:-$(scripts/install-cuda.sh)}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m zipfile -e "$wheel" "$work/wheel"
site="$work/stage/site"
mkdir -p "$site/mooncake" "$site/mooncake_transfer_engine_cuda13.libs" "$work/stage/sys"
for f in __init__.py engine.so libasio.so libetcd_wrapper.so; do cp "$work/wheel/mooncake/$f" "$site/mooncake/"; done
libs="$work/wheel/mooncake_transfer_engine_cuda13.libs"
# libmlx5 (which engine.so names) comes from ibverbs-providers, unpacked under target/ rather
# than installed: installed, its providers sit beside the libnl that NIXL's bundled UCX also
# carries, and every NIXL process of this machine then crashes at exit in libnl's destructor.
providers="$cache/ibverbs-providers"
if ! ldconfig -p | grep -q 'libmlx5\.so\.1 '; then
  if [ ! -d "$providers/usr" ]; then
    mkdir -p "$providers"
    (cd "$providers" && apt-get download ibverbs-providers >/dev/null && dpkg -x ibverbs-providers_*.deb .)
  fi
  extra="$(realpath "$providers")/usr/lib/x86_64-linux-gnu"
fi
# Every library engine.so loads, resolved here: the wheel's go to site/, the system's to sys/.
LD_LIBRARY_PATH="$CUDA_HOME/lib${extra:+:$extra}" ldd "$work/wheel/mooncake/engine.so" | awk '/=>/ && $3 ~ /^\// {print $3}' |
  while read -r link; do
    lib="$(realpath "$link")"
    case "$(basename "$link")" in
      libc.so.* | libm.so.* | libdl.so.* | librt.so.* | libpthread.so.* | libresolv.so.* | \
        libstdc++.so.* | libgcc_s.so.* | libcuda.so.* | ld-linux*) ;;
      *)
        case "$lib" in
          "$libs"/*) cp "$lib" "$site/mooncake_transfer_engine_cuda13.libs/" ;;
          "$work"/*) ;;
          # Under the name the loader asks for (the soname), not the versioned file's.
          *) cp "$lib" "$work/stage/sys/$(basename "$link")" ;;
        esac
        ;;
    esac
  done
[ -f "$work/stage/sys/libibverbs.so.1" ] || { echo "stage-mooncake: install libibverbs1, libnuma1, libcurl4 here first" >&2; exit 1; }
[ -f "$work/stage/sys/libmlx5.so.1" ] || { echo "stage-mooncake: libmlx5 was not found (apt-get download ibverbs-providers failed?)" >&2; exit 1; }
strip --strip-unneeded "$work"/stage/sys/* 2>/dev/null || true
mkdir -p "$(dirname "$out")"
tar -C "$work/stage" -cJf "$out" site sys
du -h "$out" >&2
echo "$out"
