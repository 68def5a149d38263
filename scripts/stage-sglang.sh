#!/usr/bin/env bash
# Stages into STAGE (argument 1, default .gpu-sglang, git-ignored) what the GPU host needs to run
# python/sglang_bench.py (the `sglang` step of scripts/run-gpu.sh) and lacks: it has Python 3.12,
# torch 2.11, Triton, nvcc 13.0 and matplotlib, no SGLang and no network.
#
#   wheels/sglang-0.5.23-cpXY-...whl  SGLang's wheel for that CPython, SLIMMED and repacked as a
#        wheel: only the files the benchmark imports on a CUDA host (python/sglang_bench.py
#        --imports-on-cuda, run here with torch's CUDA queries answered as an H200's) and the
#        sources its JIT HiCache kernels compile from (sglang/kernels/jit/include,
#        sglang/kernels/jit/csrc/kvcacheio), byte-identical to the wheel's; its Rust extensions,
#        models, multimodal and server code dropped; RECORD rewritten for what is kept.
#   wheels/apache_tvm_ffi-*.whl       the JIT kernels' loader (binary, per CPython).
#   wheels/*.whl                      every other distribution those imports load that the GPU
#        host's image does not have (/work/.library/device/KINDS.md's list, HOST_HAS below), at
#        the versions of the pinned test environment (scripts/install-sglang.sh).
#   kvshard-*.whl                     kvshard's wheel, built as scripts/stage-gpu.sh builds it.
#   run.sh                            runs the step: scripts/run-gpu.sh sglang.
#
# Downloads with `pip download --no-deps --only-binary=:all:` for CPython $PY (default 312, the
# GPU host's; PY=311 stages this machine's version, which scripts/run-gpu.sh's step then installs
# and imports here the same way: the CPU check of the step). Prints the folder's size (it must stay
# under ~30 MB: the device tool carries 64 MiB in all).
set -euo pipefail
cd "$(dirname "$0")/.."

stage="${1:-.gpu-sglang}"
py="${PY:-312}"
pyver="${py:0:1}.${py:1}"
venv="$(scripts/install-sglang.sh)"

# What the GPU host's image has (KINDS.md, "Python packages already there"): never staged.
HOST_HAS=" absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp "
# One line, each name between spaces.
HOST_HAS=" $(tr '\n' ' ' <<<"$HOST_HAS") "
norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }

# kvshard's wheel (the benchmark imports kvshard.sglang.adapter), built as stage-gpu.sh builds it,
# and installed into the test environment for the import trace below.
ci_venv=target/python-ci-venv
[ -x "$ci_venv/bin/maturin" ] || { python3 -m venv "$ci_venv" && "$ci_venv/bin/pip" install --quiet "maturin==1.16.*"; }
rm -f target/wheels/kvshard-*.whl
"$ci_venv/bin/maturin" build --release --features "require-kernels nixl" -m python/Cargo.toml --quiet
"$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps target/wheels/kvshard-*.whl

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The files SGLang's modules load on a CUDA host, and the distributions of every module loaded.
"$venv/bin/python" -W ignore -P python/sglang_bench.py --imports-on-cuda >"$work/trace" 2>"$work/trace.log" ||
  { cat "$work/trace.log" >&2; exit 1; }
sed -n 's/^file //p' "$work/trace" >"$work/files"
sed -n 's/^dist //p' "$work/trace" >"$work/dists"
site="$("$venv/bin/python" -c 'import sglang, os; print(os.path.dirname(os.path.dirname(sglang.__file__)))')"
rm -rf "$stage"
mkdir -p "$stage/wheels"
download() {
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform any -d "$1" "$2"
}
while read -r pin; do
  name="${pin%%==*}"
  case "$(norm "$name")" in
    sglang | kvshard) continue ;;
  esac
  [[ "$HOST_HAS" == *" $(norm "$name") "* ]] && continue
  download "$stage/wheels" "$pin"
done <"$work/dists"

# SGLang's wheel, slimmed: the imported files and the JIT sources, byte-identical.
download "$work/full" sglang==0.5.23
wheel="$(ls "$work"/full/sglang-0.5.23-*.whl)"
python3 - "$wheel" "$work/files" "$site" "$stage/wheels" <<'PY'
import base64, hashlib, os, sys, zipfile
wheel, listing, site, out = sys.argv[1:]
keep = {os.path.relpath(f, site) for f in open(listing).read().split()}
jit = ("sglang/kernels/jit/include/", "sglang/kernels/jit/csrc/kvcacheio/")
src = zipfile.ZipFile(wheel)
dist_info = next(n.split("/")[0] for n in src.namelist() if n.split("/")[0].endswith(".dist-info"))
kept, record = [], []
dst = zipfile.ZipFile(os.path.join(out, os.path.basename(wheel)), "w", zipfile.ZIP_DEFLATED)
for info in src.infolist():
    name = info.filename
    if name.endswith("/"):
        continue
    wanted = name in keep or name.startswith(jit) or (name.startswith(dist_info) and not name.endswith("RECORD"))
    if not wanted:
        continue
    data = src.read(name)
    dst.writestr(info, data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append(f"{name},sha256={digest},{len(data)}")
    kept.append(name)
missing = sorted(k for k in keep if k not in set(kept))
if missing:
    sys.exit(f"stage-sglang: imported files not in the wheel: {missing[:5]}")
record.append(f"{dist_info}/RECORD,,")
dst.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
dst.close()
print(f"sglang wheel slimmed: {len(kept)} of {len(src.namelist())} files kept", file=sys.stderr)
PY
cp target/wheels/kvshard-*.whl "$stage/"
cat >"$stage/run.sh" <<'SH'
#!/usr/bin/env bash
# The `sglang` step of scripts/run-gpu.sh on this staged folder (run from the repository root).
here="$(cd "$(dirname "$0")" && pwd)"
SGLANG_STAGE="$here" exec "$here/../scripts/run-gpu.sh" sglang "$@"
SH
chmod +x "$stage/run.sh"
echo "cp$py" >"$stage/PY"
git rev-parse --short HEAD >"$stage/COMMIT" 2>/dev/null || echo unknown >"$stage/COMMIT"
ls "$stage/wheels" >&2
du -sh "$stage"
