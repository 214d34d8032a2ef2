# The Python packages the test suites need, for tools/test.sh and
# tools/test_torch_version.sh (sourced by both, so that the two install the
# same list). transformers is not here: it is optional (only its integration
# tests need it) and each script installs it on its own terms.

# The pip specs of the needed packages that python `$1` lacks, one per line.
test_deps_missing() {
  local py=$1 spec
  for spec in pytest:pytest hypothesis:hypothesis numpy:numpy wheel:wheel; do
    "$py" -c "import ${spec%%:*}" 2>/dev/null || echo "${spec#*:}"
  done
  # setuptools, and a recent one: a venv's bundled setuptools (65.5 with
  # Python 3.11) and a current wheel print wheel's FutureWarning on every
  # build (setuptools took bdist_wheel over in 70.1).
  "$py" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 71)' \
    2>/dev/null || echo "setuptools>=71"
}

# test_deps_install PY DIR SPEC...: installs the SPECs into DIR (pip --target),
# with those of their dependencies that PY, with DIR on its path, lacks; PY's
# own environment is left as it is. pip's resolver picks the versions against
# what PY has (--dry-run --report), and exactly those are installed, without
# dependencies: a plain --target install would also put a second copy of
# every dependency PY already has (numpy...) in DIR, ahead of PY's on the path.
# pip before 22.2 has no --report: then it is the plain install. Returns pip's
# status; its output is in DIR/pip.log.
test_deps_install() {
  local py=$1 dir=$2
  shift 2
  (($#)) || return 0
  mkdir -p "$dir" || return 1
  local log=$dir/pip.log report=$dir/pip-report.json pins=()
  local path="$dir${PYTHONPATH:+:$PYTHONPATH}"
  if PYTHONPATH=$path "$py" -m pip install --dry-run --report "$report" \
       -qq "$@" >"$log" 2>&1; then
    mapfile -t pins < <("$py" - "$report" <<'EOF'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(f'{item["metadata"]["name"]}=={item["metadata"]["version"]}')
EOF
    )
    ((${#pins[@]})) || return 0
    PYTHONPATH=$path "$py" -m pip install -qq --no-deps --upgrade --target "$dir" "${pins[@]}" >>"$log" 2>&1
  elif grep -q "no such option: --dry-run\|no such option: --report" "$log"; then
    PYTHONPATH=$path "$py" -m pip install -qq --upgrade --target "$dir" "$@" >>"$log" 2>&1
  else
    return 1
  fi
}
