#!/usr/bin/env bash
# The project's test command (the README's command 2):   bash tools/test.sh
#
# It tests this checkout and leaves the Python environment as it is: nothing
# is pip-installed into it, upgraded or replaced.
#
# 1. Dependencies. As root, apt-get installs what the C++ tests need and the
#    machine lacks (cmake, ninja-build, g++, catch2). The Python packages the
#    tests need and this Python lacks (tools/test_deps.sh: pytest,
#    hypothesis...; transformers for the optional integration tests) go into
#    build/test-deps/, put on PYTHONPATH for this run only.
# 2. The extension. With an editable install of this checkout, it is rebuilt
#    in place, as in the developer loop. Otherwise `setup.py build_ext --force`
#    runs in the build tree that `pip install .` (command 1) leaves in build/:
#    ninja recompiles what changed since (after command 1 on a fresh clone:
#    nothing; a relink of a few seconds). If the installed openwam_sdpa has
#    the same files as that build (_C.so byte for byte, every .py), pytest runs
#    on the install; if not (no install, another checkout's, older sources),
#    on a copy of this build in build/test/pkg, and the install is left alone.
# 3. python -m pytest -q tests (tests/gpu skip themselves without CUDA),
#    while CMake builds the C++ tests beside it in build/cmake (one core
#    fewer than MAX_JOBS, at least one): the op library is linked from the
#    objects of step 2 (not compiled a second time; a CPU-only extension's),
#    the Catch2 tests are compiled with torch's headers precompiled. On 2
#    cores the two had taken 412 s and 196 s one after the other.
# 4. ctest, once both are done.
# pytest and the C++ tests both run even if the other fails; the exit status
# is non-zero if any step failed. Logs: build/test-logs/.
#
# Environment: PYTHON (default python3), MAX_JOBS (default: all cores),
#   CATCH2_INCLUDE_DIR / CATCH2_PREFIX (a Catch2 v2 outside /usr).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
LOGS=$ROOT/build/test-logs
DEPS=$ROOT/build/test-deps
STAGE=$ROOT/build/test/pkg
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
  say "$PY cannot import torch: run the README's command 1 first (it installs torch when none is there)"
  exit 1
fi
# From here on every Python of this run finds build/test-deps first on its path.
export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
source tools/test_deps.sh
mapfile -t pip_pkgs < <(test_deps_missing "$PY")
if ((${#pip_pkgs[@]})); then
  say "pip install --target build/test-deps ${pip_pkgs[*]} (and what they need that $PY lacks)"
  test_deps_install "$PY" "$DEPS" "${pip_pkgs[@]}" ||
    { grep -v "is ignored: it is neither" "$DEPS/pip.log" | tail -20; say "pip install failed"; exit 1; }
fi
if ! "$PY" -c 'import transformers' 2>/dev/null; then
  say "pip install --target build/test-deps transformers (optional: only its integration tests need it)"
  test_deps_install "$PY" "$DEPS" transformers ||
    say "WARNING: transformers not installed (build/test-deps/pip.log); its tests will skip"
fi
"$PY" - <<'EOF'
import sys, torch
print(f"== test.sh: python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(cuda {torch.version.cuda}, available {torch.cuda.is_available()})")
EOF
say "dependencies ready ($(elapsed))"

# ------------------------------------------------------------ 2. the extension
# Where `import openwam_sdpa` would load it from (found, not imported), or "".
installed=$(cd / && "$PY" -c 'import importlib.util as u; s = u.find_spec("openwam_sdpa"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null)
build_ok=1
if [[ "$installed" == "$ROOT/python/openwam_sdpa" ]]; then
  build_temp=$ROOT/build/py
  say "editable install of this checkout: build_ext --inplace (MAX_JOBS=$MAX_JOBS; ninja recompiles what changed)"
  # --force: without it setuptools skips the build when _C.so is newer than
  # every .cpp, and a changed header would not be compiled in.
  "$PY" setup.py -q build_ext --inplace --force --build-temp "$build_temp" >"$LOGS/build_py.log" 2>&1 || build_ok=0
  under_test="the editable install of this checkout"
else
  # The build tree `pip install .` used: setuptools' default temp dir.
  build_temp=$ROOT/$("$PY" -c 'from setuptools.dist import Distribution
b = Distribution().get_command_obj("build"); b.finalize_options(); print(b.build_temp)')
  rm -rf "$STAGE" "$ROOT/build/test/lib" && mkdir -p "$STAGE"
  say "setup.py build_ext in ${build_temp#"$ROOT"/} (MAX_JOBS=$MAX_JOBS; ninja recompiles what changed)"
  "$PY" setup.py -q build_ext --force --build-temp "$build_temp" --build-lib build/test/lib \
    egg_info --egg-base "$STAGE" >"$LOGS/build_py.log" 2>&1 || build_ok=0
  if ((build_ok)) && [[ -n "$installed" ]] &&
     "$PY" tools/installed_is_build.py "$installed" python/openwam_sdpa build/test/lib/openwam_sdpa
  then
    rm -rf "$STAGE"
    under_test="the installed openwam_sdpa ($installed): the same files as this checkout's build"
  elif ((build_ok)); then
    cp -r python/openwam_sdpa "$STAGE/" && rm -rf "$STAGE/openwam_sdpa/__pycache__" "$STAGE"/openwam_sdpa/_C*.so &&
      cp build/test/lib/openwam_sdpa/_C*.so "$STAGE/openwam_sdpa/" || build_ok=0
    export PYTHONPATH="$STAGE:$PYTHONPATH"
    under_test="this checkout's build in build/test/pkg (on PYTHONPATH; ${installed:-no openwam_sdpa is installed}${installed:+ is not this build and is left alone})"
  fi
fi
if ((build_ok)); then
  say "extension built ($(elapsed)); testing $under_test"
else
  grep -E -B2 -A8 "error|Error" "$LOGS/build_py.log" | head -80
  say "FAILED: building the extension (full log: build/test-logs/build_py.log)"
fi

# ------------------------------------------------------------ 3a. the C++ tests' build, in the background
ctest_rc=1
ctest_line="not run (cmake configure or build failed)"
cmake_args=(-S "$ROOT" -B "$CMAKE_DIR" -DCMAKE_BUILD_TYPE=Release
            -DOPENWAM_PYTHON="$(command -v "$PY")")
command -v ninja >/dev/null && [[ ! -f "$CMAKE_DIR/CMakeCache.txt" ]] && cmake_args+=(-G Ninja)
[[ -n "${CATCH2_INCLUDE_DIR:-}" ]] && cmake_args+=(-DCATCH2_INCLUDE_DIR="$CATCH2_INCLUDE_DIR")
[[ -n "${CATCH2_PREFIX:-}" ]] && cmake_args+=(-DCMAKE_PREFIX_PATH="$CATCH2_PREFIX")
# A CPU-only extension's objects, as step 2's build.ninja lists them (the
# Python bindings in csrc/python/ aside), are the library's sources compiled
# with the same macros CMake gives them: the library is linked from them. A
# CUDA build's objects come with CUDA sources, flags and link libraries of
# their own; there CMake compiles csrc itself.
objects=()
if ((build_ok)) && [[ -f "$build_temp/build.ninja" ]] &&
   ! grep -qE 'cuda_compile|-DOPENWAM_WITH_CUDA' "$build_temp/build.ninja"; then
  mapfile -t objects < <(sed -nE 's|^build (.*\.o): compile .*|\1|p' "$build_temp/build.ninja" |
                         grep -v '/csrc/python/')
fi
if ((${#objects[@]})); then
  cmake_args+=("-DOPENWAM_PREBUILT_OBJECTS=$(IFS=';'; echo "${objects[*]}")" -DOPENWAM_WITH_CUDA=OFF)
  cmake_what="the library linked from ${#objects[@]} objects of step 2"
else
  # -U: CMake decides CUDA afresh, whatever an earlier run of the other kind left cached.
  cmake_args+=(-DOPENWAM_PREBUILT_OBJECTS= -UOPENWAM_WITH_CUDA)
  cmake_what="the library compiled from csrc"
fi
# Beside pytest, which keeps a core: in a process group of its own (setsid),
# so that an interrupted run stops its compilers too. pytest takes a Ctrl-C
# and exits, so the script exits on INT and TERM itself (review: the first
# Ctrl-C left it waiting for the build).
cmake_jobs=$((MAX_JOBS > 1 ? MAX_JOBS - 1 : 1))
say "cmake configure + build in the background (build/cmake, -j$cmake_jobs): $cmake_what"
build_cpp_tests() { cmake "${cmake_args[@]}" && cmake --build "$CMAKE_DIR" -j "$cmake_jobs"; }
if command -v setsid >/dev/null; then
  export -f build_cpp_tests
  setsid bash -c "$(declare -p cmake_args CMAKE_DIR cmake_jobs); build_cpp_tests" >"$LOGS/cmake.log" 2>&1 &
else
  build_cpp_tests >"$LOGS/cmake.log" 2>&1 &
fi
cmake_pid=$!
stop_cpp_build() { kill -- -"$cmake_pid" 2>/dev/null || kill "$cmake_pid" 2>/dev/null; }
trap stop_cpp_build EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------ 3b. pytest, beside it
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

# ------------------------------------------------------------ 4. ctest
say "waiting for the C++ tests' build ($(elapsed))"
wait "$cmake_pid"
cmake_rc=$?
trap - EXIT  # reaped: its pid may be another process's from here on
if ((cmake_rc == 0)); then
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
