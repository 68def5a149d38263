#!/usr/bin/env bash
# Installs the pinned SGLang test environment (sglang 0.5.23 on torch 2.11.0, CPU use only) into a
# virtualenv at PREFIX (argument 1, else $KVSHARD_SGLANG_VENV, else ~/.cache/kvshard/sglang-0.5.23)
# and prints the venv's path. Idempotent: a complete install is detected by a stamp file holding
# the pins and reused (about 3 minutes and 5 GB the first time, nothing after).
#
# What it is for: the Python tests that run SGLang's own objects beside kvshard's
# (python/tests/test_sglang_*.py; docs/sglang.md). They import SGLang's mem_cache, storage and
# disaggregation modules, which need torch and a score of pure-Python packages, not the
# sglang wheel's declared dependencies (flashinfer, sglang-kernel for torch 2.14, ...): so sglang
# is installed with --no-deps, and everything here is pinned == and installed with --no-deps in
# one pip call (no resolver: the set below is complete, and a newer release of anything can not
# slip in). torch 2.11.0 is the GPU host's torch, which the side-by-side benchmark runs on.
set -euo pipefail

prefix="${1:-${KVSHARD_SGLANG_VENV:-$HOME/.cache/kvshard/sglang-0.5.23}}"
pins=(
  sglang==0.5.23
  aiohappyeyeballs==2.7.1
  aiohttp==3.14.5
  aiosignal==1.4.0
  annotated-doc==0.0.7
  annotated-types==0.8.0
  anyio==4.16.0
  apache-tvm-ffi==0.1.15.post2
  asttokens==3.0.2
  attrs==26.1.0
  certifi==2026.10.19.post1
  charset-normalizer==3.5.3
  click==8.5.1
  compressed-tensors==0.20.1
  cuda-bindings==13.5.0
  cuda-pathfinder==1.9.1
  cuda-toolkit==13.0.2
  dill==0.4.1
  executing==2.3.0
  filelock==4.3.2
  frozenlist==1.8.0
  fsspec==2026.9.0
  gguf==0.19.0
  h11==0.16.0
  hf-xet==1.8.0
  httpcore2==2.16.2
  httpx2==2.16.2
  huggingface_hub==2.4.0
  hypothesis==6.170.17
  idna==3.20
  iniconfig==2.3.1
  ipython==9.18.1
  ipython_pygments_lexers==1.1.1
  jedi==0.20.1
  Jinja2==3.1.6
  loguru==0.7.3
  markdown-it-py==4.3.0
  MarkupSafe==3.0.4
  matplotlib-inline==0.2.2
  mdurl==0.1.2
  mpmath==1.3.0
  msgspec==0.23.0
  multidict==7.2.1
  networkx==3.6.1
  numpy==2.4.6
  nvidia-cublas==13.1.0.3
  nvidia-cuda-cupti==13.0.85
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cudnn-cu13==9.19.0.56
  nvidia-cufft==12.0.0.61
  nvidia-cufile==1.15.1.6
  nvidia-curand==10.4.0.35
  nvidia-cusolver==12.0.4.66
  nvidia-cusparse==12.6.3.3
  nvidia-cusparselt-cu13==0.8.0
  nvidia-nccl-cu13==2.28.9
  nvidia-nvjitlink==13.0.88
  nvidia-nvshmem-cu13==3.4.5
  nvidia-nvtx==13.0.85
  orjson==3.13.0
  packaging==26.4
  parso==0.8.7
  pexpect==4.9.0
  pillow==13.0.0
  pluggy==1.7.0
  prompt_toolkit==3.0.53
  propcache==0.5.4
  psutil==7.2.2
  ptyprocess==0.7.0
  pure_eval==0.2.4
  pybase64==1.5.1
  pydantic==2.14.4
  pydantic_core==2.50.5
  Pygments==2.21.0
  pytest==9.2.0
  PyYAML==6.0.4
  pyzmq==27.3.0
  regex==2026.11.19
  requests==2.34.2
  rich==15.0.0
  safetensors==0.8.0
  sentencepiece==0.2.3
  shellingham==1.5.4
  sortedcontainers==2.4.0
  stack-data==0.6.3
  starlette==1.10.0
  sympy==1.14.0
  tokenizers==0.23.3
  torch==2.11.0
  torchvision==0.26.0
  tqdm==4.70.1
  traitlets==5.16.1
  transformers==5.24.0
  triton==3.6.0
  truststore==0.10.5
  typer==0.29.2
  typing-inspection==0.4.5
  typing_extensions==4.16.0
  urllib3==2.8.0
  wcwidth==0.9.4
  yarl==1.25.1
)
stamp="$prefix/.kvshard-installed"

if [[ -f "$stamp" && "$(cat "$stamp")" == "${pins[*]}" && -x "$prefix/bin/python" ]]; then
  echo "$prefix"
  exit 0
fi

rm -rf "$prefix"
python3 -m venv "$prefix"
"$prefix/bin/pip" install --quiet --disable-pip-version-check --no-deps "${pins[@]}" >&2
# The modules the tests use import on the CPU (a missing pure-Python dependency fails here, not
# in the middle of the test run).
"$prefix/bin/python" -W ignore -c "
import sglang.srt.mem_cache.page_interleave, sglang.srt.mem_cache.allocator.page_interleave
import sglang.srt.mem_cache.pool_host.page_interleave, sglang.srt.mem_cache.pool_host.dsa
import sglang.srt.mem_cache.storage.backend_factory, sglang.srt.disaggregation.utils
" >&2
echo "${pins[*]}" >"$stamp"
echo "$prefix"
