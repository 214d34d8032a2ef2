#!/usr/bin/env bash
# Builds openwam_sdpa against one torch release and runs the CPU suite on it:
#
#     bash tools/test_torch_version.sh 2.15.0
#
# The checkout you work in is left alone (its editable install, its build/py
# and build/cmake, the system Python's torch). Everything lives in
# build/torch-VERSION/:
#   venv/   a virtual environment with torch==VERSION and the test deps
#           (tools/test_deps.sh, as tools/test.sh; transformers when it
#           installs). Kept and reused: the CUDA wheels are ~5.5 GB.
#   src/    a snapshot of the sources (see OPENWAM_TV_SOURCE); the extension is
#           built there and installed into venv/ (not editable), so the
#           checkout can keep changing while this runs. Its build/ is kept
#           between runs: unchanged sources are not recompiled.
#   cmake/  the CMake build of the op library and the Catch2 tests.
#   logs/   pip.log, build.log, pytest.log, cmake.log, ctest.log.
# It then runs `python -m pytest -q tests` (tests/gpu skip without a GPU) and
# ctest, and ends with one line: torch, build variant, source, counts, time.
# Exit status 0 only if the build, pytest and ctest all passed.
#
# On a CUDA torch (the 2.14.1 and 2.15.0 wheels are, CUDA 13.0 and 13.2) the
# extension is the CUDA variant: nvcc must match torch's CUDA major (nvcc 13.0
# builds against 2.15.0's 13.2; torch warns of the minor).
# TORCH_CUDA_ARCH_LIST defaults to 9.0a (sm90, where the defect lives;
# setup.py's own default compiles the CUDA files for three targets). setup.py
# picks C++17 or C++20 from torch's headers (2.14 and 2.15 need C++20). ctest
# builds the library without its CUDA kernels: the Catch2 tests run on the
# CPU. On 2 cores the first run with torch 2.14.1 took about 4 min for the
# extension, 1.5-2 min for pytest and several minutes for the CMake build;
# later runs recompile only what changed.
#
# Environment:
#   OPENWAM_TV_DIR      the working directory (default build/torch-VERSION)
#   OPENWAM_TV_VENV     the venv (default $OPENWAM_TV_DIR/venv); reused if present
#   OPENWAM_TV_SOURCE   what to build: "tree" (default: tracked and untracked,
#                       not ignored files of the working tree, as they are now)
#                       or a commit, e.g. HEAD (`git archive`: the committed code)
#   OPENWAM_TV_CTEST=0  skip CMake + ctest
#   PYTHON              the interpreter the venv is made from (default python3)
#   PIP_CONSTRAINT      pip's own: a pip.conf constraint that caps torch below
#                       VERSION stops the install ("The user requested
#                       (constraint) torch<=..." in pip.log);
#                       PIP_CONSTRAINT=/dev/null lifts it for this run
#   PYTEST_ARGS         extra pytest arguments (split on spaces)
#   TORCH_CUDA_ARCH_LIST, MAX_JOBS (default: cores), OPENWAM_SDPA_NO_CUDA=1
#                       (CPU-only extension on a CUDA torch): passed to setup.py
set -uo pipefail

VERSION=${1:-}
if [[ ! "$VERSION" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?([a-z0-9.+]*)$ ]]; then
  echo "usage: bash tools/test_torch_version.sh TORCH_VERSION   (e.g. 2.14.1)" >&2
  exit 2
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
WORK=${OPENWAM_TV_DIR:-$ROOT/build/torch-$VERSION}
VENV=${OPENWAM_TV_VENV:-$WORK/venv}
SOURCE=${OPENWAM_TV_SOURCE:-tree}
SRC=$WORK/src
LOGS=$WORK/logs
VPY=$VENV/bin/python
mkdir -p "$LOGS" "$SRC" || exit 1

export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# The venv's own site-packages only: no openwam_sdpa from the checkout.
unset PYTHONPATH PYTHONHOME
# As in device_run.sh: a compiler that links a private libstdc++ makes a build
# setup.py refuses; the system compiler does not.
if [[ -x /usr/bin/g++ && -x /usr/bin/gcc ]]; then export CXX=${CXX:-/usr/bin/g++} CC=${CC:-/usr/bin/gcc}; fi

T0=$SECONDS
say() { echo "== torch $VERSION [$((SECONDS - T0))s]: $*"; }
# pip's file:// indexes name every package they do not hold: noise, not news.
quiet_pip() { grep -v -E "^WARNING: Location '.*' is ignored" || true; }

exec 9>"$WORK/.lock"
flock -n 9 || { echo "another test_torch_version.sh is using $WORK" >&2; exit 1; }

# ------------------------------------------------------------ 1. the venv
if [[ ! -x "$VPY" ]]; then
  say "creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV" || { say "FAILED: python -m venv"; exit 1; }
fi
installed_torch() { "$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null; }
have=$(installed_torch)
if [[ "${have%%+*}" != "${VERSION%%+*}" ]]; then
  say "pip install torch==$VERSION (was: ${have:-none}; the CUDA wheels are ~5.5 GB)"
  "$VPY" -m pip install "torch==$VERSION" 2>&1 | quiet_pip >"$LOGS/pip.log"
  have=$(installed_torch)
  if [[ "${have%%+*}" != "${VERSION%%+*}" ]]; then
    # Why, when pip says it: a constraint, or no such release for this Python.
    grep -m3 -E "requested \(constraint\)|No matching distribution" "$LOGS/pip.log" ||
      tail -5 "$LOGS/pip.log"
    say "FAILED: torch==$VERSION did not install (see $LOGS/pip.log)"
    exit 1
  fi
fi
source tools/test_deps.sh
mapfile -t missing < <(test_deps_missing "$VPY")
if ((${#missing[@]})); then
  say "pip install ${missing[*]}"
  "$VPY" -m pip install "${missing[@]}" 2>&1 | quiet_pip >>"$LOGS/pip.log" ||
    { say "FAILED: pip install ${missing[*]} (see $LOGS/pip.log)"; exit 1; }
fi
if ! "$VPY" -c 'import transformers' 2>/dev/null; then
  "$VPY" -m pip install transformers 2>&1 | quiet_pip >>"$LOGS/pip.log" ||
    say "WARNING: transformers did not install; its tests skip"
fi
# A CUDA torch builds the op's cuDNN graphs: the frontend's headers (setup.py's pin).
if "$VPY" -c 'import sys, torch; sys.exit(not torch.version.cuda)' 2>/dev/null; then
  frontend=$(grep -oE '^CUDNN_FRONTEND_VERSION = "[0-9.]+"' setup.py | grep -oE '[0-9.]+')
  "$VPY" -m pip install --no-deps "nvidia-cudnn-frontend==$frontend" 2>&1 | quiet_pip >>"$LOGS/pip.log" ||
    { say "FAILED: pip install nvidia-cudnn-frontend==$frontend (see $LOGS/pip.log)"; exit 1; }
fi
torch_desc=$("$VPY" -c '
import torch
print("torch", torch.__version__, "(CUDA %s)" % (torch.version.cuda or "none"))')
say "venv ready: $torch_desc"

# ------------------------------------------------------------ 2. the sources
# The snapshot is unpacked into stage/, then src/ is brought level with it: a
# file whose content changed is copied (modification time now, so ninja
# recompiles it and what includes it), a file gone from the snapshot is
# removed (setup.py globs csrc/*.cpp), the rest is left alone. Comparing
# content, not times, keeps this right when switching between the tree and a
# commit.
STAGE=$WORK/stage
rm -rf "$STAGE" && mkdir -p "$STAGE" || exit 1
head=$(git -C "$ROOT" rev-parse --short HEAD)
if [[ "$SOURCE" == tree ]]; then
  # Tracked files as they are on disk plus untracked ones git does not ignore
  # (a new source file of work in progress); .external/ (other tools' clones) excepted.
  (cd "$ROOT" && git ls-files -z -c -o --exclude-standard -- . ':(exclude).external' |
     tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$STAGE" ||
    { say "FAILED: copying the working tree"; exit 1; }
  changed=$(git -C "$ROOT" --no-optional-locks status --porcelain --untracked-files=normal -- . ':(exclude).external' | wc -l)
  source_desc="working tree at $head + $changed uncommitted path(s) (copied $(date -u +%H:%M:%SZ))"
else
  commit=$(git -C "$ROOT" rev-parse --short "$SOURCE^{commit}") || { say "FAILED: no commit $SOURCE"; exit 1; }
  git -C "$ROOT" archive "$commit" | tar -xf - -C "$STAGE" || { say "FAILED: git archive $commit"; exit 1; }
  source_desc="commit $commit (git archive)"
fi
n_copied=0
while IFS= read -r -d '' f; do
  if ! cmp -s "$STAGE/$f" "$SRC/$f"; then
    mkdir -p "$(dirname "$SRC/$f")" && cp "$STAGE/$f" "$SRC/$f" && n_copied=$((n_copied + 1))
  fi
done < <(cd "$STAGE" && find . -type f -print0)
while IFS= read -r -d '' f; do
  [[ -e "$STAGE/$f" ]] || rm -f "$SRC/$f"
done < <(cd "$SRC" && find . -path ./build -prune -o -type f -print0)
rm -rf "$STAGE"
say "sources: $source_desc -> $SRC ($n_copied file(s) new or changed)"

# ------------------------------------------------------------ 3. the extension
say "building (MAX_JOBS=$MAX_JOBS, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
build_ok=1
(cd "$SRC" && "$VPY" -m pip install --no-build-isolation --no-deps --force-reinstall -v .) \
  >"$LOGS/build.log" 2>&1 || build_ok=0
# setup.py names what it built: "openwam_sdpa: torch X, CUDA build (...), C++20".
variant=$(grep -m1 -oE 'openwam_sdpa: torch .*' "$LOGS/build.log" | sed -E 's/^openwam_sdpa: torch [^,]*, //')
# Compiler diagnostics ("file:line: warning: ...", nvcc "warning #...") and
# Python warnings from the build, each distinct message once. Only files
# compiled in this run can warn: remove $SRC/build for a full count.
warnings=$(grep -E ': warning|warning #|Warning:' "$LOGS/build.log" | grep -v "is ignored: it is neither" |
           sed -E 's/^.*(warning|Warning)/\1/' | sort | uniq -c | sort -rn)
n_warn=$(grep -c . <<<"$warnings")
if ((build_ok)); then
  say "built: ${variant:-?}; $n_warn distinct warning(s) in what was compiled (see $LOGS/build.log)"
  [[ -n "$warnings" ]] && head -10 <<<"$warnings"
else
  grep -E -B2 -A6 '(error|Error)[: ]' "$LOGS/build.log" | head -60
  say "FAILED: building the extension (see $LOGS/build.log)"
fi

# ------------------------------------------------------------ 4. pytest
pytest_line="not run (no build)"
pytest_rc=1
if ((build_ok)); then
  # From src/, whose python/ is not on sys.path: the tests import the venv's copy.
  where=$(cd "$SRC" && "$VPY" -c 'import openwam_sdpa; print(openwam_sdpa.__file__)' 2>&1 | tail -1)
  say "openwam_sdpa from $where; python -m pytest -q tests"
  # shellcheck disable=SC2086  # PYTEST_ARGS is split on purpose
  (cd "$SRC" && "$VPY" -m pytest -q -p no:cacheprovider tests ${PYTEST_ARGS:-}) >"$LOGS/pytest.log" 2>&1
  pytest_rc=$?
  tail -15 "$LOGS/pytest.log"
  pytest_line=$(grep -E '^=*\s*([0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)|no tests ran)' \
                "$LOGS/pytest.log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
  [[ -z "$pytest_line" ]] && pytest_line="no summary (exit $pytest_rc)"
fi

# ------------------------------------------------------------ 5. ctest
ctest_line="skipped (OPENWAM_TV_CTEST=0)"
ctest_rc=0
if [[ "${OPENWAM_TV_CTEST:-1}" != 0 ]]; then
  ctest_rc=1
  say "cmake + ctest (CPU library, $WORK/cmake)"
  export CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5}
  cmake_args=(-S "$SRC" -B "$WORK/cmake" -DCMAKE_BUILD_TYPE=Release
              -DOPENWAM_PYTHON="$VPY" -DOPENWAM_WITH_CUDA=OFF)
  [[ ! -f "$WORK/cmake/CMakeCache.txt" ]] && command -v ninja >/dev/null && cmake_args+=(-G Ninja)
  if cmake "${cmake_args[@]}" >"$LOGS/cmake.log" 2>&1 &&
     cmake --build "$WORK/cmake" -j "$MAX_JOBS" >>"$LOGS/cmake.log" 2>&1; then
    (cd "$WORK/cmake" && ctest --output-on-failure -j "$MAX_JOBS") >"$LOGS/ctest.log" 2>&1
    ctest_rc=$?
    ctest_line=$(grep -E 'tests passed|No tests were found' "$LOGS/ctest.log" | tail -1)
    grep -q 'No tests were found' "$LOGS/ctest.log" && ctest_rc=1
    [[ -z "$ctest_line" ]] && ctest_line="no summary (exit $ctest_rc)"
  else
    grep -E -B2 -A6 '(error|Error)[: ]' "$LOGS/cmake.log" | head -40
    ctest_line="FAILED: cmake configure or build (see $LOGS/cmake.log)"
  fi
fi

# ------------------------------------------------------------ summary
status=0
((build_ok)) && [[ $pytest_rc -eq 0 && $ctest_rc -eq 0 ]] || status=1
echo "RESULT $( ((status)) && echo FAIL || echo PASS ): $torch_desc;" \
     "build $( ((build_ok)) && echo ok || echo FAILED ) (${variant:-variant unknown}, $n_warn distinct warnings in what was compiled);" \
     "source: $source_desc; pytest: $pytest_line; ctest: $ctest_line; $((SECONDS - T0))s"
exit $status
