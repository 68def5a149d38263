#!/usr/bin/env bash
# On the GPU host, from the repository root: unpacks what scripts/stage-gpu.sh and
# scripts/stage-nixl.sh left in .gpu-pack/ (whichever of their files were carried): the staged
# binaries into .gpu/, fio's and Mooncake's runtimes and the wheel beside them, NIXL's runtime
# into .gpu-nixl/. Then `.gpu/run-gpu.sh STEPS`.
set -euo pipefail
cd "$(dirname "$0")/.."
pack=.gpu-pack
[ -f "$pack/gpu.tar.xz" ] || { echo "unpack-gpu: no $pack/gpu.tar.xz (scripts/stage-gpu.sh makes it)" >&2; exit 1; }
tar -xJf "$pack/gpu.tar.xz"
for side in "$pack"/fio.tar.xz "$pack"/mooncake.tar.xz "$pack"/kvshard-*.whl; do
  if [ -f "$side" ]; then cp "$side" .gpu/; fi
done
if [ -f "$pack/nixl.tar.xz" ]; then tar -xJf "$pack/nixl.tar.xz"; fi
echo "unpacked: commit $(cat .gpu/COMMIT), $(ls .gpu | tr '\n' ' ')"
