#!/usr/bin/env bash
# The GPU machine's checks in one run: build, the test suites, the doctor, the
# benchmarks.
# Written for an H200 machine with torch 2.11+cu130, nvcc 13.0 and no network;
# run from the repository root there (carry .deps/catch2_*.deb if the machine
# has no Catch2, and .whl/ with the nvidia-cudnn-frontend wheel for its
# Python if the machine lacks it: it cannot reach a package index):
#
#   bash tools/device_run.sh                          # build tests doctor bench
#   bash tools/device_run.sh build tests              # no benchmark
#   bash tools/device_run.sh build gpu host           # GPU suite + host figures
#   PYTEST_ARGS='-k adversarial' bash tools/device_run.sh gpu
#
# Parts (default: build tests doctor bench):
#   build   the extension: pip install --no-build-isolation --no-deps -e .
#           (on a warm machine that already has it: incremental build_ext)
#   ctest   CMake build of the op library + Catch2 tests, then ctest
#   cpu     python -m pytest -q tests --ignore=tests/gpu   (the CPU suite)
#   gpu     python -m pytest -q tests/gpu, the two fuzzes and the ragged sweep
#           excepted (each has a part of its own); past one device call's
#           limit on a fresh H200 (it reached about 60% in 440 s), so run as
#   gpu1    its files up to test_features_gpu.py (about 300 tests), and
#   gpu2    the files after it, each with a build in one call
#   fuzz    the two differential fuzzes at once, each split over FUZZ_PROCS
#           pytest processes (default 4) that share the GPU:
#           tests/gpu/test_fuzz_gpu.py (FUZZ_CASES in all, default 1,000) and
#           tests/gpu/test_varlen_fuzz_gpu.py (VARLEN_FUZZ_CASES, default 500).
#           Process i draws from seed FUZZ_SEED + i (default: a random base, in
#           the summary), so a failure replays alone with OPENWAM_FUZZ_SEED or
#           OPENWAM_VARLEN_FUZZ_SEED. Why processes: one case builds several
#           cuDNN graphs for its new shapes (host time, 40-85 ms each), and in
#           one process the two fuzzes took about 0.4 and 1.1 s a case on an
#           H200 (1,500 cases: about 15 minutes, past one device call).
#           Logs and each process's results record: $OUT/fuzz/.
#   ragged  python -m pytest -q tests/gpu/test_varlen_gpu.py -k test_cudnn_ragged_sweep:
#           cuDNN's ragged layout, one child process per cell (about 170 s)
#   tests   = ctest cpu gpu
#   doctor  python -m openwam_sdpa doctor (report to $OUT/doctor.txt)
#   sweep   python tools/sweep_single_query_row.py --out $OUT/sweep
#   pytorch python tools/pytorch_sdpa_tests.py --device cuda --out $OUT/pt
#           (PyTorch's own SDPA tests, plain and patched; carry .external)
#   dist    torchrun --nproc-per-node 2 tools/train_distributed.py --out $OUT/dist
#           (DDP, FSDP2, tensor parallel; on a one-GPU machine both ranks
#           share it over gloo, as NCCL refuses a shared GPU)
#   bench   python benchmarks/bench_sdpa.py --out $OUT/bench $BENCH_ARGS
#   host    python benchmarks/bench_sdpa.py --sections host --out $OUT/host
#           (host time per forward and backward call, paired rounds)
# A test part on a machine without the built extension builds it first.
#
# Files under $OUT (default build/device-out): build.log (extension + CMake
# build), tests.log (ctest and both pytest runs), gpu_suite_results.{json,md}
# (written by tests/gpu/conftest.py), doctor.txt, bench/bench.{json,md,png},
# host/host.{json,md}; with JUNIT=1
# also pytest_gpu.xml. The summary table is printed last. The whole run stops
# itself before DEVICE_BUDGET_S seconds (default 560): parts that no longer
# fit are reported as "skipped (time)".
#
# Environment: PYTEST_ARGS (extra args for both pytest runs, split on spaces:
#   write `--deselect=ID` or `-k name`, not a quoted multi-word -k), BENCH_ARGS,
#   FUZZ_PROCS, FUZZ_SEED, FUZZ_CASES, VARLEN_FUZZ_CASES, FUZZ_CAP (the fuzz
#   part's time limit, default 540 s),
#   TORCH_CUDA_ARCH_LIST (default 9.0a), MAX_JOBS (default: cores),
#   FULL_BUILD=1 (always the pip build), JUNIT=1, DEVICE_BUDGET_S,
#   GPU_CAP (the GPU suite's time limit, default 420 s), GPU_FILES (the GPU
#   part's files instead of all of tests/gpu, e.g. the ones a lease missed). The whole GPU
#   evidence takes four calls: `build gpu1`, `build gpu2`, `fuzz`, then
#   `ragged`.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
T0=$SECONDS
BUDGET=${DEVICE_BUDGET_S:-560}
OUT=${OUT:-$ROOT/build/device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   # nothing outside can be reached
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# The machine's default CXX, /opt/gcc/bin/g++, links a private copy of
# libstdc++'s stream code into the extension, which then segfaults formatting
# its first error message (setup.py refuses such a build).
# The system compiler builds against the libstdc++ the process loads.
if [[ -x /usr/bin/g++ && -x /usr/bin/gcc ]]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
# CMake 4 (pip's) refuses config files that declare a minimum below 3.5.
export CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5}
export OUT
BUILD_LOG=$OUT/build.log
TESTS_LOG=$OUT/tests.log
CMAKE_DIR=$ROOT/build/cmake-device
: >"$BUILD_LOG"

say() { echo "[$(printf '%4d' $((SECONDS - T0)))s] $*"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
# run_limited CAP LOG CMD...: CMD with a time limit of min(CAP, time left - 15 s),
# its output appended to LOG. Returns CMD's status, 124 on timeout, 125 if no
# time was left to start it.
run_limited() {
  local cap=$1 log=$2; shift 2
  local lim=$(( $(left) - 15 ))
  ((lim > cap)) && lim=$cap
  if ((lim < 20)); then echo "(skipped: no time left)" >>"$log"; return 125; fi
  timeout --kill-after=10 "$lim" "$@" >>"$log" 2>&1
}
section() { local f=$1; shift; printf '\n===== %s =====\n' "$*" >>"$f"; }

# ------------------------------------------------------------ which parts
parts=("$@")
((${#parts[@]})) || parts=(build tests doctor bench)
gpu_half=0
want_build=0 want_ctest=0 want_cpu=0 want_gpu=0 want_fuzz=0 want_ragged=0 want_doctor=0 want_bench=0 want_sweep=0 want_pytorch=0
want_host=0 want_dist=0
for p in "${parts[@]}"; do
  case $p in
    build) want_build=1 ;;
    ctest|cpp) want_ctest=1 ;;
    cpu) want_cpu=1 ;;
    gpu) want_gpu=1 ;;
    gpu1) want_gpu=1 gpu_half=1 ;;
    gpu2) want_gpu=1 gpu_half=2 ;;
    fuzz) want_fuzz=1 ;;
    ragged) want_ragged=1 ;;
    tests) want_ctest=1 want_cpu=1 want_gpu=1 ;;
    doctor) want_doctor=1 ;;
    bench) want_bench=1 ;;
    sweep) want_sweep=1 ;;
    pytorch) want_pytorch=1 ;;
    host) want_host=1 ;;
    dist) want_dist=1 ;;
    all) want_build=1 want_ctest=1 want_cpu=1 want_gpu=1 want_doctor=1 want_bench=1 ;;
    *) echo "device_run.sh: unknown part '$p' (build ctest cpu gpu gpu1 gpu2 fuzz ragged tests doctor sweep pytorch dist bench host all)"; exit 2 ;;
  esac
done

# ------------------------------------------------------------ environment
"$PY" - <<'EOF' 2>&1 | tee -a "$BUILD_LOG"
import sys, torch
cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO GPU"
print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, "
      f"cuda {torch.version.cuda}, cudnn {cudnn}, {gpu}")
EOF
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
# The cuDNN frontend's headers come with its wheel (setup.py finds them
# through the installed distribution): from .whl/ where the machine lacks it.
if ! "$PY" -c 'from importlib import metadata; metadata.distribution("nvidia-cudnn-frontend")' 2>/dev/null; then
  whl=$(compgen -G "$ROOT/.whl/nvidia_cudnn_frontend-*.whl" | head -1)
  if [[ -n "$whl" ]]; then
    "$PY" -m pip install -q --no-index --no-deps --target "$ROOT/build/device-site" "$whl" >>"$BUILD_LOG" 2>&1
    export PYTHONPATH=$ROOT/build/device-site${PYTHONPATH:+:$PYTHONPATH}
  else
    say "no nvidia-cudnn-frontend and no .whl/nvidia_cudnn_frontend-*.whl: the build will stop"
  fi
fi
say "nvcc $(nvcc --version 2>/dev/null | grep -oE 'release [0-9.]+' || echo 'NOT FOUND'), \
cmake $(cmake --version 2>/dev/null | head -1 | grep -oE '[0-9.]+$'), $(nproc) cores, \
TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, parts: ${parts[*]}"

st_build="-" st_ctest="-" st_cpu="-" st_gpu="-" st_fuzz="-" st_ragged="-" st_doctor="-" st_bench="-" st_sweep="-" st_pytorch="-" st_dist="-" build_s="-"
st_host="-"

ext_importable() {
  (cd /tmp && "$PY" -c 'import openwam_sdpa._C' >/dev/null 2>&1)
}

# ------------------------------------------------------------ build
do_build() {
  local t=$SECONDS rc loc
  loc=$(cd /tmp && "$PY" -c 'import importlib.util as u; s=u.find_spec("openwam_sdpa"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null)
  if [[ "${FULL_BUILD:-0}" == "0" && "$loc" == "$ROOT/python/openwam_sdpa" ]] && ext_importable; then
    section "$BUILD_LOG" "extension: incremental build_ext --inplace (editable install present)"
    say "build: incremental (MAX_JOBS=$MAX_JOBS)"
    run_limited 420 "$BUILD_LOG" "$PY" setup.py build_ext --inplace --build-temp build/py
  else
    section "$BUILD_LOG" "extension: pip install --no-build-isolation --no-deps -e ."
    say "build: pip install --no-build-isolation --no-deps -e . (MAX_JOBS=$MAX_JOBS)"
    run_limited 420 "$BUILD_LOG" "$PY" -m pip install --no-build-isolation --no-deps -v -e .
  fi
  rc=$?
  build_s=$((SECONDS - t))
  if ((rc == 0)) && ext_importable; then
    st_build="ok (${build_s}s)"
    say "build: linked by $(grep -oE '^ *[^ ]+ .*-shared' "$BUILD_LOG" | tail -1 | awk '{print $1}')"
  else
    st_build="FAILED (rc $rc, ${build_s}s)"
    grep -E -A6 'error|Error' "$BUILD_LOG" | head -40
    section "$BUILD_LOG" "import check"
    (cd /tmp && "$PY" -c 'import openwam_sdpa._C') >>"$BUILD_LOG" 2>&1
  fi
  say "build: $st_build"
}
if ((want_build)) || { ((want_cpu || want_gpu || want_fuzz || want_ragged || want_doctor || want_bench || want_sweep || want_pytorch || want_host || want_dist)) && ! ext_importable; }; then
  do_build
fi

# ------------------------------------------------------------ cmake + ctest
if ((want_ctest)); then
  cmake_args=(-S "$ROOT" -B "$CMAKE_DIR" -DCMAKE_BUILD_TYPE=Release -DOPENWAM_PYTHON="$(command -v "$PY")")
  [[ -f "$CMAKE_DIR/CMakeCache.txt" ]] || cmake_args+=(-G Ninja)
  deb=$(compgen -G "$ROOT/.deps/catch2_*.deb" | head -1)
  if [[ -n "$deb" ]]; then
    rm -rf /tmp/catch2 && mkdir -p /tmp/catch2
    if command -v dpkg >/dev/null; then dpkg -x "$deb" /tmp/catch2
    else (cd /tmp/catch2 && ar p "$deb" data.tar.xz | tar -xJ); fi
    cmake_args+=(-DCMAKE_PREFIX_PATH=/tmp/catch2/usr)
  elif [[ ! -f /usr/include/catch2/catch.hpp ]]; then
    say "ctest: no .deps/catch2_*.deb (carry .deps) and no system Catch2: configure will fail"
  fi
  section "$BUILD_LOG" "cmake configure + build ($CMAKE_DIR)"
  say "ctest: cmake configure + build"
  t=$SECONDS
  if run_limited 60 "$BUILD_LOG" cmake "${cmake_args[@]}" &&
     run_limited 360 "$BUILD_LOG" cmake --build "$CMAKE_DIR" -j "$MAX_JOBS"; then
    section "$TESTS_LOG" "ctest"
    say "ctest: built in $((SECONDS - t))s; running"
    tmp=$(mktemp)
    (cd "$CMAKE_DIR" && run_limited 120 "$tmp" ctest --output-on-failure -j 8)
    rc=$?
    cat "$tmp" >>"$TESTS_LOG"
    line=$(grep -E 'tests passed|No tests were found' "$tmp" | tail -1)
    ((rc == 0)) || grep -E 'Failed|\*\*\*' "$tmp" | head -15
    rm -f "$tmp"
    if ((rc == 0)) && [[ "$line" == *"tests passed"* ]]; then
      st_ctest="ok: ${line}"
    else
      st_ctest="FAILED (rc $rc): ${line:-no summary}"
    fi
  else
    st_ctest="FAILED: cmake configure/build (build.log)"
    grep -E -A6 'error|Error' "$BUILD_LOG" | tail -40
  fi
  say "ctest: $st_ctest"
fi

# ------------------------------------------------------------ pytest
# pytest_part NAME CAP ARGS...: runs pytest, sets REPLY to its status text.
pytest_part() {
  local name=$1 cap=$2 rc line tmp; shift 2
  tmp=$(mktemp)
  section "$TESTS_LOG" "pytest $name: python -m pytest -q $* ${PYTEST_ARGS:-}"
  say "pytest $name: $*"
  # shellcheck disable=SC2086
  run_limited "$cap" "$tmp" "$PY" -m pytest -q -rfE "$@" ${PYTEST_ARGS:-}
  rc=$?
  cat "$tmp" >>"$TESTS_LOG"
  line=$(grep -E '^=*\s*([0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)|no tests ran)' \
         "$tmp" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
  case $rc in
    0) if [[ "$line" == *passed* ]]; then REPLY="ok: $line"; else REPLY="NOTHING PASSED: $line"; fi ;;
    124|137) REPLY="TIMEOUT after ${cap}s cap: ${line:-no summary}" ;;
    125) REPLY="skipped (time)" ;;
    5) REPLY="no tests collected" ;;
    *) REPLY="FAILED (rc $rc): ${line:-no summary}"
       grep -E '^(FAILED|ERROR) ' "$tmp" | head -15 ;;
  esac
  rm -f "$tmp"
  say "pytest $name: $REPLY"
}
if ((want_cpu)); then pytest_part cpu 180 tests --ignore=tests/gpu; st_cpu=$REPLY; fi
if ((want_gpu)); then
  junit=()
  [[ "${JUNIT:-0}" == "1" ]] && junit=(--junitxml="$OUT/pytest_gpu.xml")
  # The suite's files but the fuzzes; gpu1/gpu2 take them up to and after
  # test_features_gpu.py (collection order is the files' order).
  gpu_files=()
  # GPU_FILES (space-separated paths) replaces the list: the files a short
  # lease has not reached yet.
  for f in ${GPU_FILES:-tests/gpu/test_*.py}; do
    [[ $f == *fuzz* ]] && continue
    if ((gpu_half == 1)) && [[ $f > tests/gpu/test_features_gpu.py ]]; then continue; fi
    if ((gpu_half == 2)) && [[ ! $f > tests/gpu/test_features_gpu.py ]]; then continue; fi
    gpu_files+=("$f")
  done
  pytest_part "gpu${gpu_half/#0/}" "${GPU_CAP:-420}" "${gpu_files[@]}" \
    --deselect=tests/gpu/test_varlen_gpu.py::test_cudnn_ragged_sweep "${junit[@]}"; st_gpu=$REPLY
fi

# fuzz_part: both fuzzes, FUZZ_PROCS processes each, all at once; sets REPLY.
fuzz_part() {
  local procs=${FUZZ_PROCS:-4} base=${FUZZ_SEED:-$((RANDOM * 32768 + RANDOM))}
  local lim=$(( $(left) - 15 )) cap=${FUZZ_CAP:-540} name file draw target var cases i n rc log line
  local -a pids=() logs=() bad=()
  ((lim > cap)) && lim=$cap
  if ((lim < 20)); then REPLY="skipped (time)"; return; fi
  mkdir -p "$OUT/fuzz"
  say "fuzz: ${FUZZ_CASES:-1000} dense and ${VARLEN_FUZZ_CASES:-500} varlen cases, $procs processes each, seeds $base + i, limit ${lim}s"
  for name in dense varlen; do
    if [[ $name == dense ]]; then
      file=tests/gpu/test_fuzz_gpu.py draw=test_fuzz_against_stock var=OPENWAM_FUZZ
      cases=${FUZZ_CASES:-1000}
    else
      file=tests/gpu/test_varlen_fuzz_gpu.py draw=test_varlen_fuzz_against_stock
      var=OPENWAM_VARLEN_FUZZ cases=${VARLEN_FUZZ_CASES:-500}
    fi
    for ((i = 0; i < procs; i++)); do
      n=$((cases / procs + (i < cases % procs)))
      ((n > 0)) || continue
      log=$OUT/fuzz/$name-$((base + i)).log
      # The first process runs the whole file (the dense file's fixed head_dim
      # 160 cases too), the others its random draw alone.
      target=$file
      ((i == 0)) || target=$file::$draw
      # shellcheck disable=SC2086
      env "${var}_SEED=$((base + i))" "${var}_CASES=$n" OUT="$OUT/fuzz/$name-$((base + i))" \
        timeout --kill-after=10 "$lim" "$PY" -m pytest -q -s -rfE -p no:cacheprovider "$target" \
        ${PYTEST_ARGS:-} >"$log" 2>&1 &
      pids+=($!) logs+=("$log")
    done
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; rc=$?
    section "$TESTS_LOG" "fuzz: ${logs[$i]}"
    cat "${logs[$i]}" >>"$TESTS_LOG"
    line=$(grep -E '^=*\s*[0-9]+ (passed|failed|skipped)' "${logs[$i]}" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
    if ((rc != 0)) || [[ "$line" != *passed* ]]; then
      bad+=("$(basename "${logs[$i]}" .log): rc $rc, ${line:-no summary}")
      grep -E 'fuzz: FAILED' "${logs[$i]}" | head -5 | cut -c1-400
    fi
  done
  if ((${#bad[@]} == 0)); then
    REPLY="ok: ${#pids[@]} processes passed (seeds $base..$((base + procs - 1)))"
  else
    REPLY="FAILED: $(printf '%s; ' "${bad[@]}")"
  fi
  say "fuzz: $REPLY"
}
if ((want_fuzz)); then fuzz_part; st_fuzz=$REPLY; fi
if ((want_ragged)); then
  pytest_part ragged 300 tests/gpu/test_varlen_gpu.py::test_cudnn_ragged_sweep; st_ragged=$REPLY
fi

# ------------------------------------------------------------ doctor
if ((want_doctor)); then
  say "doctor: python -m openwam_sdpa doctor"
  (cd /tmp && run_limited 120 "$OUT/doctor.txt" "$PY" -m openwam_sdpa doctor)
  rc=$?
  # Exit 0 (not affected) and 4 (affected, openwam_sdpa fixes it) are both a
  # working doctor; 3 means openwam_sdpa itself gave non-finite gradients, 1
  # that the command failed.
  case $rc in
    0|4) st_doctor="ok (exit $rc): $(grep '^verdict:' "$OUT/doctor.txt" | cut -c10-120)" ;;
    *) st_doctor="FAILED (exit $rc): $(tail -1 "$OUT/doctor.txt" | cut -c1-120)" ;;
  esac
  say "doctor: $st_doctor"
fi

# ------------------------------------------------------------ sweep, PyTorch's tests
# script_part NAME CAP LOG CMD...: one script with a time cap; sets REPLY.
script_part() {
  local name=$1 cap=$2 log=$3 rc; shift 3
  section "$TESTS_LOG" "$name: $*"
  say "$name: $*"
  run_limited "$cap" "$log" "$@"
  rc=$?
  case $rc in
    0) REPLY="ok" ;;
    124|137) REPLY="TIMEOUT after ${cap}s" ;;
    125) REPLY="skipped (time)" ;;
    *) REPLY="FAILED (rc $rc)" ;;
  esac
  say "$name: $REPLY"
}
if ((want_sweep)); then
  mkdir -p "$OUT/sweep"
  script_part sweep 180 "$TESTS_LOG" "$PY" tools/sweep_single_query_row.py --out "$OUT/sweep"
  st_sweep=$REPLY
fi
if ((want_pytorch)); then
  mkdir -p "$OUT/pt"
  script_part pytorch 360 "$TESTS_LOG" "$PY" tools/pytorch_sdpa_tests.py --device cuda --out "$OUT/pt" ${PT_ARGS:-}
  st_pytorch=$REPLY
fi
if ((want_dist)); then
  mkdir -p "$OUT/dist"
  dist_backend=nccl
  (( $("$PY" -c 'import torch; print(torch.cuda.device_count())') < 2 )) && dist_backend=gloo
  script_part dist 420 "$TESTS_LOG" "$PY" -m torch.distributed.run --nproc-per-node 2 \
    tools/train_distributed.py --backend "$dist_backend" --out "$OUT/dist"
  st_dist=$REPLY
fi
if ((want_host)); then
  script_part host 300 "$TESTS_LOG" "$PY" benchmarks/bench_sdpa.py --sections host --out "$OUT/host"
  st_host=$REPLY
fi

# ------------------------------------------------------------ benchmark
if ((want_bench)); then
  if [[ -f benchmarks/bench_sdpa.py ]]; then
    mkdir -p "$OUT/bench"
    section "$TESTS_LOG" "bench: python benchmarks/bench_sdpa.py --out $OUT/bench ${BENCH_ARGS:-}"
    say "bench: running (log in tests.log)"
    # shellcheck disable=SC2086
    run_limited 480 "$TESTS_LOG" "$PY" benchmarks/bench_sdpa.py --out "$OUT/bench" ${BENCH_ARGS:-}
    rc=$?
    produced=$(ls "$OUT/bench" 2>/dev/null | tr '\n' ' ')
    case $rc in
      0) st_bench="ok: ${produced:-NOTHING WRITTEN}" ;;
      124|137) st_bench="TIMEOUT: ${produced:-nothing written}" ;;
      125) st_bench="skipped (time)" ;;
      *) st_bench="FAILED (rc $rc): ${produced:-nothing written}" ;;
    esac
  else
    st_bench="no benchmarks/bench_sdpa.py"
  fi
  say "bench: $st_bench"
fi

# ------------------------------------------------------------ summary (last)
nfiles=$(find "$OUT" -type f | wc -l)
echo
echo "==================== device_run summary ($((SECONDS - T0))s) ===================="
printf '%-7s %s\n' build "$st_build" ctest "$st_ctest" cpu "$st_cpu" gpu "$st_gpu" fuzz "$st_fuzz" \
  ragged "$st_ragged" doctor "$st_doctor" \
  sweep "$st_sweep" pytorch "$st_pytorch" dist "$st_dist" bench "$st_bench" host "$st_host"
printf '%-7s %s\n' files "$nfiles under $OUT"
fail=0
for s in "$st_build" "$st_ctest" "$st_cpu" "$st_gpu" "$st_fuzz" "$st_ragged" "$st_doctor" "$st_sweep" "$st_pytorch" "$st_dist" "$st_bench" \
         "$st_host"; do
  [[ "$s" == "-" || "$s" == ok* || "$s" == "no benchmarks"* ]] || fail=1
done
exit $fail
