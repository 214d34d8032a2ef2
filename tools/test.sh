#!/usr/bin/env bash
# The project's test command:   bash tools/test.sh
#
# 1. installs what the tests need (apt: cmake ninja-build g++ catch2, as root
#    only; pip: torch==2.13.0 if no torch is importable, the list of
#    tools/test_deps.sh (pytest, hypothesis, numpy, pybind11, wheel,
#    setuptools >= 71), and transformers for the optional integration tests;
#    pip -qq: this machine kind's pip configuration names package indexes
#    that do not exist, and pip warns about each; errors still show),
# 2. builds and installs the extension (pip install --no-build-isolation -e .),
# 3. runs `python -m pytest -q tests` (tests/gpu skip themselves without CUDA),
# 4. builds the C++ library and Catch2 tests with CMake in build/cmake and runs
#    ctest.
# Steps 3 and 4 both run even if the other fails; the exit status is non-zero
# if any step failed. Logs: build/test-logs/.
#
# Environment: PYTHON (default python3), MAX_JOBS (default: all cores),
#   CATCH2_INCLUDE_DIR / CATCH2_PREFIX (a Catch2 v2 outside /usr),
#   OPENWAM_REINSTALL=1 (force the pip install even where an editable install
#   of this checkout exists; CI always does it).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
LOGS=$ROOT/build/test-logs
CMAKE_DIR=$ROOT/build/cmake
mkdir -p "$LOGS"

say() { echo "== test.sh: $*"; }
T0=$SECONDS
elapsed() { echo "$((SECONDS - T0))s"; }

# ------------------------------------------------------------ 1. dependencies
apt_pkgs=()
command -v cmake >/dev/null || apt_pkgs+=(cmake)
command -v ninja >/dev/null || apt_pkgs+=(ninja-build)
command -v g++ >/dev/null || apt_pkgs+=(g++)
if [[ -z "${CATCH2_INCLUDE_DIR:-}" && -z "${CATCH2_PREFIX:-}" && ! -f /usr/include/catch2/catch.hpp ]]; then
  apt_pkgs+=(catch2)
fi
if ((${#apt_pkgs[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    say "apt-get install ${apt_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}"; } \
      >"$LOGS/apt.log" 2>&1 || { tail -20 "$LOGS/apt.log"; say "apt-get install failed"; exit 1; }
  else
    say "not root (or no apt-get): NOT installing ${apt_pkgs[*]}; the C++ tests need them"
  fi
fi

if ! "$PY" -c 'import torch' 2>/dev/null; then
  say "no importable torch: pip install torch==2.13.0"
  "$PY" -m pip install -qq torch==2.13.0 || { say "installing torch failed"; exit 1; }
fi
source tools/test_deps.sh
mapfile -t pip_pkgs < <(test_deps_missing "$PY")
if ((${#pip_pkgs[@]})); then
  say "pip install ${pip_pkgs[*]}"
  "$PY" -m pip install -qq "${pip_pkgs[@]}" || { say "pip install failed"; exit 1; }
fi
if ! "$PY" -c 'import transformers' 2>/dev/null; then
  say "pip install transformers (optional: only its integration tests need it)"
  "$PY" -m pip install -qq transformers || say "WARNING: transformers not installed; its tests will skip"
fi
"$PY" - <<'EOF'
import sys, torch
print(f"== test.sh: python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(cuda {torch.version.cuda}, available {torch.cuda.is_available()})")
EOF
say "dependencies ready ($(elapsed))"

# ------------------------------------------------------------ 2. the extension
build_ok=1
# An editable install of this checkout maps openwam_sdpa to python/: then an
# in-place incremental rebuild (ninja in build/py) is all that is needed.
# (pip's own editable build always starts from an empty temp dir.)
installed_here=0
if [[ "${CI:-}" != "true" && "${OPENWAM_REINSTALL:-0}" == "0" ]]; then
  loc=$(cd /tmp && "$PY" -c 'import importlib.util as u; s=u.find_spec("openwam_sdpa"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null || true)
  [[ "$loc" == "$ROOT/python/openwam_sdpa" ]] && installed_here=1
fi
if ((installed_here)); then
  say "editable install of this checkout found: incremental build_ext --inplace (MAX_JOBS=$MAX_JOBS)"
  "$PY" setup.py -q build_ext --inplace --build-temp build/py >"$LOGS/build_py.log" 2>&1 || build_ok=0
else
  say "pip install --no-build-isolation --no-deps -e . (MAX_JOBS=$MAX_JOBS)"
  "$PY" -m pip install --no-build-isolation --no-deps -v -e . >"$LOGS/build_py.log" 2>&1 || build_ok=0
fi
if ((build_ok)); then
  say "extension built ($(elapsed))"
else
  grep -E -B2 -A8 "error|Error" "$LOGS/build_py.log" | head -80
  say "FAILED: building the extension (full log: build/test-logs/build_py.log)"
fi

# ------------------------------------------------------------ 3. pytest
pytest_rc=1
pytest_line="not run (the extension did not build)"
if ((build_ok)); then
  say "python -m pytest -q tests"
  "$PY" -m pytest -q tests 2>&1 | tee "$LOGS/pytest.log"
  pytest_rc=${PIPESTATUS[0]}
  pytest_line=$(grep -E '^=*\s*([0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)|no tests ran)' \
                "$LOGS/pytest.log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
  if [[ $pytest_rc -eq 5 ]]; then
    say "WARNING: pytest collected no tests"
    pytest_rc=0
  fi
fi

# ------------------------------------------------------------ 4. cmake + ctest
ctest_rc=1
ctest_line="not run (cmake configure or build failed)"
cmake_args=(-S "$ROOT" -B "$CMAKE_DIR" -DCMAKE_BUILD_TYPE=Release
            -DOPENWAM_PYTHON="$(command -v "$PY")")
command -v ninja >/dev/null && [[ ! -f "$CMAKE_DIR/CMakeCache.txt" ]] && cmake_args+=(-G Ninja)
[[ -n "${CATCH2_INCLUDE_DIR:-}" ]] && cmake_args+=(-DCATCH2_INCLUDE_DIR="$CATCH2_INCLUDE_DIR")
[[ -n "${CATCH2_PREFIX:-}" ]] && cmake_args+=(-DCMAKE_PREFIX_PATH="$CATCH2_PREFIX")
say "cmake configure + build (build/cmake, -j$MAX_JOBS)"
if cmake "${cmake_args[@]}" >"$LOGS/cmake.log" 2>&1 &&
   cmake --build "$CMAKE_DIR" -j "$MAX_JOBS" >>"$LOGS/cmake.log" 2>&1; then
  say "C++ library and tests built ($(elapsed)); ctest"
  (cd "$CMAKE_DIR" && ctest --output-on-failure -j "$MAX_JOBS") 2>&1 | tee "$LOGS/ctest.log"
  ctest_rc=${PIPESTATUS[0]}
  ctest_line=$(grep -E 'tests passed|No tests were found' "$LOGS/ctest.log" | tail -1)
  [[ -z "$ctest_line" ]] && ctest_line="no summary (see build/test-logs/ctest.log)"
  # "No tests were found" exits 0 on older ctest; it is a failure here.
  grep -q 'No tests were found' "$LOGS/ctest.log" && ctest_rc=1
else
  grep -E -B2 -A8 "error|Error" "$LOGS/cmake.log" | head -80
  say "FAILED: cmake (full log: build/test-logs/cmake.log)"
fi

# ------------------------------------------------------------ summary
echo
say "summary ($(elapsed))"
printf '  %-8s %s\n' "build:" "$( ((build_ok)) && echo ok || echo FAILED)"
printf '  %-8s %s (exit %s)\n' "pytest:" "$pytest_line" "$pytest_rc"
printf '  %-8s %s (exit %s)\n' "ctest:" "$ctest_line" "$ctest_rc"
count() { grep -oE "[0-9]+ $1" <<<"$2" | head -1 | grep -oE '^[0-9]+' || echo 0; }
py_pass=$(count passed "$pytest_line"); py_skip=$(count skipped "$pytest_line")
py_fail=$(( $(count failed "$pytest_line") + $(count error "$pytest_line") ))
ct_total=$(grep -oE 'out of [0-9]+' <<<"$ctest_line" | grep -oE '[0-9]+' || echo 0)
ct_fail=$(grep -oE '[0-9]+ tests failed' <<<"$ctest_line" | grep -oE '^[0-9]+' || echo 0)
if ((build_ok)) && [[ $pytest_rc -eq 0 && $ctest_rc -eq 0 ]]; then
  say "ALL PASSED"; status=0
else
  say "FAILED"; status=1
  # a step that failed without failing a counted test still counts as one failure
  ((py_fail + ct_fail == 0)) && ct_fail=1
fi
# One plain closing line over both runners (pytest + ctest).
echo "total: $((py_pass + ct_total - ct_fail)) passed, $((py_fail + ct_fail)) failed, ${py_skip} skipped"
exit $status
