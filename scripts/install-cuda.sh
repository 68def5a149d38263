#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler wheels (nvcc, nvvm, crt, runtime headers, cccl) from PyPI
# into PREFIX (argument 1, else $KVSHARD_CUDA_PREFIX, else ~/.cache/kvshard/cuda-13.0) and prints
# the CUDA_HOME to use. Idempotent: a complete install is detected by a stamp file and reused.
#
# Why wheels: Debian's nvidia-cuda-toolkit is CUDA 11.8 (no sm_100/sm_103). Why all five in ONE pip
# call with --no-deps: a second `--target --upgrade` call wipes the first one's nvidia/ tree, and
# nvcc's own dependencies are unpinned and would pull mismatched newer wheels. Why 13.0.x: PTX from
# newer nvcc is rejected by the H200's driver 580.
set -euo pipefail

prefix="${1:-${KVSHARD_CUDA_PREFIX:-$HOME/.cache/kvshard/cuda-13.0}}"
pins=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.88
  nvidia-cuda-cccl==13.0.85
)
stamp="$prefix/.kvshard-installed"
cuda_home="$prefix/nvidia/cu13"

if [[ -f "$stamp" && "$(cat "$stamp")" == "${pins[*]}" && -x "$cuda_home/bin/nvcc" ]]; then
  echo "$cuda_home"
  exit 0
fi

rm -rf "$prefix"
mkdir -p "$prefix"
python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$prefix" "${pins[@]}" >&2
# Some wheels ship the compiler's helper programs without the executable bit.
find "$cuda_home/bin" "$cuda_home/nvvm/bin" -type f -exec chmod +x {} + 2>/dev/null || true
"$cuda_home/bin/nvcc" --version >&2
echo "${pins[*]}" >"$stamp"
echo "$cuda_home"
