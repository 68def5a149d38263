#!/usr/bin/env bash
# Runs the staged binaries (scripts/stage-gpu.sh) on a GPU host. Steps, in the order given
# (default: all of them but bench):
#   tests     every test binary with the GPU required (two-GPU tests too when two GPUs are here):
#             the library's and the applications' (cli/: demo, pd_procs, pd_pressure, flags, nccl)
#   sanitize  the GPU tests again under compute-sanitizer memcheck and racecheck
#             (SANITIZE_TESTS="unit-kvshard pool ...": only those binaries)
#   demo      kvshard demo, the basic and the pressure scenario
#   pd        scripts/pd-gpu.sh: P/D across processes (one GPU, or two when present)
#   pressure  kvshard pd --scenario pressure: the seed's topology, a process per rank and decode
#             (the report goes after pd's in pd.md; PRESSURE_ARGS adds flags)
#   pressure-dcp  the same with the decodes as decode context-parallel groups, a process per
#             prefill rank and per decode rank (61 layers and the draft): CP2 into one DCP2 group
#             at I = 1, then into one DCP4 group at I = 64, each bounded to 55 s; the reports go
#             after pd's in pd.md, every decode rank's row ending "| byte-identical |"
#   python    python/run-gpu-tests.sh on the staged wheel, with its benchmark (with .gpu-nixl
#             staged, the storage tests of kvshard.sglang_storage run with NIXL required)
#   mooncake  the Mooncake transport: decode and two prefill processes, VRAM pools on GPU 0, the
#             staged CUDA 13 engine (mooncake.tar.xz) over its TCP transport, every mode
#             byte-identical to the in-process reference (python/tests/test_mooncake_cpu.py
#             -k loopback with KVSHARD_MC_DEVICE=0), and the registration of VRAM pools, pinned
#             host pools, chunk staging and bounce buffers (test_mooncake_memory_cpu.py, the
#             same device), then the fault-injection suite's Mooncake cases on the same device
#             (test_faults_mooncake_cpu.py: their lines in mooncake-faults.log); with MOONCAKE_BENCH=1 then python/mooncake_bench.py on VRAM into
#             mooncake.md: the NIXL benchmark's shapes (--like-nixl), N = 1, 2, 8 x 512 and 64
#             pages, bounce and coalesced next to the same-run ceiling of Mooncake's own path and
#             a device copy, within 75 s (MOONCAKE_BENCH_FULL=1: 64, 512, 4,096 pages within
#             500 s, a call of its own; MOONCAKE_BENCH_N, _PAGES pick the shapes, _BUDGET the
#             seconds, _ITERS the timed iterations (default 3), _SLOT_PAGES the bounce slots'
#             pages (default 512: a rank's chunk past that goes coalesced)); with
#             MOONCAKE_BENCH_NIXL=1 and .gpu-nixl staged, also NIXL's benchmark at N = 1, 2, 8 x
#             64, 512 pages into the same file (minutes: a call of its own); says exactly why
#             when the engine cannot load
#   sglang    SGLang 0.5.23's own data-plane paths against kvshard's adapter on the same bytes
#             (python/sglang_bench.py: its JIT HiCache kernels through apache-tvm-ffi and the
#             host's nvcc, its page-interleave write and gather), from the wheels
#             scripts/stage-sglang.sh staged in $SGLANG_STAGE (default .gpu-sglang beside .gpu,
#             or the repository's): installed with pip --target into /tmp/sgl-site, put on
#             PYTHONPATH; writes sglang.md, sglang.png and sglang.log. SGLANG_PYTHON (default
#             python3) and SGLANG_BENCH_ARGS (e.g. --dry: the CPU check of this step) change what
#             runs
#   bench     the GPU benchmark (arguments after `--` go to it)
#   plan      kvshard plan for the seed's scenario (CP2, 4x host cache), the ceilings measured
#             here: D2D and pinned H2D on GPU 0, O_DIRECT reads in $PLAN_DISK (default $OUT)
#   storage   the storage tier on this host's disk (NIXL POSIX from .gpu-nixl, staged by
#             scripts/stage-nixl.sh beside .gpu, or $NIXL_STAGE): its test binaries with the GPU
#             and NIXL required (storage-tests/: the store ordered after a backup and a device
#             load still queued on the GPU, and the fault-injection cases), the pressure
#             scenario with its storage step (L2 -> L3 -> L2 -> L1 on the GPU, then the
#             CP2-written prefix from L3 into CP4; checked), in one process and across
#             processes (kvshard pd --scenario pressure: a process per rank and decode, the
#             ranks sharing the directory, rank r hosting CP4 readers r and r + 2), and
#             kvshard storage-bench next to fio (fio.tar.xz, when staged) in $STORAGE_DIR
#             (default /tmp; fio runs STORAGE_FIO_SECONDS a case, default 3, before and
#             after the ranks), then its end-to-end rows (16K and 128K-token prefixes to
#             GPU 0 from storage via the host, next to from the host); writes storage.md
#   gds       GPUDirect Storage (NIXL GDS on cuFile, compat mode) GPU 0 <-> file in $STORAGE_DIR:
#             one descriptor and slot-size ones, checked, or exactly why it cannot run; gds.md
# Writes to $OUT (default ./gpu-out): summary.log, tests.log, sanitizer.log, demo.log, pd.md,
# python.md, plan.md, bench.md, bench.log and the benchmark's charts, bench-SECTION.svg, sglang.md. The binaries need
# glibc >= 2.34 and load libcuda (and libnccl, found in the machine's Python packages) at run
# time. Usage: run-gpu.sh [STEP...] [-- BENCH ARGS...]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
[ -d "$here/tests" ] || repo="$(pwd)"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
steps=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  steps+=("$1")
  shift
done
[ "${1:-}" = "--" ] && shift
[ ${#steps[@]} -eq 0 ] && steps=(tests sanitize demo pd python)
export KVSHARD_REQUIRE_GPU=1
# The CPU twin in the order every cargo test run uses here (.cargo/config.toml): adversarial.
export KVSHARD_CPU_STREAMS="${KVSHARD_CPU_STREAMS:-adversarial}"
# The applications' tests that start kvshard processes (pd_pressure, flags) run the staged binary.
export KVSHARD_BIN="$here/kvshard"
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$gpus" -ge 2 ] && export KVSHARD_REQUIRE_GPUS=2
# libnccl ships inside the machine's Python packages (nvidia-nccl-cu13).
nccl=$(find / -xdev -name 'libnccl.so.2' -path '*nvidia*' 2>/dev/null | head -1)
[ -n "$nccl" ] && export LD_LIBRARY_PATH="$(dirname "$nccl")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
blas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)
[ -n "$blas" ] && export LD_LIBRARY_PATH="$(dirname "$blas"):$LD_LIBRARY_PATH"
status=0
say() { echo "$*" | tee -a "$out/summary.log"; }

say "commit $(cat "$here/COMMIT" 2>/dev/null)  $(date -u +%FT%TZ)  gpus $gpus  nccl ${nccl:-none}"
nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader |
  tee -a "$out/summary.log" || true

for step in "${steps[@]}"; do
  start=$(date +%s)
  case "$step" in
  tests)
    for t in "$here"/tests/*; do
      name=$(basename "$t")
      log="$out/tmp-test.log"
      if "$t" --test-threads=4 >"$log" 2>&1; then r=ok; else r=FAILED; status=1; fi
      { echo "===== test $name: $r"; cat "$log"; } >>"$out/tests.log"
      say "test $name: $r ($(grep -E '^test result' "$log" | tail -1)) $(grep -c '^SKIPPED' "$log") skipped"
      rm -f "$log"
    done
    ;;
  sanitize)
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    for tool in memcheck racecheck; do
      for t in "$here"/tests/*; do
        name=$(basename "$t")
        # NCCL under the sanitizer reports its own internals; its bytes are checked by the test.
        [ "$name" = nccl ] && continue
        # SANITIZE_TESTS="pool transfer ...": only these binaries (the ones a change to the kernels touches).
        if [ -n "${SANITIZE_TESTS:-}" ] && ! [[ " $SANITIZE_TESTS " == *" $name "* ]]; then continue; fi
        "$t" --list 2>/dev/null | grep -q '^gpu_.*: test' || continue
        log="$out/tmp-sanitizer.log"
        # --report-api-errors no: kvshard checks every driver call's result itself (a test
        # fails on one it did not expect), and some are expected: an allocation that finds the
        # device full releases kvshard's reuse cache and tries again (async_contract's loop).
        if "$cs" --tool "$tool" --report-api-errors no --target-processes all --error-exitcode 99 "$t" gpu_ --test-threads=1 >"$log" 2>&1; then
          r=clean
        else
          r=FAILED
          status=1
        fi
        { echo "===== $tool $name: $r"; cat "$log"; } >>"$out/sanitizer.log"
        say "$tool $name: $r ($(grep -E 'ERROR SUMMARY|test result' "$log" | tail -2 | tr '\n' ' '))"
        rm -f "$log"
      done
    done
    ;;
  demo)
    for scenario in basic pressure; do
      if "$here/kvshard" demo --scenario "$scenario" >>"$out/demo.log" 2>&1; then r=ok; else r=FAILED; status=1; fi
      say "demo $scenario: $r"
    done
    ;;
  pd)
    mkdir -p /tmp/pd-out
    if KVSHARD="$here/kvshard" OUT=/tmp/pd-out "$repo/scripts/pd-gpu.sh" >/tmp/pd-out/console.log 2>&1; then r=ok; else r=FAILED; status=1; fi
    { cat /tmp/pd-out/topology.txt; cat /tmp/pd-out/pd.md; echo; echo '```'; cat /tmp/pd-out/tests.log; echo '```'; } >"$out/pd.md" 2>/dev/null
    say "pd: $r"
    ;;
  pressure)
    log=/tmp/pressure-console.log
    # shellcheck disable=SC2086
    if "$here/kvshard" pd --scenario pressure ${PRESSURE_ARGS:-} --markdown /tmp/pressure.md >"$log" 2>&1; then r=ok; else r=FAILED; status=1; fi
    { echo; echo "## pd --scenario pressure ${PRESSURE_ARGS:-}"; cat /tmp/pressure.md; echo; echo '```'; tail -80 "$log"; echo '```'; } >>"$out/pd.md" 2>/dev/null
    say "pressure: $r"
    ;;
  pressure-dcp)
    for dcp in "2 1" "4 64"; do
      read -r m i <<<"$dcp"
      args="--decodes 1 --decode-dcp $m --decode-interleave $i"
      log=/tmp/pressure-dcp-$m-$i.log
      rm -f /tmp/pressure-dcp.md
      # shellcheck disable=SC2086
      if timeout 55 "$here/kvshard" pd --scenario pressure $args --markdown /tmp/pressure-dcp.md >"$log" 2>&1; then r=ok; else r=FAILED; status=1; fi
      { echo; echo "## pd --scenario pressure $args"; cat /tmp/pressure-dcp.md; echo; echo '```'; tail -40 "$log"; echo '```'; } >>"$out/pd.md" 2>/dev/null
      say "pressure-dcp DCP$m I=$i: $r"
    done
    ;;
  python)
    wheel=$(ls "$here"/*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
      say "python: no staged wheel"
      status=1
      continue
    fi
    # With NIXL staged (scripts/stage-nixl.sh), the storage tests (kvshard.sglang_storage) must
    # run, not skip.
    nixl_stage="${NIXL_STAGE:-$here/../.gpu-nixl}"
    if (
      # shellcheck disable=SC1091
      [ -f "$nixl_stage/env.sh" ] && . "$nixl_stage/env.sh" && export KVSHARD_REQUIRE_NIXL=1
      OUT=/tmp/py-out "$repo/python/run-gpu-tests.sh" "$wheel" --bench >/tmp/py-console.log 2>&1
    ); then r=ok; else r=FAILED; status=1; fi
    { cat /tmp/py-out/env.log; cat /tmp/py-out/bench-python.md; echo '```'; tail -60 /tmp/py-out/pytest.log; cat /tmp/py-out/bench.log; echo '```'; } >"$out/python.md" 2>/dev/null
    say "python: $r ($(grep -E 'passed|failed' /tmp/py-out/pytest.log | tail -1))"
    ;;
  mooncake)
    rt=/tmp/mooncake-rt
    rm -rf "$rt"
    mkdir -p "$rt/fallback" "$rt/kvshard"
    wheel=$(ls "$here"/kvshard-*.whl 2>/dev/null | head -1)
    if [ ! -f "$here/mooncake.tar.xz" ] || [ -z "$wheel" ]; then
      say "mooncake: no staged mooncake.tar.xz or kvshard wheel (scripts/stage-gpu.sh)"
      status=1
      continue
    fi
    tar -C "$rt" -xJf "$here/mooncake.tar.xz"
    python3 -m zipfile -e "$wheel" "$rt/kvshard"
    # The system libraries the engine loads, from the host where it has them (libcudart 13 from
    # its CUDA Python packages too), else the staged copies.
    cudart=$(find / -xdev -name 'libcudart.so.13' -path '*nvidia*' 2>/dev/null | head -1)
    for lib in "$rt"/sys/*; do
      name=$(basename "$lib")
      if [ "$name" = libcudart.so.13 ] && [ -n "$cudart" ]; then continue; fi
      ldconfig -p | awk '{print $1}' | grep -qxF "$name" || cp "$lib" "$rt/fallback/"
    done
    mc_path="$rt/fallback${cudart:+:$(dirname "$cudart")}"
    log="$out/mooncake.log"
    if ! LD_LIBRARY_PATH="$mc_path:${LD_LIBRARY_PATH:-}" PYTHONPATH="$rt/site:$rt/kvshard" \
      python3 -c 'import mooncake.engine as e; print("mooncake.engine loads; SUPPORT_CUDA", e.SUPPORT_CUDA)' >"$log" 2>&1; then
      { echo "--- missing libraries:"; LD_LIBRARY_PATH="$mc_path:${LD_LIBRARY_PATH:-}" ldd "$rt/site/mooncake/engine.so" | grep 'not found'; } >>"$log"
      say "mooncake: the CUDA 13 engine does not load here: $(grep -v '^---' "$log" | tail -1)"
      status=1
      continue
    fi
    if (cd "$repo" && LD_LIBRARY_PATH="$mc_path:${LD_LIBRARY_PATH:-}" PYTHONPATH="$rt/site:$rt/kvshard" \
      KVSHARD_MC_DEVICE=0 KVSHARD_REQUIRE_MOONCAKE=1 timeout 100 python3 -P -m pytest -q -rs \
      python/tests/test_mooncake_cpu.py python/tests/test_mooncake_memory_cpu.py \
      -k "loopback or registers or host_pool or transport_reuses or engine_regions") >>"$log" 2>&1; then
      r=ok
    else
      r=FAILED
      status=1
    fi
    say "mooncake: $r ($(grep -E 'passed|failed|skipped' "$log" | tail -1))"
    # The fault-injection suite's Mooncake cases on VRAM pools (kills, status frames dropped,
    # duplicated, delayed and reordered, a decode restarted): their `fault-injection:` lines.
    if (cd "$repo" && LD_LIBRARY_PATH="$mc_path:${LD_LIBRARY_PATH:-}" PYTHONPATH="$rt/site:$rt/kvshard" \
      KVSHARD_MC_DEVICE=0 KVSHARD_REQUIRE_MOONCAKE=1 timeout 150 python3 -P -m pytest -q -s -rs \
      python/tests/test_faults_mooncake_cpu.py) >"$out/mooncake-faults.log" 2>&1; then
      r=ok
    else
      r=FAILED
      status=1
    fi
    say "mooncake faults: $r ($(grep -c 'fault-injection:' "$out/mooncake-faults.log") cases; $(grep -E 'passed|failed' "$out/mooncake-faults.log" | tail -1))"
    if [ "${MOONCAKE_BENCH:-0}" = 1 ]; then
      # Bounce and coalesced on VRAM next to Mooncake's own ceiling (python/mooncake_bench.py).
      # 512 pages first: the issue's shape at every N before the budget can cut a row.
      pages=512,64 budget=75 limit=90
      [ "${MOONCAKE_BENCH_FULL:-0}" = 1 ] && pages=512,64,4096 budget=500 limit=560
      # A shorter run of chosen shapes (MOONCAKE_BENCH_PAGES) fits beside other steps.
      [ -n "${MOONCAKE_BENCH_BUDGET:-}" ] && budget="$MOONCAKE_BENCH_BUDGET" limit=$((MOONCAKE_BENCH_BUDGET + 60))
      (cd "$repo" && LD_LIBRARY_PATH="$mc_path:${LD_LIBRARY_PATH:-}" PYTHONPATH="$rt/site:$rt/kvshard" \
        GLOG_minloglevel=2 timeout "$limit" python3 -P python/mooncake_bench.py --device 0 --like-nixl \
        --n "${MOONCAKE_BENCH_N:-1,2,8}" --pages "${MOONCAKE_BENCH_PAGES:-$pages}" --iters "${MOONCAKE_BENCH_ITERS:-3}" \
        --slot-pages "${MOONCAKE_BENCH_SLOT_PAGES:-512}" --budget "$budget") \
        >"$out/mooncake.md" 2>>"$log" || { say "mooncake bench: FAILED or cut short (mooncake.log)"; status=1; }
      say "mooncake bench: $(grep -c '^| bounce' "$out/mooncake.md") bounce rows; $(grep -E '^(bounce at 512|skipped)' "$out/mooncake.md" | tr '\n' ' ')"
      nixl_stage="${NIXL_STAGE:-$here/../.gpu-nixl}"
      if [ "${MOONCAKE_BENCH_NIXL:-0}" = 1 ]; then
        if [ -x "$nixl_stage/nixl-test" ]; then
          # NIXL at the same shapes (its own GLM-5-like cache and decode pages), for the table.
          { echo; echo "## NIXL, the same shapes (bench_nixl_pd)"; echo; } >>"$out/mooncake.md"
          (
            # shellcheck disable=SC1091
            . "$nixl_stage/env.sh"
            KVSHARD_NIXL_BENCH_N="${MOONCAKE_BENCH_N:-1,2,8}" KVSHARD_NIXL_BENCH_PAGES="${MOONCAKE_BENCH_PAGES:-$pages}" \
              timeout 500 "$nixl_stage/nixl-test" bench_nixl_pd --ignored --nocapture 2>&1 | grep -E '^\|' >>"$out/mooncake.md"
          ) || { say "mooncake bench: the NIXL benchmark FAILED or was cut short"; status=1; }
        else
          say "mooncake bench: MOONCAKE_BENCH_NIXL=1 but no $nixl_stage/nixl-test (scripts/stage-nixl.sh .gpu-nixl)"
          status=1
        fi
      fi
    fi
    ;;
  sglang)
    stage="${SGLANG_STAGE:-$here/../.gpu-sglang}"
    [ -d "$stage/wheels" ] || stage="$repo/.gpu-sglang"
    py="${SGLANG_PYTHON:-python3}"
    if [ ! -d "$stage/wheels" ]; then
      say "sglang: nothing staged (scripts/stage-sglang.sh writes .gpu-sglang)"
      status=1
      continue
    fi
    want="$(cat "$stage/PY" 2>/dev/null)"
    have="$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
    if [ "$want" != "$have" ]; then
      say "sglang: staged for $want, $py is $have (PY=${have#cp} scripts/stage-sglang.sh)"
      status=1
      continue
    fi
    site=/tmp/sgl-site
    rm -rf "$site"
    log="$out/sglang.log"
    if ! "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$stage"/wheels/*.whl "$stage"/kvshard-*.whl >"$log" 2>&1; then
      say "sglang: the staged wheels did not install ($(tail -1 "$log"))"
      status=1
      continue
    fi
    # SGLang's JIT kernels build with the host's nvcc (its CUDA_HOME, else nvcc on PATH).
    nvcc_bin="$(command -v nvcc || find /usr/local -maxdepth 3 -path '*/bin/nvcc' 2>/dev/null | head -1)"
    if [ -n "$nvcc_bin" ]; then
      [ -n "${CUDA_HOME:-}" ] || CUDA_HOME="$(dirname "$(dirname "$nvcc_bin")")"
      PATH="$(dirname "$nvcc_bin"):$PATH"
      export CUDA_HOME PATH
    fi
    echo "nvcc: ${nvcc_bin:-none} ($("${nvcc_bin:-false}" --version 2>/dev/null | tail -1)); CUDA_HOME ${CUDA_HOME:-unset}" >>"$log"
    # shellcheck disable=SC2086
    if (cd "$repo" && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" SGLANG_JIT_CACHE_DIR=/tmp/sgl-jit \
      timeout 420 "$py" -W ignore -P python/sglang_bench.py --out "$out" ${SGLANG_BENCH_ARGS:-}) >>"$log" 2>&1; then
      r=ok
    else
      r=FAILED
      status=1
    fi
    say "sglang: $r ($(grep -E '^(sglang_bench|SGLang JIT compile)' "$log" | tr '\n' ' '))"
    ;;
  bench)
    OUT="$out" "$here/benches/gpu" "$@" 2>&1 | tee "$out/bench.log" >/dev/null
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    say "bench: $(grep -c 'FAILED' "$out/bench.log") sections failed, $(grep -c 'ABOVE ITS SAME-RUN CEILING' "$out/bench.log") figures above their ceiling, $(grep -c 'HOST>' "$out/bench.log") rows with host time past 5% of the transfer, $(grep -c '^chart:' "$out/bench.log") charts"
    ;;
  plan)
    if "$here/kvshard" plan --model deepseek-v32 --cp 2 --gpu-mem 400376832 --host-mem 4x --disk 10GB \
      --context-len 12288 --chunk 2048 --contexts 1 --prefixes 4096,16384,131072 \
      --measure --disk-path "${PLAN_DISK:-$out}" >"$out/plan.md" 2>&1; then r=ok; else r=FAILED; status=1; fi
    say "plan: $r ($(grep '^ceilings:' "$out/plan.md"))"
    ;;
  storage)
    dir="${STORAGE_DIR:-/tmp}"
    nixl_stage="${NIXL_STAGE:-$here/../.gpu-nixl}"
    (
      staged="$here" # env.sh sets its own `here`
      # shellcheck disable=SC1091
      [ -f "$nixl_stage/env.sh" ] && . "$nixl_stage/env.sh"
      export KVSHARD_STORAGE_DIR="$dir"
      fio_args=()
      if [ -f "$staged/fio.tar.xz" ]; then
        mkdir -p /tmp/kvshard-fio && tar -C /tmp/kvshard-fio -xJf "$staged/fio.tar.xz"
        printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/kvshard-fio/lib exec /tmp/kvshard-fio/fio "$@"\n' >/tmp/kvshard-fio/run
        chmod +x /tmp/kvshard-fio/run
        fio_args=(--fio /tmp/kvshard-fio/run)
      fi
      echo '```'
      # The storage tier's tests: gpu_* run here on GPU 0, the CPU ones and the fault cases
      # on this host's disk (their stores under $STORAGE_DIR).
      for t in "$staged"/storage-tests/*; do
        [ -x "$t" ] || continue
        TMPDIR="$dir" KVSHARD_REQUIRE_NIXL=1 timeout 120 "$t" --test-threads=2 --nocapture 2>&1 |
          grep -E '^(test result|fault-injection:)|FAILED|panicked' | sed "s|^|$(basename "$t"): |"
      done
      timeout 30 "$staged/kvshard" demo --scenario pressure | grep -E '^(storage|pressure)'
      echo '```'
      # Across processes: each rank writes its own pages to the shared directory, finds the
      # whole prefix from its own replay of the others' journals, reloads it L3 -> L2 -> L1,
      # then reads its two reader ranks' pages of CP4 from the directory (three rows a rank).
      timeout 60 "$staged/kvshard" pd --scenario pressure --markdown /tmp/storage-pd.md >/tmp/storage-pd.log 2>&1 ||
        { echo "pd --scenario pressure FAILED:"; tail -20 /tmp/storage-pd.log; }
      echo; echo '### pd --scenario pressure: the storage step across processes'; echo
      grep -A7 'storage step' /tmp/storage-pd.md
      # fio's same-run ceiling runs STORAGE_FIO_SECONDS (default 3) a case, four timed cases
      # before the ranks and four after: longer runs steady the disk's figure (a 3 s load ran
      # slower than the store it bounds, 8d5f15c).
      fio_s="${STORAGE_FIO_SECONDS:-3}"
      timeout $((40 + 9 * fio_s)) "$staged/kvshard" storage-bench --dir "$dir" --ranks 2 --pages 128 \
        --fio-seconds "$fio_s" --no-e2e "${fio_args[@]}"
      # The end-to-end rows: 16K and 128K-token prefixes (256 and 2,048 pages, 5.5 GB at 128K)
      # to GPU 0 from storage via the host and from the host ($STORAGE_E2E_TOKENS overrides).
      timeout 60 "$staged/kvshard" storage-bench --dir "$dir" --e2e-only \
        ${STORAGE_E2E_TOKENS:+--e2e-tokens "$STORAGE_E2E_TOKENS"}
    ) >"$out/storage.md" 2>&1
    if grep -q 'byte-identical to the unsharded reference' "$out/storage.md" && grep -q '^| load' "$out/storage.md" &&
      [ "$(grep -c '^storage: test result: ok' "$out/storage.md")" -ge 1 ] &&
      [ "$(grep -c '^faults_storage: test result: ok' "$out/storage.md")" -ge 1 ] &&
      ! grep -qE '^(storage|faults_storage): .*(FAILED|panicked)' "$out/storage.md" &&
      [ "$(grep -c '^| [0-9] | reloaded L3 -> L2 .*byte-identical' "$out/storage.md")" -ge 2 ] &&
      grep -q '^storage: the CP2-written prefix reloaded into CP4 .*: byte-identical' "$out/storage.md" &&
      [ "$(grep -c '^| [0-9] | the CP2-written prefix reloaded into CP4 .*: byte-identical' "$out/storage.md")" -ge 2 ] &&
      grep -q '^| [0-9]*K tokens' "$out/storage.md"; then r=ok; else r=FAILED; status=1; fi
    say "storage: $r"
    ;;
  gds)
    # GPUDirect Storage through NIXL's GDS backend (cuFile, compat mode without nvidia-fs:
    # env.sh points CUFILE_ENV_PATH_JSON at the staged cufile.json): GPU 0 <-> a file in
    # $STORAGE_DIR, one descriptor (cuFile's ceiling) and slot-size descriptors, 64 per request
    # (below the 256 in flight that hang published GDS runs), checked; or exactly why not.
    dir="${STORAGE_DIR:-/tmp}"
    nixl_stage="${NIXL_STAGE:-$here/../.gpu-nixl}"
    (
      staged="$here"
      # shellcheck disable=SC1091
      [ -f "$nixl_stage/env.sh" ] && . "$nixl_stage/env.sh"
      timeout 80 "$staged/kvshard" storage-bench --dir "$dir" --gds-only
      echo '```'; tail -20 "${CUFILE_LOGFILE_PATH:-/tmp/kvshard-cufile.log}" 2>/dev/null; echo '```'
    ) >"$out/gds.md" 2>&1
    if grep -q '^| one of' "$out/gds.md"; then r=ok; else r="NOT MEASURED ($(grep -m1 'GDS not measured' "$out/gds.md"))"; fi
    say "gds: $r"
    ;;
  *)
    say "unknown step $step"
    status=1
    ;;
  esac
  say "step $step took $(($(date +%s) - start)) s"
done
exit $status
