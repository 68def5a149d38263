#!/usr/bin/env bash
# Runs the Python package's tests (GPU required) and, with --bench, python/bench.py, on a GPU
# machine from a wheel built elsewhere, with the machine's own Python, PyTorch, NumPy and pytest.
#
#   python/run-gpu-tests.sh WHEEL [--bench] [pytest args...]
#
# Installs WHEEL without dependencies or index into a private folder (nothing else on the
# machine changes), puts it first on PYTHONPATH, and runs from the repository root, so the
# source tree's python/kvshard (which has no native module) is never imported. Logs and the
# benchmark's bench-python.{md,json} go to $OUT (default: ./gpu-python-out).
set -euo pipefail
cd "$(dirname "$0")/.."

wheel="${1:?usage: python/run-gpu-tests.sh WHEEL [--bench] [pytest args...]}"
shift
bench=0
if [[ "${1:-}" == "--bench" ]]; then
  bench=1
  shift
fi
out="${OUT:-$PWD/gpu-python-out}"
mkdir -p "$out"
site="$(mktemp -d /tmp/kvshard-site.XXXXXX)"
# A wheel is a zip: without pip, unpacking it is the same install.
python3 -m pip install --quiet --no-index --no-deps --target "$site" "$wheel" ||
  python3 -m zipfile -e "$wheel" "$site"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# GPU tests fail instead of skipping when anything they need is missing.
export KVSHARD_REQUIRE_GPU=1

python3 - <<'PY' 2>&1 | tee "$out/env.log"
import kvshard, sys
print("kvshard", kvshard.__version__, "from", kvshard.__file__)
print("embedded kernels:", kvshard.backend.embedded_archs(), "| driver:", kvshard.backend.driver_present())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0))
except Exception as e:
    print("torch unavailable:", e)
print("python", sys.version.split()[0])
PY

status=0
python3 -m pytest python/tests -v -rs "$@" 2>&1 | tee "$out/pytest.log" || status=$?
if [[ $bench == 1 ]]; then
  # -P: the script's folder (python/, with the source package) does not go first on sys.path.
  python3 -P python/bench.py --out "$out" 2>&1 | tee "$out/bench.log" || status=$?
fi
rm -rf "$site"
exit $status
